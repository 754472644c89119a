"""The RL loop: PPO with a critic (GAE), GRPO, RLOO, REINFORCE++ — one process, any hardware.

Read `RLTrainer.train_step` top to bottom; it is the whole algorithm:

    rollout -> reward -> old/ref log-probs -> values -> advantages -> critic update -> actor update
    then, around it: validate every test_freq, checkpoint every save_freq, log every step.

Every hardware choice (dtypes, attention, micro-batch sizes, offload, where the reference model lives) comes from
the Plan made by the planner (planner.py) before anything was loaded; this file only follows it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import random
import resource
import shutil
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from tqdm.auto import tqdm

from . import algorithms as algo
from .checkpoint import (capture_rng, find_latest_checkpoint, load_checkpoint, restore_rng, resume_latest,
                         retire_later_checkpoints, save_checkpoint)
from .config import as_list, to_yaml
from .errors import UserError
from .data import PromptLoader, RLDataset
from .distributed import DataParallel, NullTracker, check_world_config
from .plans import Plan
from .planner import autocast_context, make_grad_scaler
from .vocabulary import precision_name
from .logprobs import response_logprobs
from .lora import adapter_disabled, apply_lora, merged_state_for_export
from .microbatch import compact_rows, split_fixed, split_rows_by_token_budget
from .models import (ModelSource, ValueModel, enable_gradient_checkpointing, load_causal_lm, load_tokenizer,
                     resolve_model_source, response_values)
from .oom import OOMGuard
from .precision_guard import PrecisionGuard, StepOutcome, logprobs_comparable, optimizer_step, rollout_logprob_gap
from .offload import load_optimizer_state, offload_optimizer_state, on_device
from .rewards import RewardManager, load_custom_reward
from .plans import RuntimeSizes
from .rollout import make_engine
from .dist_checkpoint import load_checkpoint_any, save_full_model, save_sharded
from .sharding import (call_in_root_forward, gathered, is_sharded, matched_micro_batches, needs_gradient_sum,
                       shard_for_plan, sync_engine, weights_for_rollout)
from .runguard import RunInterrupted, StepDropped, StopSignals, prepare_run_dir
from .rollout.base import RolloutBatch, SamplingParams, StopStringMatcher, collect_eos_ids
from .tracking import Tracker

log = logging.getLogger(__name__)


class TrainingStopped(UserError):
    """The run stopped itself rather than train on garbage: diverged updates, or every reward call failing."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class StepBatch:
    """Everything known about one step's sequences; tensors are [rows, response_len] unless noted."""

    rollout: RolloutBatch
    group_index: torch.Tensor  # [rows] which prompt each row answers
    scores: torch.Tensor  # [rows]
    reward_info: dict
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    token_rewards: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    metrics: dict = field(default_factory=dict)
    loss_mask: Optional[torch.Tensor] = None  # the response mask less rows kept out of the losses (truncated ones)

    @property
    def mask(self) -> torch.Tensor:
        """The mask the losses and their normalisers use."""
        return self.loss_mask if self.loss_mask is not None else self.rollout.response_mask.float()

    @property
    def rows(self) -> int:
        return self.rollout.response_ids.shape[0]


