"""The memory plan: the estimator's per-phase peaks against the device's budget decide gradient checkpointing,
offload, micro-batch sizes, the rollout batch, the log-prob chunk and where the reference lives.

`plan_memory` is a pure function: it returns a `MemoryPlan` (every setting with its reason, and the inputs it was
estimated from) and changes nothing. Several ranks may plan memory more than once (replicated, sharded, a shard per
node; `sharding.py`); only the memory plan that is kept is applied to the Plan (`apply_memory`), its reasons with
it, so no reason can describe an attempt that was discarded."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from .. import estimator as est
from ..model_shape import ModelShape
from ..plans import Plan
from ..vocabulary import SHARED_PROMPTS_MASKED, NoFitError
from .device import Decision, Target, auto_flag
from .multiturn import plan_multiturn
from .rollout import fp32_gemm_layouts


@dataclass
class MemoryPlan:
    """One memory plan: the settings, a reason for each (keyed like Plan.reasons), and what it was estimated from
    (to estimate it again once later decisions are known: shared prompts)."""

    shard_world: int
    budget: int
    estimate: dict
    placement: est.Placement
    workload: est.Workload
    shape: ModelShape
    critic_shape: Optional[ModelShape]
    optimizer_offload: bool
    param_offload: bool
    merge_micro_batches: bool
    ref_device: str
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def offloads(self) -> bool:
        return self.optimizer_offload or self.param_offload

    def peak_text(self) -> str:
        """The per-rank peak against the budget, for the data-parallel reason."""
        peak = self.estimate.get("peak_bytes")
        return (f"per-rank peak {_gib(peak)} of {_gib(self.budget)}" if peak else "per-rank memory not estimated")


@dataclass(frozen=True)
class TrainingKernels:
    """The training passes' kernels as the memory estimate counts them (est.Workload's fields of the same names).
    The defaults are the heaviest: eager decoder layers, k/v heads repeated per query head, every row its own
    prompt."""

    compiled_layers: bool = False
    kv_heads_repeated: bool = True
    share_prompts: bool = False
    shared_prompt_kernel: str = SHARED_PROMPTS_MASKED  # plan.shared_prompt_kernel: what the gathered keys take


def _gib(value) -> str:
    return f"{value / 2**30:.2f} GiB" if value else "?"


def _per_device(value: Optional[int], world: int) -> Optional[int]:
    return None if value is None else max(1, int(value) // world)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def plan_memory(cfg: Any, plan: Plan, target: Target, shape: ModelShape, critic_shape: Optional[ModelShape],
                scores_materialized: bool, critic_lora: int, separate_ref: bool, shard_world: int = 1,
                host_ram_bytes: Optional[int] = None, kernels: Optional[TrainingKernels] = None) -> MemoryPlan:
    """The memory plan for `cfg` with the models sharded over `shard_world` ranks (1: a full replica per rank).
    Reads the decisions already in `plan` (dtypes, engine, which models exist), writes nothing. Raises NoFitError
    when nothing fits, naming what would. `kernels`: the training kernels the search counts (default: eager layers,
    repeated k/v heads, packed rows, the largest of each)."""
    kernels = kernels or TrainingKernels()
    hcfg = cfg.hardware
    arr = cfg.actor_rollout_ref
    actor, critic = arr.actor, cfg.critic
    per_node = max(1, int(cfg.trainer.n_gpus_per_node))  # processes on this machine, sharing its RAM
    world = max(1, int(cfg.trainer.nnodes) * per_node)
    n = int(arr.rollout.n)
    prompts = int(cfg.data.train_batch_size)
    mini = min(int(actor.ppo_mini_batch_size), prompts)
    critic_mini = min(int(critic.ppo_mini_batch_size or mini), prompts)
    reasons: dict[str, str] = {}
    if hcfg.memory_budget_gib:
        device_bytes = int(float(hcfg.memory_budget_gib) * est.GIB)
        source = f"hardware.memory_budget_gib={hcfg.memory_budget_gib}"
    elif not target.is_cuda and per_node > 1:  # CPU processes on one machine share its RAM
        device_bytes = target.memory_bytes // per_node
        source = (f"{target.name} {est.format_bytes(target.memory_bytes)} shared by {per_node} processes: "
                  f"{est.format_bytes(device_bytes)} each")
    else:
        device_bytes = target.memory_bytes
        source = f"{target.name}{' (emulated)' if target.emulated else ''} {est.format_bytes(device_bytes)}"
    budget = est.memory_budget_bytes(device_bytes, target.is_cuda)
    reasons["memory_budget"] = (
        f"{source} - {est.format_bytes(est.CUDA_CONTEXT_BYTES)} CUDA context, x {est.SAFETY_FRACTION} margin"
        if target.is_cuda else f"{source} available RAM x {est.CPU_RAM_FRACTION}")
    # multi-turn rollouts: the tools' descriptions lengthen the prompt; every turn lives in the response length
    prompt_tokens, multi_turn_reason = plan_multiturn(cfg, int(arr.rollout.prompt_length or cfg.data.max_prompt_length))
    if multi_turn_reason:
        reasons["multi_turn"] = multi_turn_reason
    workload = est.Workload(
        param_dtype=plan.param_dtype, compute_dtype=plan.compute_dtype, rollout_dtype=plan.rollout.dtype,
        use_autocast=plan.use_autocast, prompts_per_step=max(1, math.ceil(prompts / world)), samples_per_prompt=n,
        prompt_length=prompt_tokens,
        response_length=int(arr.rollout.response_length or cfg.data.max_response_length),
        actor_mini_batch=max(1, mini * n // world), critic_mini_batch=max(1, critic_mini * n // world),
        has_critic=plan.use_critic, has_ref=separate_ref,
        actor_lora_rank=int(arr.model.lora_rank), critic_lora_rank=critic_lora,
        attention_materializes_scores=scores_materialized, on_cuda=target.is_cuda,
        use_dynamic_bsz=bool(actor.use_dynamic_bsz),
        token_budget_cap=int(actor.ppo_max_token_len_per_gpu) if actor.use_dynamic_bsz else None,
        rollout_engine=plan.rollout.engine,
        rollout_layout_copies=fp32_gemm_layouts(plan.rollout.dtype or plan.param_dtype, target.is_cuda, target.cc,
                                                plan.rollout.engine, shape, budget).value,
        # FSDP2 sharding: weights/grads/Adam divided by the ranks, gathered weights counted
        shard_world=shard_world, gather_dtype=sharded_gather_dtype(plan) if shard_world > 1 else None,
        compiled_layers=kernels.compiled_layers, kv_heads_repeated=kernels.kv_heads_repeated,
        share_prompts=kernels.share_prompts, shared_prompt_kernel=kernels.shared_prompt_kernel)

    fixed: dict[str, Any] = {
        "gradient_checkpointing": auto_flag(arr.model.enable_gradient_checkpointing),
        "optimizer_offload": auto_flag(hcfg.optimizer_offload),
        "param_offload": auto_flag(hcfg.param_offload),
        "ref_on_device": {"auto": None, "cpu": False}.get(str(hcfg.ref_device).lower(), True),
        "actor_micro_batch": _first(actor.ppo_micro_batch_size_per_gpu,
                                    _per_device(actor.ppo_micro_batch_size, world)),
        "critic_micro_batch": _first(critic.ppo_micro_batch_size_per_gpu,
                                     _per_device(critic.ppo_micro_batch_size, world)),
        # one size for the forward-only passes (old/ref log-probs, critic values): the first one given
        "logprob_micro_batch": _first(arr.rollout.log_prob_micro_batch_size_per_gpu,
                                      arr.ref.log_prob_micro_batch_size_per_gpu,
                                      critic.forward_micro_batch_size_per_gpu,
                                      _per_device(arr.rollout.log_prob_micro_batch_size, world),
                                      _per_device(arr.ref.log_prob_micro_batch_size, world),
                                      _per_device(critic.forward_micro_batch_size, world)),
    }
    if not target.is_cuda:
        for key in ("optimizer_offload", "param_offload"):
            if fixed[key]:
                reasons[key] = f"hardware.{key}=true ignored: a CPU run has nowhere to offload to"
            fixed[key] = None
        fixed["ref_on_device"] = None
    if shard_world > 1:  # FSDP2 offloads with its CPUOffloadPolicy only; a sharded ref stays on device
        fixed.update(optimizer_offload=False, ref_on_device=True, param_offload=bool(fixed["param_offload"]))
    chunk = int(hcfg.logprob_chunk_size or 0) or None
    fit = est.fit_settings(shape, workload, budget, fixed, critic_shape, logprob_chunk_size=chunk)
    if fit is None:
        label = f" ({source})" if world == 1 else (
            f" ({source} per rank; the models sharded over the {world} ranks)" if shard_world > 1 else
            f" ({source} per rank; each of the {world} ranks holds the full models)")
        raise NoFitError(est.explain_no_fit(shape, workload, budget, fixed, critic_shape, label))
    placement, estimate = fit.placement, fit.estimate
    if host_ram_bytes and target.is_cuda:
        host = check_host_memory(est.host_offload_bytes(shape, workload, placement, critic_shape), per_node,
                                 host_ram_bytes)
        if host is not None:
            reasons["host_memory"] = host
    settings = {"gradient_checkpointing": placement.gradient_checkpointing,
                "optimizer_offload": placement.optimizer_offload and target.is_cuda,
                "param_offload": placement.param_offload and target.is_cuda}
    # planning-only runs (emulated card, no GPU here) still name the card's device for what lives on it
    on_device = plan.device if (plan.device != "cpu" or not target.is_cuda) else "cuda:0"
    ref_device = (on_device if placement.ref_on_device else "cpu") if separate_ref else "none"
    phases = estimate["phases"]
    seq = workload.seq_len

    def peak_text(*names: str) -> str:
        present = [p for p in names if p in phases]
        name = max(present, key=phases.get)
        return f"{name} peak {est.format_bytes(phases[name])} of {est.format_bytes(budget)}"

    caps = est.micro_batch_caps(workload)

    def batch_reason(key: str, value: int, explicit_from: str, *phase_names: str) -> str:
        if fixed.get(key) is not None:
            return f"{explicit_from}={value} ({peak_text(*phase_names)})"
        cap, cap_why = caps[key]
        roomy_cap, roomy_why = caps.get(f"roomy_{key}", (cap, cap_why))
        if value > cap:  # grown past the cap (estimator._choose_batches): say so, and where the growth stopped
            how = (f"{roomy_why + ', ' if value == roomy_cap else ''}past the {est.MAX_TOKENS_PER_MICRO_BATCH}-token "
                   f"cap while the peak stays under {est.ROOMY_PEAK_FRACTION:.0%} of the budget "
                   "(fewer kernel launches)")
        else:
            how = cap_why if value == cap else "the largest power of two that fits"
        return f"{value} sequences x {seq} tokens: {how} ({peak_text(*phase_names)})"

    explicit = {"gradient_checkpointing": "actor_rollout_ref.model.enable_gradient_checkpointing",
                "optimizer_offload": "hardware.optimizer_offload", "param_offload": "hardware.param_offload"}
    for key, value in settings.items():
        if key not in reasons:  # the CPU's "ignored" reasons above stay
            note = fit.notes.get(key, "")
            reasons[key] = (f"{explicit[key]}={value}" if note == "explicit" else
                            f"{'on' if value else 'off'}: {note}")
    sized_by_config = [key for key in ("actor_micro_batch", "critic_micro_batch", "logprob_micro_batch")
                       if fixed.get(key) is not None]
    merge = not workload.use_dynamic_bsz and not sized_by_config
    reasons["merge_micro_batches"] = (
        "off: use_dynamic_bsz cuts micro-batches by its token budget" if workload.use_dynamic_bsz else
        f"off: micro-batch sizes set by the config ({', '.join(sized_by_config)}): exactly those rows"
        if sized_by_config else
        f"the planned row counts are bounds: a micro-batch takes more rows while they hold no more tokens than that "
        f"many {seq}-token rows, so short responses run in fewer, larger micro-batches (the same planned peak)")
    if workload.use_dynamic_bsz:
        reasons["max_token_len_per_micro_batch"] = (
            f"use_dynamic_bsz: ppo_max_token_len_per_gpu={actor.ppo_max_token_len_per_gpu}"
            + (f" lowered to {placement.max_token_len} to fit" if placement.max_token_len
               < int(actor.ppo_max_token_len_per_gpu) else "") + f" ({peak_text('actor_update', 'critic_update')})")
        reasons["actor_micro_batch_size"] = "use_dynamic_bsz: micro-batches are cut by the token budget"
        reasons["critic_micro_batch_size"] = reasons["actor_micro_batch_size"]
    else:
        reasons["actor_micro_batch_size"] = batch_reason(
            "actor_micro_batch", placement.actor_micro_batch, "actor.ppo_micro_batch_size_per_gpu", "actor_update")
        if plan.use_critic:
            reasons["critic_micro_batch_size"] = batch_reason(
                "critic_micro_batch", placement.critic_micro_batch, "critic.ppo_micro_batch_size_per_gpu",
                "critic_update")
    reasons["logprob_micro_batch_size"] = batch_reason(
        "logprob_micro_batch", placement.logprob_micro_batch, "log_prob_micro_batch_size_per_gpu",
        "old_log_prob", "ref_log_prob", "values") + "; old/ref log-probs and values"
    reasons["rollout_batch_size"] = (
        f"{'all ' if placement.rollout_batch == workload.rollout_sequences else ''}{placement.rollout_batch} of "
        f"{workload.rollout_sequences} sequences at once ({peak_text('rollout')})")
    reasons["logprob_chunk_size"] = ("hardware.logprob_chunk_size" if chunk else
                                     f"logits of {placement.logprob_chunk_size} tokens x {shape.vocab_size} vocab per "
                                     f"chunk stay under {est.LOGIT_CHUNK_TARGET_FRACTION:.0%} of the budget")
    if separate_ref:
        ref_note = fit.notes.get("ref_on_device", "")
        reasons["ref_device"] = ("hardware.ref_device" if ref_note == "explicit" else
                                 "parked on CPU, moved to the device only for its log-prob pass: needed to fit"
                                 if not placement.ref_on_device else "fits beside the actor" +
                                 (" and critic" if plan.use_critic else ""))
    return MemoryPlan(shard_world=shard_world, budget=budget, estimate=estimate, placement=placement,
                      workload=workload, shape=shape, critic_shape=critic_shape,
                      optimizer_offload=settings["optimizer_offload"], param_offload=settings["param_offload"],
                      merge_micro_batches=merge, ref_device=ref_device, reasons=reasons)


def apply_memory(plan: Plan, memory: MemoryPlan) -> None:
    """Write the kept memory plan into `plan`: its settings and their reasons, together."""
    placement = memory.placement
    plan.memory_budget_bytes = memory.budget
    plan.estimate = memory.estimate
    plan.gradient_checkpointing = placement.gradient_checkpointing
    plan.optimizer_offload = memory.optimizer_offload
    plan.param_offload = memory.param_offload
    plan.sizes.actor_micro_batch_size = placement.actor_micro_batch
    plan.sizes.critic_micro_batch_size = placement.critic_micro_batch if plan.use_critic else None
    plan.sizes.logprob_micro_batch_size = placement.logprob_micro_batch
    plan.sizes.max_token_len_per_micro_batch = placement.max_token_len
    plan.sizes.rollout_batch_size = placement.rollout_batch
    plan.logprob_chunk_size = placement.logprob_chunk_size
    plan.ref_device = memory.ref_device
    plan.merge_micro_batches = memory.merge_micro_batches
    plan.reasons.update(memory.reasons)


def sharded_gather_dtype(plan: Plan):
    """The dtype FSDP2 gathers a sharded model's weights in: the compute dtype under bf16 autocast
    (MixedPrecisionPolicy, gradients reduced in fp32); None (the fp32 params) otherwise, fp16 included (it keeps
    autocast + loss scaler on fp32 weights)."""
    from ..vocabulary import BF16

    return BF16 if plan.use_autocast and plan.compute_dtype == BF16 else None


def check_host_memory(offloaded: dict[str, int], per_node: int, host_ram_bytes: int) -> Optional[str]:
    """What the plan offloads lives in this machine's RAM, once per rank on it: refuse before loading when the
    ranks' offloaded state does not fit the RAM available (x est.CPU_RAM_FRACTION); else the reason saying how much
    it takes (None: nothing offloaded)."""
    if not offloaded:
        return None
    per_rank = sum(offloaded.values())
    need, budget = per_rank * per_node, int(host_ram_bytes * est.CPU_RAM_FRACTION)
    parts = ", ".join(f"{name.replace('_', ' ')} {est.format_bytes(size)}" for name, size in offloaded.items())
    ranks = f" x {per_node} ranks on this machine = {est.format_bytes(need)}" if per_node > 1 else ""
    text = (f"{est.format_bytes(per_rank)} per rank in host RAM ({parts}){ranks}, of "
            f"{est.format_bytes(budget)} (available RAM {est.format_bytes(host_ram_bytes)} x {est.CPU_RAM_FRACTION})")
    if need > budget:
        spread = ("fewer ranks per machine (trainer.n_gpus_per_node), hardware.data_parallel=shard (FSDP2 divides "
                  "weights and Adam states over the ranks instead of offloading them)" if per_node > 1 else
                  "several GPUs (trainer.n_gpus_per_node=N shards weights and Adam states over them)")
        raise NoFitError(f"the GPU memory plan offloads {text}: more than this machine's RAM holds. Fixes: {spread}, "
                         "LoRA (actor_rollout_ref.model.lora_rank), a smaller model or batch, or more RAM")
    return f"offloaded: {text}"


def decide_reference(use_ref: bool, use_lora: bool, kl_loss: bool, kl_reward: bool, memory: MemoryPlan
                     ) -> Decision:
    """Decision(ref_device, reason): where the reference model lives ("none" when there is none to load)."""
    if not use_ref:
        return Decision("none", "no reference model: no KL term (use_kl_loss and use_kl_in_reward off, or coef 0)")
    if use_lora:
        return Decision("none", "LoRA: the reference is the base model with the adapter disabled (no second copy)")
    why = " and ".join(w for w, on in (("use_kl_loss", kl_loss), ("use_kl_in_reward", kl_reward)) if on)
    return Decision(memory.ref_device, f"{why} needs a reference; " + memory.reasons.get("ref_device", ""))


def with_training_kernels(memory: MemoryPlan, compiled_layers: bool, kv_heads_repeated: bool) -> MemoryPlan:
    """The kept memory plan with its estimate recounted for the training kernels, which are decided after it (they
    depend on its offload and sharding): compiled decoder layers, and k/v heads given to attention grouped or
    repeated. The settings stay those the search chose assuming eager layers and repeated heads, the larger of
    each, so they fit either way (also should compiling fail and the layers run eager); the recount is what the
    run holds, for the reported peaks and the decisions made from them later (KV cache, reward model, overlap)."""
    workload = replace(memory.workload, compiled_layers=compiled_layers, kv_heads_repeated=kv_heads_repeated)
    estimate = est.estimate_memory(memory.shape, workload, memory.placement, memory.critic_shape, memory.budget)
    return replace(memory, workload=workload, estimate=estimate)


# what the refit may change: the update's micro-batches and checkpointing, the no-grad passes' micro-batch. The
# rest was decided from the first search (rollout batch, offload, where the reference lives) and must stay.
REFIT_KEEPS = ("optimizer_offload", "param_offload", "ref_on_device", "rollout_batch", "logprob_chunk_size")


def refit_for_kernels(plan: Plan, memory: MemoryPlan, kernels: TrainingKernels,
                      decide_kernels: Callable[[Plan], None], search: Callable[[], MemoryPlan]) -> Optional[MemoryPlan]:
    """The memory plan searched again for the training kernels the run will have (`search()`: plan_memory with
    `kernels`), or None to keep `memory`, the search for the heaviest kernels.

    The first search counts eager decoder layers and a full prompt per row, because compiling and prompt sharing are
    decided after it (from its offload and checkpointing). Compiled layers keep about 0.6x an eager layer's
    activations and shared prompts carry a group's prompt once, so at the first search's micro-batch the run holds
    far less than planned (Qwen2.5-1.5B's shape, bf16 on an H200: 51 GiB counted for 82 GiB searched), and the
    update ran smaller micro-batches, or checkpointed, for memory it never used. The refit is kept only when it
    changes no more than the micro-batches and checkpointing, and when `decide_kernels` (compiling, prompt sharing)
    decides the same kernels from its settings: the plan then counts what runs. Only for compiled layers (measured
    on an H200): eager passes (Pascal, Turing, CPU) keep the first search's sizes."""
    if not kernels.compiled_layers or memory.workload.use_dynamic_bsz:
        return None
    try:
        refit = search()
    except NoFitError:
        return None
    if any(getattr(refit.placement, key) != getattr(memory.placement, key) for key in REFIT_KEEPS):
        return None
    if refit.placement == memory.placement:
        return None
    trial = copy.deepcopy(plan)
    apply_memory(trial, refit)
    decide_kernels(trial)
    decided = (trial.compile_training, trial.share_prompts, trial.shared_prompt_kernel)
    return refit if decided == (plan.compile_training, plan.share_prompts, plan.shared_prompt_kernel) else None


def refit_note(searched: dict, refit: MemoryPlan) -> str:
    """The kernel reason's tail when the refit sized the micro-batches."""
    kernels = " and ".join(name for name, on in (("compiled layers", refit.workload.compiled_layers),
                                                ("each prompt once", refit.workload.share_prompts)) if on)
    return (f"; micro-batches sized for {kernels}: planned peak {est.format_bytes(refit.estimate['peak_bytes'])}"
            + (f" (the eager, packed-row search: {est.format_bytes(searched['peak_bytes'])} at its smaller "
               "micro-batches)" if searched.get("peak_bytes") else ""))


def training_kernels_note(searched: dict, recounted: dict) -> str:
    """The compile reason's tail: the peak the run holds with compiled layers, and the one that sized the batches."""
    if not searched.get("peak_bytes") or recounted.get("peak_bytes") == searched["peak_bytes"]:
        return ""
    return (f"; planned peak {est.format_bytes(recounted['peak_bytes'])} with compiled layers "
            f"({est.format_bytes(searched['peak_bytes'])} as eager layers, which sized the micro-batches)")


def count_prompts_once(memory: MemoryPlan, kernel: str = SHARED_PROMPTS_MASKED) -> dict:
    """Shared prompts: the estimate of the chosen settings again with each distinct prompt counted once per
    micro-batch. The settings were searched with packed rows (sharing is decided after them, from checkpointing
    and compiling), a bound that holds either way; the recount is what the run will hold, for the KV-cache decision
    and the reported peaks."""
    workload = replace(memory.workload, share_prompts=True, shared_prompt_kernel=kernel)
    return est.estimate_memory(memory.shape, workload, memory.placement,
                               memory.critic_shape, memory.budget)


def shared_prompts_note(packed: dict, shared: dict) -> str:
    """The share_prompts reason's tail: the peak with prompts counted once, and as packed rows."""
    if not packed.get("peak_bytes"):
        return ""
    return (f"; planned peak {est.format_bytes(shared['peak_bytes'])} with each prompt once "
            f"({est.format_bytes(packed['peak_bytes'])} as packed rows, which sized the micro-batches)")
