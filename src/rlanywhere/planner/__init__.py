"""The planner: every hardware decision for a run, made once, before any model loads, each with its reason.

    plan = make_plan(cfg)           # raises PlanError / NoFitError for impossible requests, before any model loads

One module per kind of decision, each a function from its inputs to the decision and its reason:
  * device.py     - the device, the hardware the decisions are for (an emulated card, the GPU, the CPU), the memory
                    cap that makes a GPU stand in for a smaller card;
  * precision.py  - bf16 autocast where the card has native bf16, fp16 autocast with loss scaling on Volta / Turing
                    when the fp16 checks pass, else fp32 (always on Pascal and CPU); the rollout dtype; TF32; the
                    attention implementation (FlashAttention-2, SDPA, eager);
  * memory.py     - the estimator's per-phase peaks against the budget decide checkpointing, micro-batch sizes,
                    offload and where the reference lives (a `MemoryPlan` value, applied once);
  * sharding.py   - several ranks: replicas or FSDP2 shards (and HSDP groups), with the memory plan that goes with it;
  * rollout.py    - how the rollout engine runs (`RolloutPlan`), `plan_rollout_for` for benches without a config;
  * training.py   - the training passes' kernels: SDPA backends, K/V head expansion, fused AdamW, compiled layers,
                    shared prompts.
What applies a plan to the running process (environment, TF32 flags, autocast, the loss scaler) is in runtime.py,
outside the planner. `--emulate CARD` plans for a card from `machine.CARDS`. The inputs come from machine.py (the
probe, the card table) and model_shape.py; the result is a plans.Plan. The planner imports nothing that runs a
model. docs/hardware.md has the long form.
"""

from __future__ import annotations

from typing import Any, Optional

from ..algorithms import estimator_needs, kl_penalty_in_reward
from ..async_plan import plan_async_rollout, recheck_overlap_with_reward_model, spare_core_for_rollout
from ..estimator import format_bytes
from ..machine import HardwareProbe, card_spec, probe_machine
from ..model_shape import ModelShape, read_model_shape
from ..plans import Plan, RolloutPlan
from ..vocabulary import ALLOC_CONF, ATTN_EAGER, ATTN_SDPA, NoFitError, PlanError, \
    RolloutEngineName
from .device import Decision, Target, auto_flag, card_reason, check_real_card_runs, decide_memory_cap, make_target, \
    resolve_device
from .memory import MemoryPlan, TrainingKernels, apply_memory, count_prompts_once, decide_reference, plan_memory, \
    refit_for_kernels, refit_note, shared_prompts_note, sharded_gather_dtype, training_kernels_note, \
    with_training_kernels
from .precision import decide_attention, decide_precision, decide_rollout_dtype, decide_tf32, fp16_checks, \
    sdpa_backends
from .rollout import DECODE_SPAN_GRANULARITY, TRITON_DECODE_MIN_CC, decide_kv_release, fp32_gemm_layouts, \
    plan_rollout, plan_rollout_for, rollout_policy
from .reward_model import plan_from_config
from .sharding import DATA_PARALLEL_MODES, ShardingDecision, apply_sharding, plan_data_parallel, plan_sharding
from .training import SHARED_PROMPT_MODEL_TYPES, compile_min_steps, decide_prompt_sharing, plan_prompt_sharing, \
    plan_training_compile, plan_training_kernels

# Names that moved to runtime.py (they apply a plan, they decide nothing), still reachable here for callers that
# imported them from the planner; loaded on first use, so the planner itself does not import the runtime.
_RUNTIME_NAMES = ("prepare_environment", "apply_runtime", "autocast_context", "make_grad_scaler",
                  "training_attention_context")