def concat_rollouts(parts: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """Stack rollouts generated in several engine calls: prompts stay left-padded, responses right-padded."""
    if len(parts) == 1:
        return parts[0]
    width_p = max(p.prompt_ids.shape[1] for p in parts)
    width_r = max(p.response_ids.shape[1] for p in parts)
    left = lambda t, v: torch.nn.functional.pad(t, (width_p - t.shape[1], 0), value=v)  # noqa: E731
    right = lambda t, v: torch.nn.functional.pad(t, (0, width_r - t.shape[1]), value=v)  # noqa: E731
    return RolloutBatch(
        prompt_ids=torch.cat([left(p.prompt_ids, pad_token_id) for p in parts]),
        prompt_mask=torch.cat([left(p.prompt_mask, 0) for p in parts]),
        response_ids=torch.cat([right(p.response_ids, pad_token_id) for p in parts]),
        response_mask=torch.cat([right(p.response_mask, 0) for p in parts]),
        response_logprobs=torch.cat([right(p.response_logprobs, 0.0) for p in parts]),
        num_prompts=sum(p.num_prompts for p in parts), n=parts[0].n)


@dataclass
class ScoredRollout:
    """Steps 1-2 of a step: prompts, their rollout, per-row scores and the reward details (lists per row)."""

    items: list[dict]
    rollout: RolloutBatch
    scores: torch.Tensor
    info: dict

    def select(self, prompts: list[int]) -> "ScoredRollout":
        """The given prompts with their n samples each, in that order (counts such as num_errors are kept)."""
        r = self.rollout
        rows = [p * r.n + j for p in prompts for j in range(r.n)]
        info = {key: [value[i] for i in rows] if isinstance(value, list) else value for key, value in self.info.items()}
        rollout = RolloutBatch(prompt_ids=r.prompt_ids[rows], prompt_mask=r.prompt_mask[rows],
                               response_ids=r.response_ids[rows], response_mask=r.response_mask[rows],
                               response_logprobs=r.response_logprobs[rows], num_prompts=len(prompts), n=r.n)
        return ScoredRollout([self.items[p] for p in prompts], rollout, self.scores[rows], info)

    @staticmethod
    def concat(parts: list["ScoredRollout"], pad_token_id: int) -> "ScoredRollout":
        if len(parts) == 1:
            return parts[0]
        info = {key: (sum((part.info[key] for part in parts), []) if isinstance(value, list)
                      else sum(part.info[key] for part in parts)) for key, value in parts[0].info.items()}
        return ScoredRollout(sum((part.items for part in parts), []),
                             concat_rollouts([part.rollout for part in parts], pad_token_id),
                             torch.cat([part.scores for part in parts]), info)


# The plan fields OOM recovery may lower during a run; saved with each checkpoint and restored on resume.


class PhaseTimer:
    def __init__(self, device: str):
        self.device = device
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start


def _make_scheduler(optimizer, optim_cfg, total_steps: int):
    """verl's schedules: linear warm-up, then constant or cosine decay to min_lr_ratio * lr."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    warmup = optim_cfg.lr_warmup_steps
    if warmup < 0:
        warmup = int(optim_cfg.lr_warmup_steps_ratio * total_steps)
    if optim_cfg.warmup_style == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total_steps,
                                                           min_lr_rate=optim_cfg.min_lr_ratio)
    if optim_cfg.warmup_style != "constant":
        raise ValueError(f"optim.warmup_style={optim_cfg.warmup_style!r}: use constant or cosine")
    return get_constant_schedule_with_warmup(optimizer, warmup)


def _plain(value):
    """An OmegaConf list as a plain list (peft wants list or str)."""
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def _peak_memory_gib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux: the process's resident high-water mark.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class RLTrainer:
    def __init__(self, cfg: DictConfig, plan: Plan, run_dir: str, notices: Optional[list[str]] = None):
        self.cfg, self.plan, self.run_dir = cfg, plan, run_dir
        self.device = plan.device
        self.notices = list(notices or [])
        # [distributed] this process's rank among torchrun's (alone: world 1, every collective a no-op)
        self.dp = DataParallel.from_env(self.device, plan.dist_backend)
        check_world_config(cfg, self.dp.world)  # before any model loads: what data parallelism cannot run
        # first of all: the run dir's lock and every check that must fail before a model loads. [distributed] The
        # ranks of one job share the run dir: rank 0 takes the lock, checks and writes; the others wait for it
        self.run_lock = None
        if self.dp.is_main:
            self.run_lock = prepare_run_dir(run_dir, cfg)
            with open(os.path.join(run_dir, "config.yaml"), "w") as handle:
                handle.write(to_yaml(cfg))
        self.dp.barrier()  # rank 0's checks passed (a failure ends the job: torchrun stops the waiting ranks)
        seed_everything(cfg.trainer.seed)

        acfg, algo_cfg = cfg.actor_rollout_ref, cfg.algorithm
        self.n = acfg.rollout.n
        self.use_critic = algo_cfg.adv_estimator == "gae"
        kl_in_reward = algo_cfg.use_kl_in_reward and algo_cfg.kl_ctrl.kl_coef > 0
        kl_as_loss = acfg.actor.use_kl_loss and acfg.actor.kl_loss_coef > 0
        self.use_ref = kl_in_reward or kl_as_loss
        self.use_lora = acfg.model.lora_rank > 0

        # ---- tokenizer, data, reward
        self.source = resolve_model_source(acfg.model.path, acfg.model.gguf_file)
        tok_source = ModelSource(cfg.data.tokenizer or acfg.model.tokenizer_path) if (
            cfg.data.tokenizer or acfg.model.tokenizer_path) else self.source
        self.tokenizer = load_tokenizer(tok_source, acfg.model.trust_remote_code)

        def dataset(files):
            return RLDataset(as_list(files), self.tokenizer, cfg.data.max_prompt_length, prompt_key=cfg.data.prompt_key,
                             truncation=cfg.data.truncation, filter_overlong_prompts=cfg.data.filter_overlong_prompts,
                             reward_fn_key=cfg.data.reward_fn_key)

        self.train_set = dataset(cfg.data.train_files)
        self.val_set = dataset(cfg.data.val_files) if cfg.data.val_files else None
        # with dynamic sampling a step draws gen_batch_size prompts per generation round (verl's DAPO trainer)
        self.loader = PromptLoader(self.train_set, cfg.data.gen_batch_size or cfg.data.train_batch_size,
                                   shuffle=cfg.data.shuffle,
                                   seed=cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed)
        custom = cfg.custom_reward_function
        self.reward_manager = RewardManager(load_custom_reward(custom.path, custom.name) if custom.path else None,
                                            timeout_s=custom.timeout_s)
        self.total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * self.loader.steps_per_epoch

        # ---- models: actor (+LoRA), reference, critic
        self.actor = load_causal_lm(self.source, plan, acfg.model.trust_remote_code, acfg.model.override_config)
        # The critic is built first: it copies the actor's backbone before LoRA layers are injected into it.
        self.critic = None
        if self.use_critic:
            base = self.actor  # the critic starts from the actor's weights (before any LoRA is injected)
            if cfg.critic.model.path and cfg.critic.model.path != acfg.model.path:
                base = load_causal_lm(resolve_model_source(cfg.critic.model.path, cfg.critic.model.gguf_file), plan,
                                      cfg.critic.model.trust_remote_code, cfg.critic.model.override_config)
            self.critic = ValueModel.from_causal_lm(base).to(self.device)
            cmodel = cfg.critic.model
            if cmodel.lora_rank > 0:
                # LoRA on the backbone only: the value head is new and is trained in full.
                self.critic.backbone = apply_lora(self.critic.backbone, cmodel.lora_rank, cmodel.lora_alpha,
                                                  _plain(cmodel.target_modules))
        if self.use_lora:
            self.actor = apply_lora(self.actor, acfg.model.lora_rank, acfg.model.lora_alpha,
                                    _plain(acfg.model.target_modules))
        self.ref = None
        if self.use_ref and not self.use_lora:
            # Same weights as the initial actor; a copy avoids loading (and dequantizing) twice.
            self.ref = copy.deepcopy(self.actor).to(plan.ref_device).eval().requires_grad_(False)
        self.actor.to(self.device)
        for model in (self.actor, self.critic, self.ref):
            self.dp.broadcast_parameters(model)  # [distributed] identical replicas from the first step
        if plan.gradient_checkpointing:
            enable_gradient_checkpointing(self.actor)
            if self.critic is not None:
                enable_gradient_checkpointing(self.critic)
        shard_for_plan(plan, self.actor, self.critic, self.ref)  # [distributed] FSDP2 when plan.data_parallel=shard

        # ---- optimizers and schedules
        def adamw(model, ocfg):
            params = [p for p in model.parameters() if p.requires_grad]
            return torch.optim.AdamW(params, lr=ocfg.lr, betas=tuple(ocfg.betas), weight_decay=ocfg.weight_decay)

        self.optimizers = {"actor": adamw(self.actor, acfg.actor.optim)}
        self.schedulers = {"actor": _make_scheduler(self.optimizers["actor"], acfg.actor.optim, self.total_steps)}
        if self.critic is not None:
            self.optimizers["critic"] = adamw(self.critic, cfg.critic.optim)
            self.schedulers["critic"] = _make_scheduler(self.optimizers["critic"], cfg.critic.optim, self.total_steps)
        self.grad_scaler = make_grad_scaler(plan)  # fp16 plans: one dynamic loss scale for actor and critic
        # the guard speaks of the rollout's precision: its overflow rule is for half-precision rollouts
        self.precision_guard = PrecisionGuard.from_config(cfg.hardware, precision_name(plan.rollout.dtype))
        self.last_step_outcome: Optional[StepOutcome] = None
        self.kl_ctrl = algo.make_kl_controller(algo_cfg.kl_ctrl.type, algo_cfg.kl_ctrl.kl_coef,
                                               algo_cfg.kl_ctrl.target_kl, algo_cfg.kl_ctrl.horizon)
        # A token budget can shrink no further than one full-length sequence.
        self.oom_guard = OOMGuard(plan.sizes, log_fn=lambda msg: log.warning("%s", msg), min_size={
            "max_token_len_per_micro_batch": cfg.data.max_prompt_length + self.response_length})

        # ---- rollout engine (shares the actor's weights)
        with gathered(self.actor):  # [distributed] a sharded actor: the engine is built on its full weights
            self.engine = make_engine(self.actor, self.tokenizer, plan, engine=acfg.rollout.name)
        fallback = getattr(self.engine, "fallback_reason", None)
        if fallback and plan.rollout.engine != "hf":
            plan.rollout.engine = "hf"
            plan.reasons["rollout_engine"] = f"{plan.reasons.get('rollout_engine', '')}; fell back to hf: {fallback}"
        self.write_plan_record()  # after the engine is known: the record shows what runs
        # On a tight card the KV cache must not sit beside the update's activations (the estimator assumes so).
        estimate = plan.estimate or {}
        self.release_rollout_memory = self.device != "cpu" and (
            plan.memory_fraction is not None
            or estimate.get("peak_bytes", 0) > 0.6 * (estimate.get("budget_bytes") or float("inf")))
        self.global_step = 0
        self.tracker: Optional[Tracker] = None
        self.stop_signals: Optional[StopSignals] = None
        self.nonfinite_streak = 0  # optimizer updates skipped in a row for a non-finite grad norm
        self.last_good_checkpoint: Optional[str] = None  # the newest one saved (or resumed) before any such streak
        self.stop_limits = {  # read up front: the run stops itself after this many bad updates / reward steps
            "trainer.max_consecutive_nonfinite_updates": cfg.trainer.max_consecutive_nonfinite_updates,
            "trainer.max_consecutive_failed_reward_steps": cfg.trainer.max_consecutive_failed_reward_steps}

    # ------------------------------------------------------------------------------------------ helpers
    def write_plan_record(self) -> None:
        """plan.json: every decision with its reason, as it runs now (engine fallback, sizes OOM recovery lowered)."""
        if not self.dp.is_main:
            return
        record = {**self.plan.to_dict(), "notices": self.notices, "oom_events": self.oom_guard.events}
        tmp = os.path.join(self.run_dir, "plan.json.tmp")
        with open(tmp, "w") as handle:
            json.dump(record, handle, indent=2)
        os.replace(tmp, os.path.join(self.run_dir, "plan.json"))

    def guarded(self, phase: str, fn: Callable[[int], object], size_attr: str):
        """fn(size) under OOM recovery (hardware.oom_recovery): on CUDA OOM, halve plan.<size_attr> and redo."""
        # [distributed] a sharded update communicates per layer: one rank redoing a micro-batch alone would hang the
        # others, so an OOM there ends the job (rollout and no-grad passes run gathered: they may recover)
        if not self.cfg.hardware.oom_recovery or (phase.endswith("_update") and is_sharded(self.actor)):
            return fn(getattr(self.plan.sizes, size_attr))
        events = len(self.oom_guard.events)
        try:
            return self.oom_guard.run(phase, fn, size_attr)
        finally:
            if len(self.oom_guard.events) != events:
                self.write_plan_record()

    @property
    def response_length(self) -> int:
        return self.cfg.actor_rollout_ref.rollout.response_length or self.cfg.data.max_response_length

    def sampling_params(self, validation: bool = False) -> SamplingParams:
        rcfg = self.cfg.actor_rollout_ref.rollout
        kw = rcfg.val_kwargs if validation else rcfg
        greedy = not kw.do_sample or kw.temperature == 0
        return SamplingParams(max_new_tokens=self.response_length, temperature=0.0 if greedy else kw.temperature,
                              top_p=kw.top_p, top_k=max(kw.top_k, 0), n=kw.n if validation else rcfg.n,
                              stop_strings=tuple(as_list(rcfg.stop)), ignore_eos=bool(rcfg.ignore_eos and not validation))

    def step_generator(self, step: int, salt: int = 0, first_prompt: int = 0) -> torch.Generator:
        """Sampling randomness is a function of (seed, step, global index of the call's first prompt): a resumed run
        draws exactly what it would have, and a rank draws what one process would for the same prompts."""
        gen = torch.Generator(device=self.device if self.device.startswith("cuda") else "cpu")
        gen.manual_seed(self.cfg.trainer.seed * 1_000_003 + step * 7919 + salt + first_prompt * 104_729)
        return gen

    @property
    def uses_token_budget(self) -> bool:
        return self.plan.sizes.max_token_len_per_micro_batch is not None

    def size_attr(self, fixed_size_attr: str) -> str:
        """The plan field that sizes a phase's micro-batches: the token budget when there is one."""
        return "max_token_len_per_micro_batch" if self.uses_token_budget else fixed_size_attr

    def micro_batches(self, batch: StepBatch, rows: list[int], size: int) -> list[list[int]]:
        if self.uses_token_budget:
            groups = split_rows_by_token_budget(batch.rollout.prompt_mask[rows], batch.rollout.response_mask[rows],
                                                size)
            return [[rows[i] for i in group] for group in groups]
        return [[rows[i] for i in group] for group in split_fixed(len(rows), size)]

    def forward_rows(self, batch: StepBatch, rows: list[int]):
        """Padding-free tensors for a micro-batch: (input_ids, attention_mask, position_ids, response_len)."""
        r = batch.rollout
        tensors = compact_rows(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask, rows,
                               self.tokenizer.pad_token_id)
        return tuple(t.to(self.device) if torch.is_tensor(t) else t for t in tensors)

    @torch.no_grad()
    def forward_all(self, phase: str, batch: StepBatch, compute: Callable) -> torch.Tensor:
        """compute(ids, mask, position_ids, response_len) -> [rows, response_len] over every micro-batch, gathered
        into a [rows, R] CPU tensor (0 at padding); micro-batched by the plan, OOM-guarded."""

        def run(size: int) -> torch.Tensor:
            out = torch.zeros(batch.mask.shape, dtype=torch.float32)
            for rows in self.micro_batches(batch, list(range(batch.rows)), size):
                ids, mask, pos, resp_len = self.forward_rows(batch, rows)
                with autocast_context(self.plan):
                    out[rows, :resp_len] = compute(ids, mask, pos, resp_len).float().cpu()
            return out * batch.rollout.response_mask  # every response: a loss mask only narrows the losses

        return self.guarded(phase, run, self.size_attr("logprob_micro_batch_size"))

    def batched_logprobs(self, model, batch: StepBatch) -> torch.Tensor:
        """Log-probs of every response token under `model`."""
        temperature = self.cfg.actor_rollout_ref.rollout.temperature or 1.0
        logprobs = call_in_root_forward(model, response_logprobs)  # [distributed] sharded: in the root's forward
        with gathered(model):  # [distributed] sharded: full weights for the pass, so ranks need not match calls
            return self.forward_all("log_probs", batch, lambda ids, mask, pos, resp_len: logprobs(
                model, ids, mask, resp_len, temperature=temperature, chunk_size=self.plan.logprob_chunk_size,
                position_ids=pos)[0])

    def batched_values(self, batch: StepBatch) -> torch.Tensor:
        with gathered(self.critic):  # [distributed] sharded: full weights for the pass
            return self.forward_all("values", batch, lambda ids, mask, pos, resp_len: response_values(
                self.critic, ids, mask, resp_len, pos))

    def ref_context(self):
        """The reference policy: a frozen copy, or with LoRA the adapter-disabled base (no extra weights).

        A reference kept on the CPU (to leave the card to actor and critic) visits the GPU for its forward only."""
        if self.use_lora:
            return self.actor, adapter_disabled(self.actor)
        visiting = self.plan.ref_device == "cpu" and self.device != "cpu"
        return self.ref, on_device(self.ref, self.device, enabled=visiting)

    def offloaded_while(self, phase: str):
        """With param offload, the model not being trained leaves the GPU during the other's update."""
        enabled = self.plan.param_offload and self.device != "cpu"
        other = self.actor if phase == "critic" else self.critic
        if other is None or not enabled or is_sharded(other):  # [distributed] FSDP2's CPUOffloadPolicy does it
            return contextlib.nullcontext()
        return on_device(other, "cpu")

    # ------------------------------------------------------------------------------------------ updates
    def _accumulate(self, model, optimizer, batch: StepBatch, rows: list[int], size: int,
                    loss_fn: Callable, scale: Optional[algo.LossScale] = None) -> dict:
        """One optimizer step's gradient over `rows`, accumulated over micro-batches of `size`.

        The mini-batch's denominators (tokens, sequences, T) are fixed once, before the split, and every
        micro-batch loss is its exact share of the mini-batch loss: the gradient does not depend on the
        micro-batch size, the token budget or OOM halving, for every loss_agg_mode. Under data parallelism `scale`
        holds the counts of all ranks' rows (DataParallel.loss_scale)."""
        optimizer.zero_grad(set_to_none=True)
        if scale is None:
            scale = algo.LossScale.of(batch.mask[rows], norm_length=self.response_length)
        totals: dict[str, float] = {}
        # [distributed] a sharded model: as many backward passes on every rank (padding ones weigh 0)
        for micro, padding in matched_micro_batches(self.micro_batches(batch, rows, size), self.dp,
                                                    is_sharded(model)):
            ids, mask, pos, resp_len = self.forward_rows(batch, micro)
            resp_mask = batch.mask[micro, :resp_len].to(self.device)
            with autocast_context(self.plan):
                loss, shares, means = loss_fn(model, micro, ids, mask, pos, resp_len, resp_mask, scale)
            if padding:
                (loss * 0.0).backward()
                continue
            if not torch.isfinite(loss.detach()):  # say which rows, so a rare NaN can be traced to its data
                log.warning("non-finite loss %s in a micro-batch of rows %s (response lengths %s, prompt lengths %s)",
                            float(loss.detach()), micro[:16], batch.mask[micro].sum(-1).int().tolist()[:16],
                            batch.rollout.prompt_mask[micro].sum(-1).tolist()[:16])
            (self.grad_scaler.scale(loss) if self.grad_scaler else loss).backward()
            # loss terms add up to the mini-batch's value; diagnostics (token means) are weighted by tokens
            token_share = float(resp_mask.sum()) / max(scale.tokens, 1.0)
            for key, value in shares.items():
                totals[key] = totals.get(key, 0.0) + float(value)
            for key, value in means.items():
                totals[key] = totals.get(key, 0.0) + float(value) * token_share
        return totals

    def _optimizer_step(self, model, optimizer, grad_clip: float) -> float:
        """Unscale, clip, step (see precision_guard.optimizer_step); returns the grad norm. A step skipped by the
        fp16 loss scaler is normal (counted, logged as */skipped_steps); `self.last_step_outcome` says which."""
        if self.stop_signals is not None:
            self.stop_signals.droppable = False  # weights may change from here: a signal now finishes the step
        outcome = optimizer_step(optimizer, [p for p in model.parameters() if p.requires_grad], grad_clip,
                                 self.grad_scaler)
        self.last_step_outcome = outcome
        name = next((k for k, v in self.optimizers.items() if v is optimizer), "model")
        self.precision_guard.record(name, outcome)
        if outcome.nonfinite_failure:
            bad = [param for param, p in model.named_parameters()
                   if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
            log.warning("non-finite grad norm %.3g: skipping this optimizer step (%d parameter tensors non-finite, "
                        "first: %s)", outcome.grad_norm, len(bad), ", ".join(bad[:4]))
            self.nonfinite_streak += 1  # fp16 scaler skips are not failures (precision_guard counts those)
            self._stop_if_diverged()
        elif outcome.applied:
            self.nonfinite_streak = 0
        optimizer.zero_grad(set_to_none=True)
        return outcome.grad_norm

    def _update(self, name: str, model, optimizer, batch: StepBatch, loss_fn, mini_rows: int, epochs: int,
                shuffle: bool, grad_clip: float, size_attr: str) -> dict:
        if self.plan.optimizer_offload:
            load_optimizer_state(optimizer, self.device)
        model.train()
        totals: dict[str, float] = {}
        count = 0
        for epoch in range(epochs):
            order = list(range(batch.rows))
            if shuffle:
                gen = torch.Generator().manual_seed(self.cfg.trainer.seed + 31 * self.global_step + epoch)
                order = torch.randperm(batch.rows, generator=gen).tolist()
            # [distributed] mini_rows counts all ranks' rows: as many optimizer steps on every rank, each over its
            # share; the loss denominators and the gradient are summed over ranks
            steps = -(-(self.dp.layout.total if self.dp.enabled else batch.rows) // mini_rows)
            local_mini = -(-batch.rows // max(steps, 1)) if self.dp.enabled else mini_rows
            for start in range(0, steps * local_mini, local_mini):
                rows = order[start:start + local_mini]
                scale = self.dp.loss_scale(batch.mask[rows], self.response_length) if self.dp.enabled else None
                metrics = self.guarded(
                    f"{name}_update",
                    lambda size, rows=rows: self._accumulate(model, optimizer, batch, rows, size, loss_fn, scale),
                    self.size_attr(size_attr))
                if needs_gradient_sum(model):  # [distributed] FSDP2 reduce-scatters a sharded model's itself
                    self.dp.sum_gradients(model)
                metrics = self.dp.sum_dict(metrics)
                metrics["grad_norm"] = self._optimizer_step(model, optimizer, grad_clip)
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + value
                count += 1
        model.eval()
        if self.plan.optimizer_offload:
            offload_optimizer_state(optimizer, "cpu")
        return {f"{name}/{k}": v / max(count, 1) for k, v in totals.items()}

    def critic_loss(self, batch: StepBatch) -> Callable:
        """The critic's loss_fn for _accumulate: clipped value loss against the batch's returns."""
        ccfg = self.cfg.critic

        def loss_fn(model, rows, ids, mask, pos, resp_len, resp_mask, scale):
            pick = lambda t: t[rows, :resp_len].to(self.device)  # noqa: E731
            values = response_values(model, ids, mask, resp_len, pos)
            loss, metrics = algo.value_loss(values, pick(batch.values), pick(batch.returns), resp_mask,
                                            ccfg.cliprange_value, ccfg.loss_agg_mode, scale)
            return loss, {"vf_loss": loss.detach()}, metrics

        return loss_fn

    def actor_loss(self, batch: StepBatch) -> Callable:
        """The actor's loss_fn for _accumulate: PPO clip - entropy bonus + KL loss, one aggregation mode."""
        acfg = self.cfg.actor_rollout_ref.actor
        temperature = self.cfg.actor_rollout_ref.rollout.temperature or 1.0
        clip_low = acfg.clip_ratio_low if acfg.clip_ratio_low is not None else acfg.clip_ratio
        clip_high = acfg.clip_ratio_high if acfg.clip_ratio_high is not None else acfg.clip_ratio
        mode = acfg.loss_agg_mode
        policy_loss = algo.POLICY_LOSSES[acfg.policy_loss.loss_mode]  # vanilla PPO clip or GSPO
        rcfg = self.cfg.actor_rollout_ref.rollout
        compare_rollout = logprobs_comparable(rcfg.top_k, rcfg.top_p)

        def loss_fn(model, rows, ids, mask, pos, resp_len, resp_mask, scale):
            # [distributed] call_in_root_forward: a sharded model's root weights gathered around the head
            logprob, entropy = call_in_root_forward(model, response_logprobs)(
                model, ids, mask, resp_len, temperature=temperature,
                                                 chunk_size=self.plan.logprob_chunk_size, with_entropy=True,
                                                 position_ids=pos)
            pick = lambda t: t[rows, :resp_len].to(self.device)  # noqa: E731
            old = pick(batch.old_logprobs) if batch.old_logprobs is not None else logprob.detach()
            pg_loss, means = policy_loss(old, logprob, pick(batch.advantages), resp_mask, clip_low, clip_high,
                                         acfg.clip_ratio_c, mode, scale)
            ent = algo.entropy_loss(entropy, resp_mask, mode, scale)
            loss = pg_loss - acfg.entropy_coeff * ent
            shares = {"pg_loss": pg_loss.detach(), "entropy": ent.detach()}
            if compare_rollout:  # trainer vs rollout log-probs of the behaviour policy (precision_guard)
                means["rollout_logprob_gap"] = rollout_logprob_gap(old, pick(batch.rollout.response_logprobs),
                                                                   resp_mask)
            if acfg.use_kl_loss and batch.ref_logprobs is not None:
                kl = algo.kl_loss(logprob, pick(batch.ref_logprobs), resp_mask, acfg.kl_loss_type, mode, scale)
                loss = loss + acfg.kl_loss_coef * kl
                shares["kl_loss"] = kl.detach()
            return loss, shares, means

        return loss_fn

    def update_critic(self, batch: StepBatch) -> dict:
        ccfg = self.cfg.critic
        mini = (ccfg.ppo_mini_batch_size or self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size) * self.n
        epochs = ccfg.ppo_epochs or self.cfg.actor_rollout_ref.actor.ppo_epochs
        with self.offloaded_while("critic"):
            return self._update("critic", self.critic, self.optimizers["critic"], batch, self.critic_loss(batch),
                                mini, epochs, ccfg.shuffle, ccfg.grad_clip, "critic_micro_batch_size")

    def update_actor(self, batch: StepBatch) -> dict:
        acfg = self.cfg.actor_rollout_ref.actor
        with self.offloaded_while("actor"):
            return self._update("actor", self.actor, self.optimizers["actor"], batch, self.actor_loss(batch),
                                acfg.ppo_mini_batch_size * self.n, acfg.ppo_epochs, acfg.shuffle, acfg.grad_clip,
                                "actor_micro_batch_size")

    # ------------------------------------------------------------------------------------------ one step
    def generate(self, items: list[dict], params: SamplingParams, generator, first_prompt: int = 0) -> RolloutBatch:
        """Sample params.n responses per prompt, plan.sizes.rollout_batch_size sequences at a time (OOM-guarded).

        `generator` is a torch.Generator for all calls, or a function of the global index of each call's first
        prompt (`first_prompt` + offset) returning one: then the draws do not depend on how prompts are split."""
        self.actor.eval()
        prompts = [item["input_ids"] for item in items]
        if self.plan.sizes.rollout_batch_size is None:
            self.plan.sizes.rollout_batch_size = len(prompts) * params.n

        def run(size: int) -> RolloutBatch:
            per_call = max(1, size // params.n)
            with torch.no_grad():
                parts = [self.engine.generate(prompts[i:i + per_call], params, generator=generator(first_prompt + i)
                                              if callable(generator) else generator)
                         for i in range(0, len(prompts), per_call)]
            # Step-level tensors live on the CPU; micro-batches visit the device (forward_rows).
            return concat_rollouts([part.to("cpu") for part in parts], self.tokenizer.pad_token_id)

        with weights_for_rollout(self.engine, self.actor):  # [distributed] sharded: gathered, synced, then freed
            return self.guarded("rollout", run, "rollout_batch_size")

    def score(self, items: list[dict], rollout: RolloutBatch, n: int):
        texts = rollout.decode(self.tokenizer)
        expand = lambda key: [item[key] for item in items for _ in range(n)]  # noqa: E731
        scores, info = self.reward_manager(texts, expand("ground_truth"), expand("data_source"), expand("extra_info"))
        return scores.float(), info, texts

    def shaped_scores(self, items: list[dict], rollout: RolloutBatch) -> ScoredRollout:
        """Rule scores plus DAPO's overlong penalty (reward_model.overlong_buffer) when it is on."""
        scores, info, _ = self.score(items, rollout, self.n)
        buffer = self.cfg.reward_model.overlong_buffer
        if buffer.enable:
            penalty = algo.overlong_penalty(rollout.response_lengths(), self.response_length, buffer.len,
                                            buffer.penalty_factor)
            scores = scores + penalty.to(scores.dtype)
            info["overlong_penalty"] = penalty.tolist()
        return ScoredRollout(items, rollout, scores, info)

    def filter_metric(self, part: ScoredRollout) -> torch.Tensor:
        """Per-row values of algorithm.filter_groups.metric: seq_reward (shaped score), score (before the overlong
        penalty), or a number the reward function returns (acc, ...)."""
        name = self.cfg.algorithm.filter_groups.metric
        if name == "seq_reward":
            return part.scores
        if name == "score":
            return part.scores - torch.tensor(part.info.get("overlong_penalty", 0.0), dtype=part.scores.dtype)
        if not isinstance(part.info.get(name), list):
            known = ["score", "seq_reward"] + sorted(k for k, v in part.info.items() if isinstance(v, list))
            raise UserError(f"algorithm.filter_groups.metric={name!r} is not a reward value; use one of {known}")
        return torch.tensor(part.info[name], dtype=torch.float64)

    def rollout_and_score(self, items: list[dict], timer: PhaseTimer,
                          first_prompt: int = 0) -> tuple[ScoredRollout, dict]:
        """Steps 1-2: n samples per prompt from the current policy, scored (and length-shaped).

        With DAPO's dynamic sampling (algorithm.filter_groups) groups whose metric is the same for every sample are
        dropped and more prompts are drawn until train_batch_size prompts are kept, at most max_num_gen_batches
        rounds; a batch still short at the cap is topped up with dropped groups (verl stops the run there)."""
        fcfg = self.cfg.algorithm.filter_groups
        rounds, kept, dropped = [], [], []
        while True:
            with timer("rollout"):
                # [distributed] draws seeded by the global index of each call's first prompt (first_prompt: this
                # rank's first), so N ranks sample what one process would
                step, salt = self.global_step, -len(rounds)
                rollout = self.generate(items, self.sampling_params(), lambda first: self.step_generator(
                    step, salt=salt, first_prompt=first), first_prompt)
            with timer("reward"):
                rounds.append(self.shaped_scores(items, rollout))
            if not fcfg.enable:
                break
            keep = algo.informative_groups(self.filter_metric(rounds[-1]),
                                           torch.arange(len(items)).repeat_interleave(self.n))
            kept.append(rounds[-1].select([p for p in range(len(items)) if keep[p * self.n]]))
            dropped.append(rounds[-1].select([p for p in range(len(items)) if not keep[p * self.n]]))
            informative = sum(len(part.items) for part in kept)
            at_cap = 0 < fcfg.max_num_gen_batches <= len(rounds)
            if informative >= self.cfg.data.train_batch_size or at_cap:
                break
            items = self.loader.next_batch()
        if self.release_rollout_memory:
            self.engine.release_memory()
        if not fcfg.enable:
            return rounds[0], {}
        pool = ScoredRollout.concat([part for part in kept + dropped if part.items], self.tokenizer.pad_token_id)
        batch = pool.select(list(range(min(self.cfg.data.train_batch_size, len(pool.items)))))
        batch.info["num_errors"] = sum(part.info["num_errors"] for part in rounds)
        topped_up = max(len(batch.items) - informative, 0)
        if topped_up:
            log.warning("dynamic sampling: %d informative prompts after %d generation rounds "
                        "(algorithm.filter_groups.max_num_gen_batches); topped up with %d uninformative ones",
                        informative, len(rounds), topped_up)
        drawn_acc = [acc for part in rounds for acc in part.info["acc"]]
        return batch, {"filter_groups/num_gen_batches": float(len(rounds)),
                       "filter_groups/prompts_drawn": float(sum(len(part.items) for part in rounds)),
                       "filter_groups/prompts_informative": float(informative),
                       "filter_groups/prompts_topped_up": float(topped_up),
                       "filter_groups/drawn_acc": float(np.mean(drawn_acc))}

    def truncated_loss_mask(self, rollout: RolloutBatch) -> tuple[Optional[torch.Tensor], dict]:
        """TRL's mask_truncated_completions: the response mask without responses cut off by the length limit."""
        if not self.cfg.algorithm.mask_truncated_completions:
            return None, {}
        eos_ids = getattr(self.engine, "eos_ids", None) or collect_eos_ids(self.tokenizer, self.actor)  # the engine's
        truncated = algo.truncated_rows(rollout.response_ids, rollout.response_mask, self.response_length, eos_ids)
        stops = StopStringMatcher(self.tokenizer, as_list(self.cfg.actor_rollout_ref.rollout.stop))
        if stops:  # a response that ends on a stop string exactly at the limit was finished, not cut off
            for row in truncated.nonzero().flatten().tolist():
                truncated[row] = not stops.ends_with_stop(rollout.response_ids[row].tolist())
        loss_mask = rollout.response_mask.float() * (~truncated).float().unsqueeze(-1)
        return loss_mask, {"response_length/truncated_masked": float(truncated.float().mean())}

    def train_step(self, items: list[dict]) -> dict:
        acfg, algo_cfg = self.cfg.actor_rollout_ref, self.cfg.algorithm
        timer = PhaseTimer(self.device)
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(self.device)
        step_start = time.perf_counter()
        items, first_prompt = self.dp.share(items)  # [distributed] this rank's block of prompts (groups whole)

        # 1-2. rollout (n samples per prompt from the current policy) and rule-based reward per sequence;
        # DAPO's dynamic sampling may draw more prompts, and replaces `items` by the prompts trained on
        # ([distributed] one rank: check_world_config refuses dynamic sampling with several ranks)
        scored, sampling_metrics = self.rollout_and_score(items, timer, first_prompt)
        items, rollout, scores, info = scored.items, scored.rollout, scored.scores, scored.info
        self.precision_guard.check_rollout(rollout.response_logprobs, rollout.response_mask)
        group_index = torch.arange(len(items)).repeat_interleave(self.n)
        self.dp.set_rows(len(group_index))
        batch = StepBatch(rollout=rollout, group_index=group_index, scores=scores, reward_info=info)
        batch.loss_mask, truncation_metrics = self.truncated_loss_mask(rollout)
        if self.dp.enabled:  # [distributed] the fraction over all ranks' rows
            truncation_metrics = {key: self.dp.sum_dict({"v": value * len(group_index)})["v"] / self.dp.layout.total
                                  for key, value in truncation_metrics.items()}
        mask = rollout.response_mask.float()  # every response carries its score, kept out of the loss or not

        # 3. old log-probs (the behaviour policy for the PPO ratio) and reference log-probs (for KL).
        # With a single on-policy optimizer step the old policy *is* the current one: its log-probs are the
        # detached log-probs of the update's own forward, so we skip a full forward pass here.
        single_update = acfg.actor.ppo_epochs == 1 and acfg.actor.ppo_mini_batch_size >= len(items) * self.dp.world
        if not single_update:
            with timer("old_log_prob"):
                batch.old_logprobs = self.batched_logprobs(self.actor, batch)
        if self.use_ref:
            with timer("ref_log_prob"):
                ref_model, ctx = self.ref_context()
                with ctx:
                    batch.ref_logprobs = self.batched_logprobs(ref_model, batch)
        if batch.old_logprobs is None and algo_cfg.use_kl_in_reward and self.use_ref:
            with timer("old_log_prob"):  # the KL penalty in the reward needs them before the update
                batch.old_logprobs = self.batched_logprobs(self.actor, batch)

        # 4. values from the critic (PPO/GAE only)
        if self.critic is not None:
            with timer("values"):
                batch.values = self.batched_values(batch)

        # 5. advantages (and the KL penalty folded into the reward when asked), over the whole global batch:
        # [distributed] every rank gathers all rows, so whitening and the KL controller see what one process would
        with timer("advantages"):
            whole = self.dp.gather_rows
            local_mask = mask
            scores, mask, group_index = whole(scores), whole(mask), whole(group_index + first_prompt)
            old_logprobs, ref_logprobs, values = (whole(batch.old_logprobs), whole(batch.ref_logprobs),
                                                  whole(batch.values))
            token_scores = algo.scores_to_token_rewards(scores, mask)
            kl_metrics = {}
            if algo_cfg.use_kl_in_reward and ref_logprobs is not None:
                # as verl: beta is the value before this step; the controller then sees the batch mean of the
                # per-sequence mean KL (of the configured kind) with n_steps = rows
                token_rewards, kl_metrics = algo.apply_kl_in_reward(token_scores, old_logprobs, ref_logprobs, mask,
                                                                    self.kl_ctrl, algo_cfg.kl_penalty,
                                                                    update_controller=True)
            else:
                token_rewards = token_scores
            advantages, returns = algo.compute_advantages(
                algo_cfg.adv_estimator, scores=scores, token_rewards=token_rewards, values=values, mask=mask,
                group_index=group_index, gamma=algo_cfg.gamma, lam=algo_cfg.lam,
                norm_adv_by_std_in_grpo=algo_cfg.norm_adv_by_std_in_grpo)
            batch.token_rewards = self.dp.local_rows(token_rewards, local_mask)
            batch.advantages = self.dp.local_rows(advantages, local_mask)
            batch.returns = self.dp.local_rows(returns, local_mask)

        # 6. updates: critic first (it is trained on the same returns), then the actor after the warm-up
        metrics: dict[str, float] = {}
        if self.critic is not None:
            with timer("update_critic"):
                metrics.update(self.update_critic(batch))
        if self.global_step >= self.cfg.trainer.critic_warmup:
            with timer("update_actor"):
                metrics.update(self.update_actor(batch))
            for scheduler in self.schedulers.values():
                scheduler.step()
            sync_engine(self.engine, self.actor)  # [distributed] sharded: synced at the next generation instead

        # 7. diagnostics (over all ranks' rows; timings are this rank's)
        resp_len = mask.sum(-1)
        total_tokens = float(mask.sum()) + self.dp.sum_dict({"t": float(rollout.prompt_mask.sum())})["t"]
        step_time = time.perf_counter() - step_start
        metrics.update({
            "reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if scores.numel() > 1 else 0.0,
            "reward/acc": float(np.mean(self.dp.gather_objects(info["acc"]))),
            "reward/format": float(np.mean(self.dp.gather_objects(info["format"]))),
            "reward/errors": self.dp.sum_dict({"e": float(info["num_errors"])})["e"],
            "response_length/mean": float(resp_len.mean()), "response_length/max": float(resp_len.max()),
            "response_length/clip_ratio": float((resp_len >= self.response_length).float().mean()),
            "actor/lr": self.schedulers["actor"].get_last_lr()[0],
            "perf/step_time_s": step_time, "perf/tokens_per_s": total_tokens / step_time,
            "perf/rollout_tokens_per_s": float(mask.sum()) / max(timer.times.get("rollout", 1e-9), 1e-9),
            "perf/peak_memory_gib": self.dp.max_value(_peak_memory_gib(self.device)),
            **{f"timing/{k}": v for k, v in timer.times.items()},
            **kl_metrics, **sampling_metrics, **truncation_metrics,
        })
        if "overlong_penalty" in info:
            metrics["reward/overlong_penalty"] = float(np.mean(self.dp.gather_objects(info["overlong_penalty"])))
        if ref_logprobs is not None and old_logprobs is not None:
            metrics["actor/kl"] = float(algo.masked_mean(algo.kl_penalty(old_logprobs, ref_logprobs, "kl"), mask))
        if algo_cfg.use_kl_in_reward:
            metrics["actor/kl_coef"] = self.kl_ctrl.value  # after this step's update: the next step's beta
        if values is not None:
            metrics["critic/values_mean"] = float(algo.masked_mean(values, mask))
            metrics["critic/returns_mean"] = float(algo.masked_mean(returns, mask))
        metrics["oom/recoveries"] = self.dp.sum_dict({"n": float(len(self.oom_guard.events))})["n"]
        metrics.update(self.precision_guard.end_step(metrics))  # loss scale, skipped steps; stops on a tripped rail
        return metrics

    # ------------------------------------------------------------------------------------------ validation
    def validate(self) -> dict:
        if self.val_set is None:
            return {}
        limit = self.cfg.data.val_max_samples
        indices = range(len(self.val_set) if limit is None or limit < 0 else min(limit, len(self.val_set)))
        # [distributed] each rank answers a contiguous block of the prompts; the results are gathered
        block = -(-len(indices) // self.dp.world)
        offset = min(self.dp.rank * block, len(indices))
        total = len(indices)
        items = [self.val_set[i] for i in indices[offset:offset + block]]
        params = self.sampling_params(validation=True)
        chunk = self.cfg.data.val_batch_size or max(self.cfg.data.train_batch_size * self.n, 64)
        accs, formats, scores_all, lengths, samples = [], [], [], [], []
        # [distributed] the progress bar is rank 0's (it counts rank 0's block of prompts)
        with tqdm(total=len(items), desc=f"validation (step {self.global_step})", unit="prompt", leave=False,
                  disable=not self.dp.is_main) as bar:
            for start in range(0, len(items), chunk):
                part = items[start:start + chunk]
                rollout = self.generate(part, params, self.step_generator(self.global_step, salt=1 + offset + start))
                scores, info, texts = self.score(part, rollout, params.n)
                accs += info["acc"]
                formats += info["format"]
                scores_all += scores.tolist()
                lengths += rollout.response_mask.sum(-1).tolist()
                samples += texts
                bar.update(len(part))
        # [distributed] every rank's prompts, responses and scores, in prompt order; rank 0 writes and logs them
        all_items = self.dp.gather_objects([{k: item[k] for k in ("index", "input_ids", "ground_truth")}
                                            for item in items]) if self.dp.enabled else items
        all_samples, all_scores = self.dp.gather_objects(samples), self.dp.gather_objects(scores_all)
        if self.dp.is_main:
            self.write_val_generations(all_items, all_samples, all_scores, params.n)
            for text, item in list(zip(all_samples[::params.n], all_items))[: self.cfg.trainer.log_val_generations]:
                log.info("val sample [truth %s]: %s", item["ground_truth"], text.strip()[:300])
        accs, formats, lengths = (self.dp.gather_objects(v) for v in (accs, formats, lengths))
        scores_all = all_scores
        return {"val/acc": float(np.mean(accs)), "val/format": float(np.mean(formats)),
                "val/reward": float(np.mean(scores_all)), "val/response_length": float(np.mean(lengths)),
                "val/num_samples": float(total)}

    def write_val_generations(self, items: list[dict], texts: list[str], scores: list[float], n: int) -> str:
        """Every validation response of this step as one JSON line each in RUN_DIR/val_generations/step_N.jsonl
        (verl's trainer.validation_data_dir, kept in the run dir): prompt, response, ground truth, score."""
        folder = os.path.join(self.run_dir, "val_generations")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"step_{self.global_step}.jsonl")
        with open(path, "w") as handle:
            for row, (text, score) in enumerate(zip(texts, scores)):
                item = items[row // n]
                prompt = self.tokenizer.decode(item["input_ids"], skip_special_tokens=False)
                handle.write(json.dumps({"step": self.global_step, "index": item["index"], "prompt": prompt,
                                         "response": text, "ground_truth": item["ground_truth"],
                                         "score": score}) + "\n")
        return path

    # ------------------------------------------------------------------------------------------ checkpoints
    def trainer_state(self) -> dict:
        return {"loader": self.loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,  # fp16 loss scale
                "plan_sizes": self.plan.sizes.to_dict()}

    def save(self) -> str:
        export = None
        if self.use_lora and not is_sharded(self.actor):  # [distributed] sharded: dist_checkpoint merges LoRA
            export = merged_state_for_export(self.actor)
        # [distributed] replicas are identical: rank 0 writes, the others wait until it is complete
        path = os.path.join(self.run_dir, "checkpoints", f"global_step_{self.global_step}")
        if is_sharded(self.actor):  # [distributed] sharded: every rank writes its shards (DCP), rank 0 the rest
            path = save_sharded(self.dp, self.run_dir, self.global_step, actor=self.actor, tokenizer=self.tokenizer,
                                critic=self.critic, optimizers=self.optimizers, schedulers=self.schedulers,
                                trainer_state=self.trainer_state(), keep=self.cfg.trainer.max_actor_ckpt_to_keep,
                                config_yaml=to_yaml(self.cfg))
            log.info("checkpoint saved: %s", path)
        elif self.dp.is_main:
            path = save_checkpoint(self.run_dir, self.global_step, actor=self.actor, tokenizer=self.tokenizer,
                                   critic=self.critic, optimizers=self.optimizers, schedulers=self.schedulers,
                                   trainer_state=self.trainer_state(), export_actor=export,
                                   keep=self.cfg.trainer.max_actor_ckpt_to_keep, config_yaml=to_yaml(self.cfg))
            log.info("checkpoint saved: %s", path)
        self.dp.barrier()
        if self.nonfinite_streak == 0:
            self.last_good_checkpoint = path
        return path

    def save_final_model(self) -> str:
        """The trained actor in HF format at the end of a run: the last checkpoint's actor/ when one was written at
        this step (save_freq > 0), else RUN_DIR/final_model/ (model + tokenizer, LoRA merged, no optimizer)."""
        latest = find_latest_checkpoint(self.run_dir)
        if latest and os.path.basename(latest) == f"global_step_{self.global_step}":
            return os.path.join(latest, "actor")
        final = os.path.join(self.run_dir, "final_model")
        if is_sharded(self.actor):  # [distributed] gathered full weights, written by rank 0
            save_full_model(self.dp, final, self.actor, self.tokenizer)
            return final
        model = merged_state_for_export(self.actor) if self.use_lora else self.actor
        if self.dp.is_main:  # [distributed] replicas are identical: rank 0 writes, the others wait for it
            tmp = final + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)  # a run killed mid-write leaves final_model.tmp, never a half-written final_model
            log.info("final model saved: %s", final)
        self.dp.barrier()
        return final

    def maybe_resume(self) -> None:
        """Continue from the newest usable checkpoint (a damaged one is named and skipped), or the given path."""
        tcfg = self.cfg.trainer
        if tcfg.resume_mode == "disable":
            return

        def load(path: str) -> dict:
            # [distributed] a sharded (DCP) checkpoint loads on any world size; a replicated one as before
            return load_checkpoint_any(load_checkpoint, path, actor=self.actor, critic=self.critic,
                                       optimizers=self.optimizers, schedulers=self.schedulers)

        if tcfg.resume_mode == "resume_path":
            path, state = tcfg.resume_from_path, load(tcfg.resume_from_path)  # asked for by name: no fallback
        else:
            found = resume_latest(self.run_dir, load)
            if found is None:
                return
            path, state = found
        self.global_step = state["global_step"]
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.grad_scaler is not None and state.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        if state.get("plan_sizes"):
            self.plan.sizes = RuntimeSizes.from_dict(state["plan_sizes"])  # keep what OOM recovery learned
            self.oom_guard.plan = self.plan.sizes
        self.write_plan_record()
        self._apply_optim_config()
        sync_engine(self.engine, self.actor)  # [distributed]
        retire_later_checkpoints(self.run_dir, self.global_step)  # never a mix of two timelines
        self.last_good_checkpoint = path
        log.info("resumed from %s at step %d", path, self.global_step)

    def _apply_optim_config(self) -> None:
        """A resumed optimizer/scheduler carries the old lr, betas and weight decay: the config's values win."""
        optim_cfgs = {"actor": self.cfg.actor_rollout_ref.actor.optim, "critic": self.cfg.critic.optim}
        for name, optimizer in self.optimizers.items():
            ocfg, scheduler = optim_cfgs[name], self.schedulers[name]
            scheduler.base_lrs = [ocfg.lr] * len(optimizer.param_groups)
            for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
                group.update(initial_lr=ocfg.lr, lr=ocfg.lr * factor(scheduler.last_epoch),
                             betas=tuple(ocfg.betas), weight_decay=ocfg.weight_decay)
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]

    # ------------------------------------------------------------------------------------------ stopping
    def _last_good_hint(self) -> str:
        if self.last_good_checkpoint:
            return (f"The last good checkpoint is {self.last_good_checkpoint}: resume from it with a lower learning "
                    f"rate (trainer.resume_mode=resume_path trainer.resume_from_path={self.last_good_checkpoint})")
        return "No checkpoint was saved before; lower the learning rate and start again"

    def _stop_after(self, streak: int, limit_key: str, what: str, advice: str) -> None:
        """Raise TrainingStopped once `streak` reaches the config's `limit_key` (0: never)."""
        limit = self.stop_limits[limit_key]
        if limit > 0 and streak >= limit:
            raise TrainingStopped(f"{what} ({limit_key}={limit}): {advice}")

    def _stop_if_diverged(self) -> None:
        self._stop_after(self.nonfinite_streak, "trainer.max_consecutive_nonfinite_updates",
                         f"{self.nonfinite_streak} optimizer updates in a row had a NaN/inf gradient norm and were "
                         "skipped",
                         f"the run has diverged, training on would change nothing. {self._last_good_hint()}, e.g. "
                         f"actor_rollout_ref.actor.optim.lr={self.cfg.actor_rollout_ref.actor.optim.lr / 10:g}")

    def _stop_if_rewards_failing(self, metrics: dict, rows: int) -> None:
        self.failed_reward_streak = self.failed_reward_streak + 1 if metrics["reward/errors"] >= rows else 0
        self._stop_after(self.failed_reward_streak, "trainer.max_consecutive_failed_reward_steps",
                         f"every reward call failed for {self.failed_reward_streak} steps in a row",
                         f"nothing can be learned. Last error: {self.reward_manager.last_error}. Fix the reward "
                         "function (custom_reward_function.path) or the data's data_source / ground_truth")

    def _droppable(self, fn: Callable):
        """fn() while a stop signal may drop it (it must change no training state): None when dropped."""
        # [distributed] never with several ranks: a rank dropped mid-step would leave the others in a collective;
        # the step finishes and the ranks stop together at the next step boundary (_signal_received)
        self.stop_signals.droppable = self.stop_signals.received is None and not self.dp.enabled
        try:
            return fn()
        except StepDropped:
            return None
        finally:
            self.stop_signals.droppable = False

    def _train_step_or_drop(self) -> Optional[dict]:
        """One step; None when a stop signal dropped it before any update (the data position and RNG rewound)."""
        loader_state, rng = self.loader.state_dict(), capture_rng()

        def step() -> dict:
            return self.train_step(self.loader.next_batch())

        metrics = self._droppable(step)
        if metrics is None:
            self.loader.load_state_dict(loader_state)
            restore_rng(*rng)
        return metrics

    def _signal_received(self) -> Optional[int]:
        """The stop signal received, if any; [distributed] by any rank, so that every rank stops at the same step."""
        stop = self.stop_signals
        if self.dp.enabled:
            received = int(self.dp.max_value(float(stop.received or 0)))
            if received and stop.received is None:
                stop.received = received
        return stop.received

    def _stop_on_signal(self, saved_step: int) -> None:
        stop = self.stop_signals
        if self._signal_received() is None:
            return
        path = None
        if self.global_step > 0:
            path = self.save() if saved_step != self.global_step else self.last_good_checkpoint
        raise RunInterrupted(stop.received, self.global_step, path)

    # ------------------------------------------------------------------------------------------ the run
    def fit(self) -> dict:
        tcfg = self.cfg.trainer
        try:
            self.maybe_resume()
            self.tracker = Tracker(self.run_dir, as_list(tcfg.logger), tcfg.project_name, tcfg.experiment_name,
                                   OmegaConf.to_container(self.cfg, resolve=True), self.total_steps,
                                   resume_step=self.global_step if self.global_step > 0 else None) \
                if self.dp.is_main else NullTracker()  # [distributed] metrics, progress and plots from rank 0 alone
            with StopSignals() as self.stop_signals:
                return self._loop()
        finally:
            self.stop_signals = None
            if self.tracker is not None:
                self.tracker.close()
            self.reward_manager.close()
            if self.run_lock is not None:
                self.run_lock.release()

    def _loop(self) -> dict:
        tcfg, stop = self.cfg.trainer, self.stop_signals
        last_val: dict = {}
        saved_step = self.global_step
        self.failed_reward_streak = 0
        if tcfg.val_before_train and self.global_step == 0:
            last_val = self._droppable(self.validate) or {}
            if last_val:
                self.tracker.log(last_val, step=0)
        while self.global_step < self.total_steps:
            self._stop_on_signal(saved_step)
            stop.step = self.global_step
            metrics = self._train_step_or_drop()
            if metrics is None:
                continue  # dropped by a signal: _stop_on_signal saves and stops
            self.global_step += 1
            stop.step = self.global_step
            metrics["train/epoch"] = float(self.loader.epoch)
            is_last = self.global_step >= self.total_steps
            if tcfg.test_freq > 0 and (self.global_step % tcfg.test_freq == 0 or is_last) and \
                    self._signal_received() is None:
                last_val = self._droppable(self.validate) or {}
                metrics.update(last_val)
            self.tracker.log(metrics, step=self.global_step)
            self._stop_if_rewards_failing(metrics, rows=self.loader.batch_size * self.n)
            if tcfg.save_freq > 0 and (self.global_step % tcfg.save_freq == 0 or is_last):
                self.save()
                saved_step = self.global_step
        return last_val  # a signal during the last step: the run is complete, so it ends as usual
