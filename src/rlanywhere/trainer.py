"""The RL loop: PPO with a critic (GAE), GRPO, RLOO, REINFORCE++ — one process, any hardware.

Read `RLTrainer.train_step` top to bottom; it is the whole algorithm:

    rollout -> reward -> old/ref log-probs -> values -> advantages -> critic update -> actor update -> metrics
    and `fit` the whole run: resume, validate every test_freq, the step loop, checkpoint every save_freq, stop.

The parts live in their own modules: builders.py (models, optimizers, data, engine), rollout_phase.py (steps 1-2),
balance.py (rows moved between ranks after them: trainer.balance_batch), update.py (micro-batches, accumulation,
optimizer steps), stepmetrics.py (step 7), validation.py, runguard.py (signals, divergence stops),
trainer_checkpoints.py (save, export, resume through the one checkpointer of checkpointer.py), runstate.py (what
changes while the run goes: sizes, KV release, the engine running).
Every hardware choice comes from the Plan made by the planner (planner.py) before anything was loaded; this file
only follows it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import time
from typing import Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from . import algorithms as algo
from . import builders
from .split_rollout import rollout_pipeline_for_run
from .balance import balance_rows, balance_text
from .checkpoint import capture_rng, restore_rng
from .checkpointer import Checkpointer
from .compiling import compiles_so_far
from .config import to_yaml
from .distributed import DataParallel, NullTracker, check_world_config
from .runtime import make_grad_scaler
from .plans import Plan, SizeKind
from .lora import adapter_disabled
from .offload import on_device
from .oom import OOMGuard
from .precision_guard import PrecisionGuard
from .profiling import maybe_profile, profile_step_set
from .rollout_correction import RolloutCorrection, recomputes_old_logprobs
from .rollout_phase import RolloutPhase, response_length
from .sharding import sync_engine
from .rank_layout import register_ranks
from .runfaults import RunDirWatch
from .runguard import RunInterrupted, RunStops, StopSignals, prepare_run_dir
from .runstate import RunState
from .stepbatch import ScoredRollout, StepBatch
from .stepmetrics import PhaseTimer, step_metrics
from .tracking import Tracker
from .trainer_checkpoints import TrainerCheckpoints
from .update import Updater, actor_loss, critic_loss
from .validation import validate
from .verl_steps import BASELINE_KEY, pf_ppo_batch, row_baselines
from .vocabulary import precision_name
from .warmup_costs import WarmupClock

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def planned_steps(total_training_steps: int | None, total_epochs: int | None, steps_per_epoch: int) -> int:
    """The run's steps: trainer.total_training_steps and trainer.total_epochs, whichever ends first where both are
    set (verl's loop); one epoch where neither is."""
    by_epochs = None if total_epochs is None else int(total_epochs) * steps_per_epoch
    if total_training_steps:
        return int(total_training_steps) if by_epochs is None else min(int(total_training_steps), by_epochs)
    return steps_per_epoch if by_epochs is None else by_epochs


class RLTrainer(TrainerCheckpoints):
    def __init__(self, cfg: DictConfig, plan: Plan, run_dir: str, notices: Optional[list[str]] = None):
        self.cfg, self.plan, self.run_dir, self.device = cfg, plan, run_dir, plan.device
        self.notices = list(notices or [])
        # [distributed] this process's rank among torchrun's (alone: world 1, every collective a no-op)
        self.dp = DataParallel.from_env(self.device, plan.dist_backend)
        check_world_config(cfg, self.dp.world)  # before any model loads: what data parallelism cannot run
        register_ranks(self.dp)  # [distributed] so that a survivor can name a rank that died
        # first of all: the run dir's lock and every check that must fail before a model loads. [distributed] The
        # ranks of one job share the run dir: rank 0 takes the lock, checks and writes; the others wait for it
        self.run_lock = prepare_run_dir(run_dir, cfg) if self.dp.is_main else None
        if self.dp.is_main:
            with open(os.path.join(run_dir, "config.yaml"), "w") as handle:
                handle.write(to_yaml(cfg))
        self.dp.barrier()  # rank 0's checks passed (a failure ends the job: torchrun stops the waiting ranks)
        seed_everything(cfg.trainer.seed)
        self.n = cfg.actor_rollout_ref.rollout.n
        # [distributed] after each rollout, rows move so every rank trains about as many tokens (one process: none)
        self.balance_batch = bool(cfg.trainer.balance_batch) and self.dp.enabled
        if self.dp.enabled:
            log.info("%s", balance_text(self.balance_batch, self.dp.world))
        self.profile_steps = profile_step_set(cfg.trainer.profile_steps)
        max_seq_len = cfg.data.max_prompt_length + self.response_length

        self.source, self.tokenizer = builders.build_tokenizer(cfg)
        data = builders.build_data(cfg, self.tokenizer)
        self.train_set, self.val_set, self.loader = data.train_set, data.val_set, data.loader
        self.reward_manager = builders.build_reward_manager(cfg, plan)
        self.total_steps = planned_steps(cfg.trainer.total_training_steps, cfg.trainer.total_epochs,
                                         self.loader.steps_per_epoch)
        # passes over the prompts that bound the run (None: steps alone do); dynamic sampling may draw several
        # batches a step, so the prompts can run out before the planned steps do (verl's loop ends there too)
        self.prompt_passes = (int(cfg.trainer.total_epochs) if cfg.trainer.total_epochs is not None
                              else None if cfg.trainer.total_training_steps else 1)
        models = builders.build_models(cfg, plan, self.source, self.dp)
        self.actor, self.critic, self.ref = models.actor, models.critic, models.ref
        self.optimizers, self.schedulers = builders.build_optimizers(cfg, models, self.total_steps,
                                                                     fused=plan.fused_optimizer)
        self.grad_scaler = make_grad_scaler(plan)  # fp16 plans: one dynamic loss scale for actor and critic
        # the guard speaks of the rollout's precision: its overflow rule is for half-precision rollouts
        self.precision_guard = PrecisionGuard.from_config(cfg.hardware, precision_name(plan.rollout.dtype))
        kl_cfg = cfg.algorithm.kl_ctrl
        self.kl_ctrl = algo.make_kl_controller(kl_cfg.type, kl_cfg.kl_coef, kl_cfg.target_kl, kl_cfg.horizon)
        # what changes while the run goes (sizes OOM recovery lowers, the KV-release flag, the engine running):
        # the plan stays as it was decided
        self.run = RunState.from_plan(plan, run_dir, self.dp.rank)
        self._recorded_changes = -1
        # A token budget can shrink no further than one full-length sequence.
        self.oom_guard = OOMGuard(self.run, log_fn=lambda msg: log.warning("%s", msg),
                                  min_size={SizeKind.TOKENS_PER_MICRO_BATCH: max_seq_len},
                                  enabled=cfg.hardware.oom_recovery)
        self.checkpointer = Checkpointer(run_dir, self.dp, cfg.trainer.max_actor_ckpt_to_keep, to_yaml(cfg))
        self.stops = RunStops(cfg.trainer, cfg.actor_rollout_ref.actor.optim.lr, self.dp)
        self.updater = Updater(plan, self.dp, self.oom_guard, self.grad_scaler, self.precision_guard,
                               self.tokenizer.pad_token_id, self.response_length,
                               before_weights_change=self.stops.weights_changing,
                               after_optimizer_step=self.stops.record_update, samples_per_prompt=self.n)
        # [async] one_step_off: the engine generates from its own weight copy while the actor trains; the pipeline
        # stands in for the rollout phase and draws each step's prompts a step early (async_pipeline.py)
        self.pipeline = rollout_pipeline_for_run(cfg, plan, self.actor, self.loader, self.total_steps, self.dp.share)
        rollout_model = self.pipeline.model if self.pipeline else self.actor
        self.loader = self.pipeline.loader if self.pipeline else self.loader
        self.engine = builders.build_engine(cfg, plan, rollout_model, self.tokenizer)
        self.run.engine_running(self.engine, plan.rollout.engine)
        self.write_plan_record()  # after the engine is known: the record shows what runs
        self.rollouts = RolloutPhase(cfg, plan, self.engine, rollout_model, self.tokenizer, self.reward_manager,
                                     self.oom_guard, self.loader.next_batch, self.dp)
        self.rollouts.prompts_left = self.prompts_left  # dynamic sampling draws no round past the last pass
        if self.pipeline:  # plan.ref_with_rollout: each job computes its batch's reference log-probs after it
            self.rollouts = self.pipeline.attach(self.rollouts, self.engine, self.run, self.stops,
                                                 self.ref_logprobs_beside if plan.ref_with_rollout else None)
        self.global_step = 0
        # a step whose due validation a stop signal skipped or dropped: its metrics row, logged when a resumed run
        # has validated it (the checkpoint keeps it: trainer_state)
        self.pending_validation: dict | None = None
        self.first_step = 0  # the step this launch starts at (a resume's)
        self.tracker: Optional[Tracker] = None

    def write_plan_record(self) -> None:
        """plan.json: every decision with its reason, and the run state beside it (engine fallback, sizes OOM
        recovery lowered); rewritten when the run state changed."""
        self._recorded_changes = self.run.changes
        if not self.dp.is_main:
            return
        record = {**self.plan.to_dict(), "balance_batch": self.balance_batch, "notices": self.notices,
                  "run_state": self.run.to_dict(), "oom_events": self.run.oom_events}
        tmp = os.path.join(self.run_dir, "plan.json.tmp")
        with open(tmp, "w") as handle:
            json.dump(record, handle, indent=2)
        os.replace(tmp, os.path.join(self.run_dir, "plan.json"))

    @property
    def response_length(self) -> int:
        return response_length(self.cfg)

    def ref_context(self):
        """The reference policy: a frozen copy, or with LoRA the adapter-disabled base (no extra weights).

        A reference kept on the CPU (to leave the card to actor and critic) visits the GPU for its forward only."""
        if self.plan.use_lora:
            return self.actor, adapter_disabled(self.actor)
        visiting = self.plan.ref_device == "cpu" and self.device != "cpu"
        return self.ref, on_device(self.ref, self.device, enabled=visiting)

    def reference_logprobs(self, batch: StepBatch, guarded: bool = True) -> torch.Tensor:
        ref_model, ctx = self.ref_context()
        with ctx:
            return self.logprobs(ref_model, batch, guarded)

    def ref_logprobs_beside(self, scored: ScoredRollout) -> torch.Tensor:
        """[async] The reference's log-probs of a batch the pipeline just generated, on its thread (beside the
        update when overlapped), run once at the planned size: the pipeline hands an out-of-memory error to the step."""
        group_index = torch.arange(len(scored.items)).repeat_interleave(self.n)  # the pass reads the rollout alone
        batch = StepBatch(rollout=scored.rollout, group_index=group_index, scores=scored.scores,
                          reward_info=scored.info)
        return self.reference_logprobs(batch, guarded=False)

    def update_critic(self, batch: StepBatch) -> dict:
        critic_cfg, actor_cfg = self.cfg.critic, self.cfg.actor_rollout_ref.actor
        return self.updater.ppo_update(
            "critic", self.critic, self.optimizers["critic"], batch, critic_loss(batch, critic_cfg, self.device),
            mini_rows=(critic_cfg.ppo_mini_batch_size or actor_cfg.ppo_mini_batch_size) * self.n,
            epochs=critic_cfg.ppo_epochs or actor_cfg.ppo_epochs, shuffle_seed=self.shuffle_seed(critic_cfg),
            grad_clip=critic_cfg.grad_clip, kind=SizeKind.CRITIC_MICRO_BATCH, park=self.actor,
            norm_length=critic_cfg.loss_scale_factor)

    def several_optimizer_steps(self, prompts: int) -> bool:
        """Whether the actor's update of a step of `prompts` prompts (this rank's) takes more than one optimizer step."""
        return algo.several_optimizer_steps(self.cfg.actor_rollout_ref.actor, prompts * self.dp.world)

    def update_actor(self, batch: StepBatch) -> dict:
        actor_cfg = self.cfg.actor_rollout_ref.actor
        loss_fn = actor_loss(batch, actor_cfg, self.cfg.actor_rollout_ref.rollout, self.plan.logprob_chunk_size,
                             self.device, compiled_head=self.plan.compile_training,
                             correction=RolloutCorrection.from_config(self.cfg.algorithm.rollout_correction),
                             several_optimizer_steps=self.several_optimizer_steps(batch.rows // self.n))
        return self.updater.ppo_update(
            "actor", self.actor, self.optimizers["actor"], batch, loss_fn, mini_rows=actor_cfg.ppo_mini_batch_size
            * self.n, epochs=actor_cfg.ppo_epochs, shuffle_seed=self.shuffle_seed(actor_cfg),
            grad_clip=actor_cfg.grad_clip, kind=SizeKind.ACTOR_MICRO_BATCH, park=self.critic,
            norm_length=actor_cfg.loss_scale_factor)

    def shuffle_seed(self, section) -> Optional[int]:
        """Mini-batch order: shuffled per epoch from (seed, step) when the section asks for it."""
        return self.cfg.trainer.seed + 31 * self.global_step if section.shuffle else None

    def logprobs(self, model, batch: StepBatch, guarded: bool = True) -> torch.Tensor:
        return self.updater.logprobs(model, batch, self.cfg.actor_rollout_ref.rollout.temperature or 1.0, guarded)

    # ------------------------------------------------------------------------------------------ one step
    def train_step(self, items: list[dict]) -> dict:
        algo_cfg, actor_cfg = self.cfg.algorithm, self.cfg.actor_rollout_ref.actor
        timer = PhaseTimer(self.device)
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(self.device)
        step_start, compiles_at_start = time.perf_counter(), compiles_so_far()
        warmup = WarmupClock()  # compile and graph-capture seconds of this step
        items, first_prompt = self.dp.share(items)  # [distributed] this rank's block of prompts (groups whole)

        # 1-2. rollout (n samples per prompt from the current policy) and rule-based reward per sequence;
        # DAPO's dynamic sampling may draw more prompts, and replaces `items` by the prompts trained on
        # ([distributed] and `first_prompt` by the global index of this rank's first one of them)
        scored, sampling_metrics, first_prompt = self.rollouts.rollout_and_score(items, timer, self.global_step,
                                                                                 first_prompt)
        # (ReMax: with each row's greedy baseline score in info, from the weights that sampled the batch)
        items, rollout, scores, info = scored.items, scored.rollout, scored.scores, scored.info
        if algo.estimator_needs(algo_cfg.adv_estimator).greedy_baseline and BASELINE_KEY not in info:
            with timer("greedy_baseline"):  # a batch a checkpoint of an earlier version kept without it
                info[BASELINE_KEY] = row_baselines(self.rollouts, items, self.global_step, self.n)
        self.precision_guard.check_rollout(rollout.response_logprobs, rollout.response_mask)
        # each row's prompt by its index in the global batch: GRPO/RLOO groups, wherever balancing puts the row
        group_index = (first_prompt + torch.arange(len(items))).repeat_interleave(self.n)
        self.dp.set_rows(len(group_index))
        batch = StepBatch(rollout=rollout, group_index=group_index, scores=scores, reward_info=info)
        balance_metrics: dict = {}
        if self.balance_batch:  # [distributed] rows move between ranks: about as many tokens each from here on
            with timer("balance_batch"):
                batch, balance_metrics = balance_rows(self.dp, batch, self.tokenizer.pad_token_id)
            rollout, scores, info = batch.rollout, batch.scores, batch.reward_info
        batch.loss_mask, truncation_metrics = self.rollouts.truncated_loss_mask(rollout)
        if self.dp.enabled:  # [distributed] the fraction over all ranks' rows
            truncation_metrics = {key: self.dp.sum_dict({"v": value * batch.rows})["v"] / self.dp.layout.total
                                  for key, value in truncation_metrics.items()}
        mask = rollout.response_mask.float()  # every response carries its score, kept out of the loss or not

        # 3. old log-probs (the behaviour policy for the PPO ratio) and reference log-probs (for KL).
        # With a single on-policy optimizer step the old policy *is* the current one: its log-probs are the
        # detached log-probs of the update's own forward, so we skip a full forward pass here.
        # [async] bypass mode without importance weights: the rollout's own log-probs are the old policy
        if self.several_optimizer_steps(len(items)) and recomputes_old_logprobs(algo_cfg.rollout_correction):
            with timer("old_log_prob"):
                batch.old_logprobs = self.logprobs(self.actor, batch)
        # [async] plan.ref_with_rollout: the pipeline computed them after the rollout (for its rows: none moved)
        batch.ref_logprobs = None if self.balance_batch else scored.ref_logprobs
        if self.plan.use_ref and batch.ref_logprobs is None:
            with timer("ref_log_prob"):
                batch.ref_logprobs = self.reference_logprobs(batch)
        if batch.old_logprobs is None and algo.kl_penalty_in_reward(algo_cfg) and self.plan.use_ref:
            if algo_cfg.rollout_correction.bypass_mode:  # the behaviour policy is the rollout's (verl's bypass mode)
                batch.old_logprobs = batch.rollout.response_logprobs
            else:
                with timer("old_log_prob"):  # the KL penalty in the reward needs them before the update
                    batch.old_logprobs = self.logprobs(self.actor, batch)

        # 4. values from the critic (PPO/GAE only)
        if self.critic is not None:
            with timer("values"):
                batch.values = self.updater.values(self.critic, batch)

        # 5. advantages (and the KL penalty folded into the reward when asked), over the whole global batch:
        # [distributed] every rank gathers all rows, so whitening and the KL controller see what one process would
        with timer("advantages"):
            whole = self.dp.gather_rows
            local_mask = mask
            scores, mask, group_index = whole(scores), whole(mask), whole(batch.group_index)
            old_logprobs, ref_logprobs, values = (whole(batch.old_logprobs), whole(batch.ref_logprobs),
                                                  whole(batch.values))
            token_rewards, kl_metrics = algo.scores_to_token_rewards(scores, mask), {}
            if algo.kl_penalty_in_reward(algo_cfg) and ref_logprobs is not None:
                # as verl: beta is the value before this step; the controller then sees the batch mean of the
                # per-sequence mean KL (of the configured kind) with n_steps = rows
                token_rewards, kl_metrics = algo.apply_kl_in_reward(token_rewards, old_logprobs, ref_logprobs, mask,
                                                                    self.kl_ctrl, algo_cfg.kl_penalty,
                                                                    update_controller=True)
            advantages, returns = algo.compute_advantages(
                algo_cfg.adv_estimator, scores=scores, token_rewards=token_rewards, values=values, mask=mask,
                group_index=group_index, gamma=algo_cfg.gamma, lam=algo_cfg.lam,
                norm_adv_by_std_in_grpo=algo_cfg.norm_adv_by_std_in_grpo,
                baselines=whole(torch.tensor(info[BASELINE_KEY])) if BASELINE_KEY in info else None)
            batch.token_rewards = self.dp.local_rows(token_rewards, local_mask)
            batch.advantages = self.dp.local_rows(advantages, local_mask)
            batch.returns = self.dp.local_rows(returns, local_mask)
        if algo_cfg.use_pf_ppo and algo_cfg.adv_estimator == "gae":  # PF-PPO: rows redrawn by score (GAE, as verl)
            batch = pf_ppo_batch(batch, algo_cfg.pf_ppo, self.cfg.trainer.seed * 1_000_003 + self.global_step)

        # 6. updates: critic first (it is trained on the same returns), then the actor after the warm-up
        metrics: dict[str, float] = {}
        if self.critic is not None:
            with timer("update_critic"):
                metrics.update(self.update_critic(batch))
            self.schedulers["critic"].step()  # each model's schedule counts its own updates, as verl's
        # verl counts steps from 1: trainer.critic_warmup=N trains the critic alone for N - 1 steps
        if self.global_step + 1 >= self.cfg.trainer.critic_warmup:
            with timer("update_actor"):
                metrics.update(self.update_actor(batch))
            self.schedulers["actor"].step()
            if self.pipeline is None:
                sync_engine(self.engine, self.actor)  # [distributed] sharded: synced at the next generation instead
            else:  # [async] the engine gets these weights when the next rollout starts, or before validation
                self.pipeline.weights_changed()

        # 7. diagnostics (over all ranks' rows; timings are this rank's)
        metrics.update(step_metrics(
            self.dp, scores=scores, mask=mask, prompt_mask=rollout.prompt_mask, info=info,
            response_length=self.response_length, actor_lr=self.schedulers["actor"].get_last_lr()[0],
            step_time=time.perf_counter() - step_start, timer=timer, device=self.device,
            old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
            kl_coef=actor_cfg.kl_loss_coef if actor_cfg.use_kl_loss else None, values=values, returns=returns,
            oom_recoveries=len(self.run.oom_events), compiles=compiles_so_far() - compiles_at_start,
            extra={**kl_metrics, **sampling_metrics, **truncation_metrics, **balance_metrics, **warmup.metrics(),
                   **({"critic/lr": self.schedulers["critic"].get_last_lr()[0]} if self.critic is not None else {})}))
        metrics.update(self.precision_guard.end_step(metrics))  # loss scale, skipped steps; stops on a tripped rail
        return metrics

    def validate(self) -> dict:
        return validate(self.rollouts, self.val_set, self.dp, self.run_dir, self.global_step)

    # ------------------------------------------------------------------------------------------ the run
    def fit(self) -> dict:
        trainer_cfg = self.cfg.trainer
        try:
            self.maybe_resume()
            self.first_step = self.global_step
            self.apply_remembered_sizes()
            # [distributed] metrics, progress and plots from rank 0 alone; validating a checkpoint (val_only at a
            # resumed step) leaves the run's metrics as they are: its figures go to val_only_step_N.json
            keep_run_files = trainer_cfg.val_only and self.global_step > 0
            # the files keep the steps up to this one, but a row kept back for its validation (pending_validation):
            # this launch logs it, so a line an earlier launch logged of it (and then stopped) goes
            kept = self.global_step - (self.pending_validation is not None and not trainer_cfg.val_only)
            self.tracker = Tracker(self.run_dir, trainer_cfg.logger, trainer_cfg.project_name,
                                   trainer_cfg.experiment_name, OmegaConf.to_container(self.cfg, resolve=True),
                                   self.total_steps, resume_step=kept if self.global_step > 0 else None) \
                if self.dp.is_main and not keep_run_files else NullTracker()
            self.run_dir_watch = RunDirWatch(self.run_dir)
            with StopSignals() as self.stops.signals:
                return self._loop()
        finally:
            self.stops.signals = None
            if self._recorded_changes != self.run.changes:
                self.write_plan_record()
            if self.tracker is not None:
                self.tracker.close()
            if self.pipeline is not None:  # [async] before the reward manager a rollout in flight may be using
                self.pipeline.shutdown()
            self.reward_manager.close()
            if self.run_lock is not None:
                self.run_lock.release()

    def _loop(self) -> dict:
        trainer_cfg, stops = self.cfg.trainer, self.stops
        last_val: dict = {}
        saved_step = self.global_step
        if self.pending_validation is not None and not trainer_cfg.val_only:  # resumed: the step's validation first
            last_val = self._validate_pending(saved_step)
        if trainer_cfg.val_only or (trainer_cfg.val_before_train and self.global_step == 0):
            last_val = stops.droppable(self.validate) or {}
            if last_val and self.global_step == 0:
                self.tracker.log(last_val, step=0)
            elif last_val and self.dp.is_main:  # val_only on a resumed run: metrics.jsonl already has this step
                path = os.path.join(self.run_dir, f"val_only_step_{self.global_step}.json")
                with open(path, "w") as handle:
                    json.dump(last_val, handle, indent=2)
                log.info("validation of step %d: %s (%s)", self.global_step,
                         ", ".join(f"{k} {v:.4g}" for k, v in last_val.items() if isinstance(v, float)), path)
            if trainer_cfg.val_only:  # verl's val_only: the model as loaded (or resumed), validated, no training
                return last_val
        while self.global_step < self.total_steps and self.prompts_left():
            self._stop_on_signal(saved_step)
            stops.signals.step = self.global_step
            metrics = self._train_step_or_drop()
            if metrics is None:
                continue  # dropped by a signal: _stop_on_signal saves and stops
            self.global_step += 1
            stops.signals.step = self.global_step
            metrics["train/epoch"] = float(self.loader.epoch)
            is_last = self.global_step >= self.total_steps or not self.prompts_left()
            if trainer_cfg.test_freq > 0 and (self.global_step % trainer_cfg.test_freq == 0 or is_last):
                val = stops.droppable(self.validate) if stops.signal_received() is None else None
                if val is None:  # a stop signal: the checkpoint keeps the row, a resumed run validates and logs it
                    self.pending_validation = metrics
                else:
                    last_val = val
                    metrics.update(val)
            if self.pending_validation is None:
                self.tracker.log(metrics, step=self.global_step)
            try:
                stops.check_step(metrics)
                if self._recorded_changes != self.run.changes:  # OOM recovery lowered a size, a cache was freed
                    self.write_plan_record()
                if self.dp.is_main:
                    self.run_dir_watch.check(self.global_step)  # the folder deleted: its metrics are lost, stop
                scored = metrics.get("filter_groups/prompts_drawn", self.loader.batch_size)  # dynamic sampling
                stops.record_rewards(metrics["reward/errors"], scored * self.n, self.reward_manager.last_error)
            except Exception:  # the run stops here, before a checkpoint could keep the row back: logged as it is
                if self.pending_validation is not None:
                    self.tracker.log(self.pending_validation, step=self.global_step)
                    self.pending_validation = None
                raise
            if trainer_cfg.save_freq > 0 and (self.global_step % trainer_cfg.save_freq == 0 or is_last):
                self.save()
                saved_step = self.global_step
        if self.pending_validation is not None:  # a signal in the last step skipped the final validation
            self._stop_on_signal(saved_step)
        return last_val  # otherwise a signal during the last step ends a complete run as usual

    def _validate_pending(self, saved_step: int) -> dict:
        """The validation a stop signal kept from the step this run resumed at, logged with that step's row (as the
        uninterrupted run logs it); a signal that drops it again stops the run with it still pending."""
        val = self.stops.droppable(self.validate)
        if val is None:
            self._stop_on_signal(saved_step)
        row, self.pending_validation = {**self.pending_validation, **val}, None
        self.tracker.log(row, step=self.global_step)
        return val

    def prompts_left(self) -> bool:
        """Whether the passes over the prompts that bound the run (trainer.total_epochs) have prompts left."""
        return self.prompt_passes is None or \
            self.loader.batches_drawn() < self.prompt_passes * self.loader.steps_per_epoch

    def _train_step_or_drop(self) -> Optional[dict]:
        """One step; None when a stop signal dropped it before any update (the data position and RNG rewound)."""
        loader_state, rng = self.loader.state_dict(), capture_rng()
        step_stream = self.pipeline.step_stream() if self.pipeline is not None else contextlib.nullcontext()
        with maybe_profile(self.global_step + 1, self.profile_steps, self.run_dir, self.device,
                           self.dp.rank if self.dp.enabled else None), step_stream:
            metrics = self.stops.droppable(lambda: self.train_step(self.loader.next_batch()))
        if metrics is None:
            self.loader.load_state_dict(loader_state)
            restore_rng(*rng)
        elif self.pipeline is not None:  # [async] this step's batch is trained: a later rewind must not bring it back
            self.pipeline.step_trained()
        return metrics

    def _stop_on_signal(self, saved_step: int) -> None:
        if self.stops.signal_received() is None:
            return
        path = None
        if self.global_step > 0:
            path = self.save() if saved_step != self.global_step else self.stops.last_good_checkpoint
        raise RunInterrupted(self.stops.signals.received, self.global_step, path)