def __getattr__(name: str) -> Any:
    if name in _RUNTIME_NAMES:
        from .. import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_plan(cfg: Any, machine: Optional[HardwareProbe] = None, *, for_execution: bool = True,
              emulate: Optional[str] = None, model_shape: Optional[ModelShape] = None,
              critic_shape: Optional[ModelShape] = None) -> Plan:
    """Decide everything hardware-related for `cfg` on `machine` (probed now when None) or an emulated card.

    for_execution=False (the `plan` command) allows planning for an emulated card on a machine without CUDA;
    the plan's device is then "cpu" and the decisions are for the card. Raises PlanError / NoFitError."""
    # probed now: only the kernels the decisions read, when they read them (the compute dtype's SDPA backends; the
    # fp16 checks where fp16 is considered), not every dtype's as `rlanywhere plan` and `doctor` show them
    machine = machine if machine is not None else probe_machine(measure_sdpa=False)
    hcfg = cfg.hardware
    arr = cfg.actor_rollout_ref
    reasons: dict[str, str] = {}
    emulate_name = emulate or hcfg.emulate
    card = card_spec(emulate_name) if emulate_name else None
    device, real, reasons["device"] = resolve_device(cfg, machine, card, for_execution)
    target = make_target(card, real, device, machine)
    reasons["card"] = card_reason(card, real, target)

    shape = model_shape or read_model_shape(arr.model.path, arr.model.get("gguf_file"))
    if critic_shape is None and cfg.critic.model.path and cfg.critic.model.path != arr.model.path:
        critic_shape = read_model_shape(cfg.critic.model.path)

    precision, reasons["precision"] = decide_precision(str(hcfg.precision), target,
                                                       fp16_checks(target, real, device, machine))
    rollout_dtype, reasons["rollout_dtype"] = decide_rollout_dtype(str(arr.rollout.get("dtype", "auto")),
                                                                   precision, target)
    allow_tf32, reasons["allow_tf32"] = decide_tf32(target)
    backends = sdpa_backends(target, precision.compute, shape.head_dim)
    attn, reasons["attn_implementation"] = decide_attention(str(hcfg.attn_implementation), machine, target,
                                                            precision.compute, backends, shape.head_dim)
    engine = str(arr.rollout.name)
    fallback_allowed = engine == RolloutEngineName.AUTO
    if fallback_allowed:
        engine = RolloutEngineName.FAST.value
        reasons["rollout_engine"] = ("auto: the fast engine (static KV cache, CUDA graphs); it falls back to hf "
                                     "for architectures it does not support")
    else:
        reasons["rollout_engine"] = f"actor_rollout_ref.rollout.name={engine}"

    # which models exist
    actor = arr.actor
    use_critic = estimator_needs(cfg.algorithm.adv_estimator).critic  # the estimator's registration says
    reasons["use_critic"] = (f"adv_estimator={cfg.algorithm.adv_estimator} needs a value model" if use_critic else
                             f"adv_estimator={cfg.algorithm.adv_estimator} needs no value model")
    kl_loss = bool(actor.use_kl_loss) and float(actor.kl_loss_coef) > 0
    kl_reward = kl_penalty_in_reward(cfg.algorithm)
    use_ref = kl_loss or kl_reward
    use_lora = int(arr.model.lora_rank) > 0
    critic_lora = int(cfg.critic.model.lora_rank) if use_critic else 0
    reasons["use_lora"] = (f"actor_rollout_ref.model.lora_rank={arr.model.lora_rank}" if use_lora
                           else "full fine-tuning (lora_rank=0)")

    plan = Plan(device=device, card=target.name, compute_capability=target.cc, precision=precision.name,
                param_dtype=precision.param, compute_dtype=precision.compute,
                use_autocast=precision.autocast, use_grad_scaler=precision.scaler, allow_tf32=allow_tf32,
                attn_implementation=attn, reasons=reasons, emulated=target.emulated,
                use_critic=use_critic, use_ref=use_ref, use_lora=use_lora,
                alloc_conf=ALLOC_CONF if target.is_cuda else None)
    plan.rollout = RolloutPlan(engine=engine, fallback_allowed=fallback_allowed, dtype=rollout_dtype,
                               reasons={"engine": reasons["rollout_engine"], "dtype": reasons["rollout_dtype"],
                                        "fallback_allowed": "automatic choice" if fallback_allowed else
                                        f"actor_rollout_ref.rollout.name={engine} asked for this engine"})
    reasons["alloc_conf"] = ("fewer fragmentation OOMs as phase shapes change (set before CUDA initialises)"
                             if target.is_cuda else "CPU")

    # memory, per rank: several ranks may plan it more than once (replicated, sharded); the kept plan is applied
    scores = attn == ATTN_EAGER or (attn == ATTN_SDPA and set(backends) <= {"math"})
    # host RAM holds what a GPU plan offloads; known when the GPUs are this machine's (not a plan for another one)
    host_ram = machine.ram_available_bytes if real is not None and machine.ram_available_bytes else None
    sharding = plan_sharding(cfg, lambda shard_world: plan_memory(
        cfg, plan, target, shape, critic_shape, scores, critic_lora, use_ref and not use_lora,
        shard_world=shard_world, host_ram_bytes=host_ram))
    apply_memory(plan, sharding.memory)
    apply_sharding(plan, sharding)
    plan.ref_device, reasons["ref_device"] = decide_reference(use_ref, use_lora, kl_loss, kl_reward, sharding.memory)
    plan.memory_fraction, reasons["memory_fraction"] = decide_memory_cap(card, real, for_execution)
    plan_data_parallel(cfg, plan, machine, for_execution)
    plan_rollout(cfg, plan, target, shape, machine)
    plan_training_kernels(plan, backends, target.is_cuda)

    def decide_kernels(decided: Plan) -> None:
        plan_training_compile(decided, bool(actor.use_torch_compile), target.is_cuda, target.cc, machine.triton_usable,
                              auto_flag(cfg.hardware.compile_training), cfg.trainer.total_training_steps,
                              shape.num_params())
        plan_prompt_sharing(decided, auto_flag(cfg.hardware.share_prompts), int(arr.rollout.n), shape.model_type,
                            flash_runs=target.is_cuda and "flash_attention" in backends)

    def decided_kernels() -> TrainingKernels:
        """The update's kernels as the plan has them now (shared prompts may repeat the k/v heads)."""
        return TrainingKernels(plan.compile_training, plan.expand_kv_heads or scores or attn == ATTN_EAGER
                               or plan.share_prompts, plan.share_prompts, plan.shared_prompt_kernel)

    decide_kernels(plan)
    kernels = decided_kernels()
    searched = plan.estimate or {}
    # the search counted eager layers and packed rows; the update's micro-batch and checkpointing searched again for
    # the kernels decided since, kept when those kernels still follow from the new settings
    refit = refit_for_kernels(plan, sharding.memory, kernels, decide_kernels, lambda: plan_memory(
        cfg, plan, target, shape, critic_shape, scores, critic_lora, use_ref and not use_lora,
        shard_world=sharding.memory.shard_world, host_ram_bytes=host_ram, kernels=kernels))
    if refit is not None:
        sharding.memory = refit
        apply_memory(plan, refit)
        plan.ref_device, reasons["ref_device"] = decide_reference(use_ref, use_lora, kl_loss, kl_reward, refit)
        decide_kernels(plan)  # the same decisions (refit_for_kernels checked), their reasons for the new settings
        plan.reasons["compile_training" if plan.compile_training else "share_prompts"] += refit_note(searched, refit)
    else:
        # the estimate recounted for the training kernels (the search's figure sized the micro-batches): compiled
        # layers keep fewer activations; k/v heads stay grouped unless a kernel repeats them (shared prompts may)
        searched_memory = sharding.memory

        def recounted(kernels: TrainingKernels):
            return with_training_kernels(searched_memory, kernels.compiled_layers, kernels.kv_heads_repeated)

        sharding.memory = recounted(kernels)
        plan.estimate = sharding.memory.estimate
        if plan.share_prompts:
            shared = count_prompts_once(sharding.memory, plan.shared_prompt_kernel)
            budget = plan.memory_budget_bytes
            if budget and shared["peak_bytes"] > budget and auto_flag(cfg.hardware.share_prompts) is None:
                # its attention's buffers (the gathered keys of every row) do not fit beside the searched sizes
                plan.share_prompts = False
                reasons["share_prompts"] = (
                    f"off: with each prompt once the update would need {format_bytes(shared['peak_bytes'])}, more "
                    f"than the {format_bytes(budget)} budget (the shared attention's buffers); the rows stay packed")
                sharding.memory = recounted(decided_kernels())
                plan.estimate = sharding.memory.estimate
            else:
                packed, plan.estimate = searched, shared
                reasons["share_prompts"] += shared_prompts_note(packed, plan.estimate)
        plan.reasons["compile_training"] += (training_kernels_note(searched, plan.estimate)
                                             if plan.compile_training else "")
    plan.rollout.release_kv_between_phases, plan.rollout.reasons["release_kv_between_phases"] = decide_kv_release(
        plan, target, auto_flag(arr.rollout.free_cache_engine))
    plan_async_rollout(cfg, plan)  # trainer.async: overlapped, in turn or sync (async_plan.py)
    if cfg.reward_model.enable:  # one more model in the same memory: its phase, placement and micro-batch
        rm_plan, plan.estimate = plan_from_config(cfg, plan, plan.estimate, plan.memory_budget_bytes, target.is_cuda,
                                                  scores)
        plan.reward_model = rm_plan.to_dict()
        recheck_overlap_with_reward_model(cfg, plan, rm_plan)  # overlapped: it scores beside the update
    spare_core_for_rollout(plan, machine.cpu_cores, int(cfg.trainer.n_gpus_per_node), machine.cpu_physical_cores)
    if for_execution and card is not None and real is not None:
        check_real_card_runs(plan, real, machine)
    return plan


__all__ = ["make_plan", "plan_rollout_for", "sharded_gather_dtype", "PlanError", "NoFitError", "Decision",
           "MemoryPlan", "ShardingDecision", "Target", "DATA_PARALLEL_MODES", "DECODE_SPAN_GRANULARITY",
           "TRITON_DECODE_MIN_CC", "SHARED_PROMPT_MODEL_TYPES", "compile_min_steps", *_RUNTIME_NAMES]
