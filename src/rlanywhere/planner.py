"""The planner: every hardware decision for a run, made once, before any model loads, each with its reason.

    prepare_environment(cfg)        # first thing, before CUDA initialises (allocator settings)
    plan = make_plan(cfg)           # raises PlanError for impossible requests, before any model loads
    apply_runtime(plan)             # TF32 flags, memory cap when emulating
    with autocast_context(plan): ...

What the planner decides, and why (docs/hardware.md has the long form):
  * precision: bf16 autocast over fp32 master weights where the card has native bf16 (compute capability >= 8.0);
    fp16 autocast over fp32 master weights with dynamic loss scaling on Volta / Turing (fp16 tensor cores, no
    bf16) when the fp16 checks pass on the device (`machine.fp16_problems`), else fp32; fp32 on Pascal and on CPU;
  * attention: FlashAttention-2 when installed and usable, else SDPA (when one of its backends runs), else eager;
  * memory: the estimator's per-phase peaks against the card's memory decide gradient checkpointing, micro-batch
    sizes, offload and where the reference model lives;
  * rollout: the engine and everything it runs with (`RolloutPlan`: dtype, decode attention, weight fusion, fp32
    logits, CUDA graphs, rows per wave, KV release between phases); `plan_rollout_for` gives the same decisions
    to a bench that builds an engine without a config.
`--emulate CARD` plans for a card from `machine.CARDS` and, on a real GPU, caps the process to that card's memory.
The inputs come from machine.py (the probe, the card table) and model_shape.py; the result is a plans.Plan.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from . import estimator as est
from .machine import CardSpec, DeviceInfo, HardwareProbe, card_spec, fp16_problems, predicted_sdpa_backends, \
    probe_machine, sdpa_backends_that_run, triton_usable
from .model_shape import ModelShape, read_model_shape
from .rollout.multiturn import plan_multiturn
from .plans import Plan, RolloutPlan
from .prompt_sharing import MASKED, VARLEN, varlen_attention_function
from .vocabulary import (
    ALLOC_CONF, CUDNN_SDPA, ATTN_EAGER, ATTN_FLASH, ATTN_IMPLEMENTATIONS, ATTN_SDPA, BF16, FP16, FP32,
    LOSS_SCALE_GROWTH_INTERVAL,
    LOSS_SCALE_INIT, NoFitError, PlanError, cc_str, dtype_from_name, dtype_name, flash_attn_capable, has_fast_fp16,
    has_half_gemm_fp32_output, has_native_bf16, has_tf32, is_half, DECODE_HALF_MIN_ROWS, DECODE_MATMUL, DECODE_SDPA,
    DECODE_TRITON,
    AdvantageEstimator,
    AttnImplementation, Precision, RolloutEngineName,
)

log = logging.getLogger(__name__)


@dataclass
class _Target:
    """The hardware the decisions are for: the emulated card, the real GPU, or the CPU."""

    name: str
    cc: Optional[tuple[int, int]]
    memory_bytes: int
    is_cuda: bool
    emulated: Optional[str] = None
    live_device: Optional[str] = None  # set when this is real hardware a kernel can be tried on

    @property
    def bf16(self) -> bool:
        return has_native_bf16(self.cc)

    @property
    def fast_fp16(self) -> bool:
        return has_fast_fp16(self.cc)

    @property
    def tf32(self) -> bool:
        return has_tf32(self.cc)


def _auto(value: Any) -> Optional[bool]:
    """'auto' / None -> None; booleans and 'true'/'false' strings -> bool."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
        raise PlanError(f"expected auto, true or false, got {value!r}")
    return bool(value)


def _resolve_device(cfg: Any, machine: HardwareProbe, card: Optional[CardSpec], for_execution: bool,
                    reasons: dict[str, str]) -> tuple[str, Optional[DeviceInfo]]:
    requested = str(cfg.hardware.device or "auto").strip().lower()
    trainer_device = str(cfg.trainer.get("device", "auto") or "auto").strip().lower()
    if requested == "auto" and trainer_device == "cpu":
        requested = "cpu"
        reasons["device"] = "trainer.device=cpu"
    if requested == "cpu":
        if card is not None:
            if for_execution:
                raise PlanError(f"emulating the {card.name} caps a real GPU to its memory, but hardware.device=cpu. "
                                "Drop hardware.device=cpu (or the emulation) to run; `rlanywhere plan --emulate "
                                f"{card.key}` plans without running")
            reasons["device"] = f"planning only: the decisions are for the {card.name}"
        reasons.setdefault("device", "hardware.device=cpu")
        return "cpu", None
    if requested == "auto":
        if not machine.devices:
            if card is not None and for_execution:
                raise PlanError(f"--emulate {card.key} caps a real GPU to the {card.name}'s memory, and this machine "
                                f"has no CUDA device. Run `rlanywhere plan --emulate {card.key}` to plan without a "
                                "GPU, or drop the emulation to train on CPU")
            if card is not None:
                reasons["device"] = (f"planning only (no CUDA device here): the decisions are for the {card.name}")
            else:
                reasons["device"] = "no CUDA device visible: training on CPU"
            return "cpu", None
        index = _local_rank()
        reasons["device"] = (f"auto: this rank's GPU (LOCAL_RANK={index})" if "LOCAL_RANK" in os.environ
                             else "auto: first CUDA device")
        if index >= len(machine.devices):
            raise PlanError(f"rank with LOCAL_RANK={index} but only {len(machine.devices)} CUDA device(s) are visible: "
                            f"start at most {len(machine.devices)} processes per node (--nproc_per_node / "
                            "trainer.n_gpus_per_node)")
    else:
        match = re.fullmatch(r"cuda(?::(\d+))?", requested)
        if match is None:
            raise PlanError(f"hardware.device={requested!r} is not valid; use auto, cpu, cuda or cuda:N")
        index = int(match.group(1) or 0)
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            if match.group(1) is not None:
                raise PlanError(f"hardware.device={requested} under torchrun would put every rank on one GPU: use "
                                "hardware.device=cuda (or auto); each rank takes cuda:LOCAL_RANK")
            index = _local_rank()
        if not machine.devices:
            if card is not None and not for_execution:
                reasons["device"] = f"planning only (no CUDA device here): the decisions are for the {card.name}"
                return "cpu", None
            raise PlanError(f"hardware.device={requested} but no CUDA device is visible (torch.cuda.is_available() "
                            "is False). Use hardware.device=cpu (or auto)")
        if index >= len(machine.devices):
            raise PlanError(f"hardware.device={requested} but only {len(machine.devices)} CUDA device(s) are visible; "
                            f"use cuda:0..cuda:{len(machine.devices) - 1}")
        reasons["device"] = f"hardware.device={requested}"
    return f"cuda:{index}", machine.devices[index]


def _make_target(card: Optional[CardSpec], real: Optional[DeviceInfo], device: str, machine: HardwareProbe) -> _Target:
    if card is not None:
        return _Target(card.name, card.compute_capability, card.memory_bytes, True, emulated=card.key)
    if real is not None:
        return _Target(real.name, tuple(real.compute_capability), real.total_memory_bytes, True,
                       live_device=device if machine.live else None)
    return _Target(f"CPU ({machine.cpu_cores} cores)", None, machine.ram_available_bytes or machine.ram_total_bytes,
                   False, live_device="cpu" if machine.live else None)


@dataclass
class _Precision:
    name: str
    param: torch.dtype
    compute: torch.dtype
    autocast: bool
    scaler: bool


@dataclass
class _Fp16Checks:
    """What is known about fp16 on the device that will run the plan."""

    problems: Optional[list[str]]  # None: nothing could be run (planning without a GPU, a hand-made probe)
    where: str  # the device they ran on, or why they did not run


def _fp16_checks(target: _Target, real: Optional[DeviceInfo], device: str, machine: HardwareProbe) -> _Fp16Checks:
    if real is None:
        return _Fp16Checks(None, "planning without a GPU")
    problems = real.fp16_problems
    if problems is None and machine.live:
        problems = real.fp16_problems = fp16_problems(device)
    if problems is None:
        return _Fp16Checks(None, "a probe not taken on this machine")
    where = f"{device} ({real.name}" + (f", standing in for the {target.name})" if target.emulated else ")")
    return _Fp16Checks(problems, where)


def _decide_precision(requested: str, target: _Target, fp16: _Fp16Checks, reasons: dict[str, str]) -> _Precision:
    cc = cc_str(target.cc)
    fp32 = _Precision(Precision.FP32.value, FP32, FP32, False, False)
    fp16_mixed = _Precision(Precision.FP16.value, FP32, FP16, True, True)
    mixed = "fp16 autocast over fp32 master weights, dynamic loss scaling"
    if requested == Precision.AUTO:
        if not target.is_cuda:
            reasons["precision"] = "fp32: CPU (hardware.precision=bf16 opts in to bf16 autocast on CPU)"
            return fp32
        if target.bf16:
            reasons["precision"] = f"bf16 autocast over fp32 master weights: compute capability {cc} has native bf16"
            return _Precision(Precision.BF16.value, FP32, BF16, True, False)
        if not target.fast_fp16:
            reasons["precision"] = (f"fp32: compute capability {cc} has no bf16 and no fp16 tensor cores (fp16 "
                                    "would not be faster)")
            return fp32
        why = f"compute capability {cc} has fp16 tensor cores and no bf16"
        if fp16.problems is None:
            reasons["precision"] = (f"{mixed}: {why} (fp16 checks not run: {fp16.where}; `rlanywhere doctor` "
                                    "runs them on the card)")
            return fp16_mixed
        if not fp16.problems:
            reasons["precision"] = f"{mixed}: {why}; the fp16 checks passed on {fp16.where}"
            return fp16_mixed
        reasons["precision"] = (f"fp32: {why}, but the fp16 checks failed on {fp16.where}: "
                                f"{'; '.join(fp16.problems)}")
        log.warning("precision: fp32 instead of fp16 - the fp16 checks failed on %s: %s", fp16.where,
                    "; ".join(fp16.problems))
        return fp32
    if requested == Precision.FP32:
        reasons["precision"] = "fp32: hardware.precision=fp32"
        return fp32
    if requested == Precision.BF16:
        if target.is_cuda and not target.bf16:
            alt = " (or fp16, which this card runs on tensor cores)" if target.fast_fp16 else ""
            raise PlanError(f"hardware.precision=bf16: bf16 needs compute capability >= 8.0; the {target.name} has "
                            f"{cc}. Use hardware.precision=fp32 (or auto){alt}")
        where = "CPU (slow without AVX512-BF16/AMX)" if not target.is_cuda else f"compute capability {cc}"
        reasons["precision"] = f"bf16 autocast over fp32 master weights: hardware.precision=bf16 on {where}"
        return _Precision(Precision.BF16.value, FP32, BF16, True, False)
    if requested == Precision.FP16:
        if not target.is_cuda:
            raise PlanError("hardware.precision=fp16 is not supported on CPU. Use hardware.precision=fp32 (or bf16)")
        if fp16.problems:
            raise PlanError(f"hardware.precision=fp16: the fp16 checks failed on {fp16.where}: "
                            f"{'; '.join(fp16.problems)}. Use hardware.precision=fp32 (or auto)")
        slow = "" if target.fast_fp16 else f"; compute capability {cc} has no fp16 tensor cores, so it is not faster"
        reasons["precision"] = f"{mixed}: hardware.precision=fp16{slow}"
        return fp16_mixed
    raise PlanError(f"hardware.precision={requested!r} is not valid; use auto, fp32, bf16 or fp16")


def _decide_rollout_dtype(requested: str, precision: _Precision, target: _Target, reasons: dict[str, str]
                          ) -> torch.dtype:
    if str(requested).strip().lower() in ("auto", "", "none"):
        reasons["rollout_dtype"] = "the compute dtype"
        return precision.compute
    try:
        wanted = dtype_from_name(requested)
    except ValueError as exc:
        raise PlanError(f"actor_rollout_ref.rollout.dtype={requested!r}: {exc}") from exc
    unsupported = (target.is_cuda and wanted == BF16 and not target.bf16) or (not target.is_cuda and wanted == FP16)
    if unsupported:
        # verl sets rollout.dtype=bfloat16 by default, so this is a default to adapt, not a hard request
        reasons["rollout_dtype"] = (f"actor_rollout_ref.rollout.dtype={requested} overridden: the {target.name} "
                                    f"cannot run it; rolling out in {dtype_name(precision.compute)}")
        return precision.compute
    reasons["rollout_dtype"] = f"actor_rollout_ref.rollout.dtype={requested}"
    return wanted


def _sdpa_backends(target: _Target, dtype: torch.dtype, head_dim: int) -> list[str]:
    if target.live_device is not None:
        return sdpa_backends_that_run(dtype, head_dim, target.live_device)
    return predicted_sdpa_backends(target.cc, dtype, head_dim)


def _decide_attention(requested: str, machine: HardwareProbe, target: _Target, compute: torch.dtype, head_dim: int,
                      reasons: dict[str, str]) -> tuple[str, list[str]]:
    cc = cc_str(target.cc)
    if not target.is_cuda:
        flash_problem = "FlashAttention-2 needs a CUDA GPU"
    elif not flash_attn_capable(target.cc):
        flash_problem = f"FlashAttention-2 needs compute capability >= 8.0; the {target.name} has {cc}"
    elif not machine.flash_attn_installed:
        flash_problem = "flash_attn is not installed (pip install flash-attn --no-build-isolation)"
    elif not is_half(compute):
        flash_problem = (f"FlashAttention-2 runs only in bf16/fp16, and the plan computes in {dtype_name(compute)} "
                         "(set hardware.precision=bf16)")
    else:
        flash_problem = None
    backends = _sdpa_backends(target, compute, head_dim)
    backends_text = f"SDPA backends that run for {dtype_name(compute)}, head dim {head_dim}: {', '.join(backends)}"
    if requested == AttnImplementation.AUTO:
        if flash_problem is None:
            reasons["attn_implementation"] = "auto: flash_attn is installed and usable on this card"
            return ATTN_FLASH, backends
        if backends:
            reasons["attn_implementation"] = f"auto: {flash_problem}; {backends_text}"
            return ATTN_SDPA, backends
        reasons["attn_implementation"] = f"auto: {flash_problem}; no SDPA backend runs here"
        return ATTN_EAGER, backends
    if requested == ATTN_FLASH:
        if flash_problem is not None:
            raise PlanError(f"hardware.attn_implementation={ATTN_FLASH}: {flash_problem}. "
                            f"Use hardware.attn_implementation={ATTN_SDPA} (or auto)")
        reasons["attn_implementation"] = f"hardware.attn_implementation={ATTN_FLASH}"
        return ATTN_FLASH, backends
    if requested == ATTN_SDPA:
        if not backends:
            raise PlanError(f"hardware.attn_implementation=sdpa: no SDPA backend runs for {dtype_name(compute)} "
                            f"with head dim {head_dim} here. Use hardware.attn_implementation={ATTN_EAGER} (or auto)")
        reasons["attn_implementation"] = f"hardware.attn_implementation=sdpa; {backends_text}"
        return ATTN_SDPA, backends
    if requested == ATTN_EAGER:
        reasons["attn_implementation"] = "hardware.attn_implementation=eager"
        return ATTN_EAGER, backends
    raise PlanError(f"hardware.attn_implementation={requested!r} is not valid; use auto, "
                    f"{', '.join(ATTN_IMPLEMENTATIONS)}")


def _per_device(value: Optional[int], world: int) -> Optional[int]:
    return None if value is None else max(1, int(value) // world)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def make_plan(cfg: Any, machine: Optional[HardwareProbe] = None, *, for_execution: bool = True,
              emulate: Optional[str] = None, model_shape: Optional[ModelShape] = None,
              critic_shape: Optional[ModelShape] = None) -> Plan:
    """Decide everything hardware-related for `cfg` on `machine` (probed now when None) or an emulated card.

    for_execution=False (the `plan` command) allows planning for an emulated card on a machine without CUDA;
    the plan's device is then "cpu" and the decisions are for the card. Raises PlanError / NoFitError."""
    machine = machine if machine is not None else probe_machine()
    hcfg = cfg.hardware
    arr = cfg.actor_rollout_ref
    reasons: dict[str, str] = {}
    emulate_name = emulate or hcfg.emulate
    card = card_spec(emulate_name) if emulate_name else None
    device, real = _resolve_device(cfg, machine, card, for_execution, reasons)
    target = _make_target(card, real, device, machine)
    if card is not None:
        reasons["card"] = (f"emulated: cc {cc_str(card.compute_capability)}, {card.memory_gib} GiB"
                           + (f" on the real {real.name}" if real is not None else ""))
    elif real is not None:
        reasons["card"] = f"probed: cc {cc_str(real.compute_capability)}"
    else:
        reasons["card"] = f"RAM {est.format_bytes(target.memory_bytes)} available"

    shape = model_shape or read_model_shape(arr.model.path, arr.model.get("gguf_file"))
    if critic_shape is None and cfg.critic.model.path and cfg.critic.model.path != arr.model.path:
        critic_shape = read_model_shape(cfg.critic.model.path)

    precision = _decide_precision(str(hcfg.precision), target, _fp16_checks(target, real, device, machine), reasons)
    rollout_dtype = _decide_rollout_dtype(str(arr.rollout.get("dtype", "auto")), precision, target, reasons)
    allow_tf32 = target.is_cuda and target.tf32
    reasons["allow_tf32"] = (f"compute capability {cc_str(target.cc)} has TF32 for fp32 matmuls" if allow_tf32 else
                             "CPU" if not target.is_cuda else f"compute capability {cc_str(target.cc)} has no TF32")
    attn, backends = _decide_attention(str(hcfg.attn_implementation), machine, target, precision.compute,
                                       shape.head_dim, reasons)
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
    use_critic = cfg.algorithm.adv_estimator == AdvantageEstimator.GAE
    reasons["use_critic"] = ("adv_estimator=gae needs a value model" if use_critic else
                             f"adv_estimator={cfg.algorithm.adv_estimator} needs no value model")
    kl_loss = bool(actor.use_kl_loss) and float(actor.kl_loss_coef) > 0
    kl_reward = bool(cfg.algorithm.use_kl_in_reward) and float(cfg.algorithm.kl_ctrl.kl_coef) > 0
    use_ref = kl_loss or kl_reward
    use_lora = int(arr.model.lora_rank) > 0
    critic_lora = int(cfg.critic.model.lora_rank) if use_critic else 0
    reasons["use_lora"] = (f"actor_rollout_ref.model.lora_rank={arr.model.lora_rank}" if use_lora
                           else "full fine-tuning (lora_rank=0)")

    # memory
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
    scores = attn == ATTN_EAGER or (attn == ATTN_SDPA and set(backends) <= {"math"})
    # [distributed] several ranks: replicate when a full replica fits each, else shard (distributed.plan_sharding)
    from .distributed import plan_sharding
    # host RAM holds what a GPU plan offloads; known when the GPUs are this machine's (not a plan for another one)
    host_ram = machine.ram_available_bytes if real is not None and machine.ram_available_bytes else None
    kept: Optional[_MemoryInputs] = None  # the inputs of the memory plan that was kept (the last one made)

    def plan_memory(shard_world: int) -> None:
        nonlocal kept
        kept = _plan_memory(cfg, plan, target, shape, critic_shape, scores, critic_lora, use_ref and not use_lora,
                            reasons, shard_world=shard_world, host_ram_bytes=host_ram)

    plan_sharding(cfg, plan, plan_memory)
    _ref_reason(plan, use_ref, use_lora, kl_loss, kl_reward, reasons)
    _memory_cap(plan, card, real, for_execution, reasons)
    _plan_data_parallel(cfg, plan, machine, for_execution, reasons)
    _plan_rollout(cfg, plan, target, shape, machine)
    _plan_training_kernels(plan, backends, target.is_cuda)
    _plan_training_compile(plan, bool(actor.use_torch_compile), target.is_cuda, target.cc, machine.triton_usable)
    _plan_prompt_sharing(plan, _auto(cfg.hardware.share_prompts), int(arr.rollout.n), shape.model_type,
                         flash_runs=target.is_cuda and "flash_attention" in backends)
    if plan.share_prompts:
        _count_prompts_once(plan, kept)
    _plan_kv_release(plan, target, _auto(arr.rollout.free_cache_engine))
    if for_execution and card is not None and real is not None:
        _check_real_card_runs(plan, real, machine)
    return plan


@dataclass
class _MemoryInputs:
    """What a memory plan was estimated from, to estimate it again once later decisions are known."""

    shape: ModelShape
    workload: est.Workload
    placement: est.Placement
    critic_shape: Optional[ModelShape]
    budget: int


def _plan_memory(cfg: Any, plan: Plan, target: _Target, shape: ModelShape, critic_shape: Optional[ModelShape],
                 scores_materialized: bool, critic_lora: int, separate_ref: bool, reasons: dict[str, str],
                 shard_world: int = 1, host_ram_bytes: Optional[int] = None) -> _MemoryInputs:
    hcfg = cfg.hardware
    arr = cfg.actor_rollout_ref
    actor, critic = arr.actor, cfg.critic
    per_node = max(1, int(cfg.trainer.n_gpus_per_node))  # processes on this machine, sharing its RAM
    world = max(1, int(cfg.trainer.nnodes) * per_node)
    n = int(arr.rollout.n)
    prompts = int(cfg.data.train_batch_size)
    mini = min(int(actor.ppo_mini_batch_size), prompts)
    critic_mini = min(int(critic.ppo_mini_batch_size or mini), prompts)
    if hcfg.memory_budget_gib:
        device_bytes = int(float(hcfg.memory_budget_gib) * est.GIB)
        source = f"hardware.memory_budget_gib={hcfg.memory_budget_gib}"
    elif not target.is_cuda and per_node > 1:  # [distributed] CPU processes on one machine share its RAM
        device_bytes = target.memory_bytes // per_node
        source = (f"{target.name} {est.format_bytes(target.memory_bytes)} shared by {per_node} processes: "
                  f"{est.format_bytes(device_bytes)} each")
    else:
        device_bytes = target.memory_bytes
        source = f"{target.name}{' (emulated)' if target.emulated else ''} {est.format_bytes(device_bytes)}"
    budget = est.memory_budget_bytes(device_bytes, target.is_cuda)
    plan.memory_budget_bytes = budget
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
        rollout_layout_copies=_fp32_gemm_layouts(plan.rollout.dtype or plan.param_dtype, target.is_cuda, target.cc,
                                                 plan.rollout.engine, shape, budget)[0],
        # [distributed] FSDP2 sharding: weights/grads/Adam divided by the ranks, gathered weights counted
        shard_world=shard_world, gather_dtype=sharded_gather_dtype(plan) if shard_world > 1 else None)

    fixed: dict[str, Any] = {
        "gradient_checkpointing": _auto(arr.model.enable_gradient_checkpointing),
        "optimizer_offload": _auto(hcfg.optimizer_offload),
        "param_offload": _auto(hcfg.param_offload),
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
    if shard_world > 1:  # [distributed] FSDP2 offloads with its CPUOffloadPolicy only; a sharded ref stays on device
        fixed.update(optimizer_offload=False, ref_on_device=True, param_offload=bool(fixed["param_offload"]))
    chunk = int(hcfg.logprob_chunk_size or 0) or None
    fit = est.fit_settings(shape, workload, budget, fixed, critic_shape, logprob_chunk_size=chunk)
    if fit is None:
        label = f" ({source})" if world == 1 else (  # [distributed]
            f" ({source} per rank; the models sharded over the {world} ranks)" if shard_world > 1 else
            f" ({source} per rank; each of the {world} ranks holds the full models)")
        raise NoFitError(est.explain_no_fit(shape, workload, budget, fixed, critic_shape, label))
    placement, estimate = fit.placement, fit.estimate
    reasons.pop("host_memory", None)  # [distributed] from an earlier attempt (replicated, then sharded)
    if host_ram_bytes and target.is_cuda:
        _check_host_memory(est.host_offload_bytes(shape, workload, placement, critic_shape), per_node,
                           host_ram_bytes, reasons)
    plan.estimate = estimate
    plan.gradient_checkpointing = placement.gradient_checkpointing
    plan.optimizer_offload = placement.optimizer_offload and target.is_cuda
    plan.param_offload = placement.param_offload and target.is_cuda
    plan.sizes.actor_micro_batch_size = placement.actor_micro_batch
    plan.sizes.critic_micro_batch_size = placement.critic_micro_batch if plan.use_critic else None
    plan.sizes.logprob_micro_batch_size = placement.logprob_micro_batch
    plan.sizes.max_token_len_per_micro_batch = placement.max_token_len
    plan.logprob_chunk_size = placement.logprob_chunk_size
    plan.sizes.rollout_batch_size = placement.rollout_batch
    # planning-only runs (emulated card, no GPU here) still name the card's device for what lives on it
    on_device = plan.device if (plan.device != "cpu" or not target.is_cuda) else "cuda:0"
    plan.ref_device = (on_device if placement.ref_on_device else "cpu") if separate_ref else "none"
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
                   f"cap while the peak stays under {est.ROOMY_PEAK_FRACTION:.0%} of the budget (fewer kernel launches)")
        else:
            how = cap_why if value == cap else "the largest power of two that fits"
        return f"{value} sequences x {seq} tokens: {how} ({peak_text(*phase_names)})"

    for key in ("gradient_checkpointing", "optimizer_offload", "param_offload"):
        if key not in reasons:
            note = fit.notes.get(key, "")
            explicit = {"gradient_checkpointing": "actor_rollout_ref.model.enable_gradient_checkpointing",
                        "optimizer_offload": "hardware.optimizer_offload", "param_offload": "hardware.param_offload"}
            reasons[key] = (f"{explicit[key]}={getattr(plan, key)}" if note == "explicit" else
                            f"{'on' if getattr(plan, key) else 'off'}: {note}")
    sized_by_config = [key for key in ("actor_micro_batch", "critic_micro_batch", "logprob_micro_batch")
                       if fixed.get(key) is not None]
    plan.merge_micro_batches = not workload.use_dynamic_bsz and not sized_by_config
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
    return _MemoryInputs(shape, workload, placement, critic_shape, budget)


def _count_prompts_once(plan: Plan, memory: _MemoryInputs) -> None:
    """Shared prompts: estimate the chosen settings again with each distinct prompt counted once per micro-batch.
    The settings were searched with packed rows (sharing is decided after them, from checkpointing and compiling),
    a bound that holds either way; the recount is what the run will hold, for the KV-cache decision and the
    reported peaks."""
    packed = plan.estimate or {}
    plan.estimate = est.estimate_memory(memory.shape, replace(memory.workload, share_prompts=True), memory.placement,
                                        memory.critic_shape, memory.budget)
    if packed.get("peak_bytes"):
        plan.reasons["share_prompts"] += (f"; planned peak {est.format_bytes(plan.estimate['peak_bytes'])} with each "
                                          f"prompt once ({est.format_bytes(packed['peak_bytes'])} as packed rows, "
                                          "which sized the micro-batches)")


def _plan_kv_release(plan: Plan, target: _Target, requested: Optional[bool]) -> None:
    """Whether the rollout's KV cache is freed after each rollout (verl: actor_rollout_ref.rollout.free_cache_engine).
    The estimator counts the cache in the rollout phase only; kept, it also sits beside the log-prob and update
    phases. It stays when it fits there: a freed cache is allocated again every step and the decode step's CUDA
    graphs, which point into it, are captured again (0.45 s a step in a bf16 run on an H200, estimator.py). Should
    the training phases still run out of memory, the OOM guard frees it first (Trainer)."""
    rollout = plan.rollout
    estimate = plan.estimate or {}
    phases, budget = estimate.get("phases", {}), plan.memory_budget_bytes or 0
    training = max((v for k, v in phases.items() if k != "rollout"), default=0)
    cache = estimate.get("breakdown", {}).get("rollout", {}).get("kv_cache", 0)
    fits = training + cache <= budget
    sizes = (f"the training phases' planned peak {est.format_bytes(training)} + the {est.format_bytes(cache)} cache "
             f"{'fit' if fits else 'exceed'} the {est.format_bytes(budget)} budget"
             + (f" of the {target.name}" if target.emulated else ""))
    if not target.is_cuda:
        rollout.release_kv_between_phases, why = False, "CPU: memory is not the limit"
    elif requested is not None:
        rollout.release_kv_between_phases = requested
        why = f"actor_rollout_ref.rollout.free_cache_engine={requested}" + (
            f" ({sizes}: auto would keep it and save reallocating it and capturing the CUDA graphs every step)"
            if requested and fits else f" ({sizes})" if not requested and not fits else "")
    else:
        rollout.release_kv_between_phases = not fits
        why = f"{'kept' if fits else 'freed'}: {sizes}"
    rollout.reasons["release_kv_between_phases"] = why


# FastEngine's split-K Triton decode attention (rollout/decode_attention.py) is planned from this compute capability
# up (measured on an H200 only; Volta/Turing untested, Pascal has no fast half math): in half precision, and in fp32
# with its products as three TF32 products (TF32 tensor cores start at 8.0 too).
TRITON_DECODE_MIN_CC = (8, 0)
TRITON_DECODE_REASON = ("split-K Triton kernel over each row's filled cache slots: 1.4-1.8x faster per layer than "
                        "SDPA's fused kernel on an H200 (bench/decode_profile.py), which gives each (row, KV head) "
                        "one program and reads the left padding too")


TRITON_FP32_DECODE_REASON = ("split-K Triton kernel with its fp32 products on TF32 tensor cores (attention_tf32x3): "
                             "2x faster per layer than batched GEMMs on an H200 (384 slots: 23.7 vs 48.0 us at 128 "
                             "rows, 14.2 vs 26.7 at 64), and as close to an fp64 reference")
TF32X3_REASON = ("the fp32 decode attention's products as three TF32 tensor-core products each (x = big + small, "
                 "both TF32; big*big + big*small + small*big summed in fp32): 1.7e-6 from an fp64 reference where "
                 "exact FMA products are 1.9-2.3e-6 and batched GEMMs 2.2e-6, in about half the FMA kernel's time "
                 "on an H200 (128 rows, 384 slots: 23.7 vs 46.3 us per layer at its best launch)")

FUSED_SAMPLING_GAIN = "one pass instead of ~9 kernels over the fp32 logits"


def _triton_decode_refusal(triton: bool, cc: Optional[tuple[int, int]], engine: str) -> str:
    """Why FastEngine's Triton kernels are not planned on this CUDA target (half precision)."""
    if engine != RolloutEngineName.FAST:
        return f"the {engine} engine runs none of FastEngine's kernels"
    if not triton:
        return "triton is not installed, or no C compiler to build its kernels' launcher"
    return (f"compute capability {cc_str(cc) if cc else 'unknown'} < {cc_str(TRITON_DECODE_MIN_CC)} (not measured "
            "there)")


def _fp32_gemm_layouts(dtype: Optional[torch.dtype], on_cuda: bool, cc: Optional[tuple[int, int]], engine: str,
                       shape: Optional[ModelShape], budget_bytes: Optional[int]) -> tuple[bool, str]:
    """(RolloutPlan.fp32_gemm_layouts, its reason): fp32 decode GEMMs in the layouts cuBLAS runs fastest at 64-128
    rows, measured on an H200 (fp32 without TF32, inside the step's CUDA graph, Qwen2.5-0.5B shape): o_proj from an
    [in, out] copy (64 rows: 3.220 -> 3.181 ms), down as W @ x^T (-> 3.207), the LM head from an [in, out] copy
    (-> 3.192; 128 rows: 5.029 -> 4.920); all three 3.131 ms at 64 rows and 4.824 at 128. cuBLAS only, no Triton."""
    if engine != RolloutEngineName.FAST:
        return False, f"off: the {engine} engine"
    if not on_cuda:
        return False, "off: CPU"
    if dtype != FP32:
        return False, f"off: {dtype_name(dtype) if dtype is not None else 'the model dtype'} (measured in fp32 only)"
    if cc is None or cc < TRITON_DECODE_MIN_CC:
        return False, (f"off: compute capability {cc_str(cc) if cc else 'unknown'} < {cc_str(TRITON_DECODE_MIN_CC)} "
                       "(measured on an H200 only)")
    if shape is None or budget_bytes is None:
        return False, "off: no model shape or memory budget to size the copies against"
    copy = est.layout_copy_bytes(shape, dtype)
    within = copy <= est.FUSED_COPY_BUDGET_FRACTION * budget_bytes
    return within, (
        f"{'on' if within else 'off'}: fp32 decode GEMMs in the layouts cuBLAS runs fastest at 64-128 rows: o_proj "
        "and the LM head from [in, out] copies (x @ W), down as W @ x^T; the copies take "
        f"{est.format_bytes(copy)}, {'within' if within else 'over'} {est.FUSED_COPY_BUDGET_FRACTION:.0%} of the "
        f"{est.format_bytes(budget_bytes)} budget" + (" (H200, fp32: 64-row steps 3.22 -> 3.13 ms, 128-row 5.03 -> "
                                                      "4.82)" if within else ""))


# Decode attention on a GPU reads the cache up to the next multiple of this many slots. Attention time grows with
# the slots read (bench/decode_profile.py: 25 us/layer at 256 slots, 40 at 512, bf16, 256 rows); finer spans read
# fewer empty slots at the price of more CUDA graphs (one per rows bucket and span, captured once).
DECODE_SPAN_GRANULARITY = 64


def _rollout_policy(rollout: RolloutPlan, *, weight_dtype: Optional[torch.dtype], on_cuda: bool, torch_version: str,
                    shape: Optional[ModelShape], budget_bytes: Optional[int], cc: Optional[tuple[int, int]] = None,
                    triton: bool = False) -> None:
    """The rollout engine's kernels and weight copies for `rollout.dtype` on this device; fills `rollout` and its
    reasons. Shared by make_plan (a run) and plan_rollout_for (a bench without a config). cc: the compute
    capability the plan is for (an emulated card's); triton: whether Triton kernels can be built here."""
    reasons = rollout.reasons
    dtype = rollout.dtype if rollout.dtype is not None else weight_dtype
    half = dtype is not None and is_half(dtype)
    dtype_text = dtype_name(dtype) if dtype is not None else "the model's dtype"
    # FastEngine's Triton kernels run here (measured on an H200); the attention in half precision only, the
    # compiled elementwise ops, fused KV write and sampler in any dtype
    triton_runs = (on_cuda and triton and cc is not None and cc >= TRITON_DECODE_MIN_CC
                   and rollout.engine == RolloutEngineName.FAST)
    if half and triton_runs:
        rollout.decode_attention = DECODE_TRITON
        reasons["decode_attention"] = f"{dtype_text}: {TRITON_DECODE_REASON}"
    elif triton_runs:
        rollout.decode_attention = DECODE_TRITON
        reasons["decode_attention"] = f"{dtype_text}: {TRITON_FP32_DECODE_REASON}"
    elif half:
        rollout.decode_attention = DECODE_SDPA
        reasons["decode_attention"] = f"{dtype_text}: SDPA keeps the scores in fp32 inside the kernel" + (
            "" if not on_cuda else f" (Triton's split-K kernel: {_triton_decode_refusal(triton, cc, rollout.engine)})")
    else:
        rollout.decode_attention = DECODE_MATMUL
        refusal = _triton_decode_refusal(triton, cc, rollout.engine)
        refusal = f"; Triton's split-K kernel: {refusal}" if on_cuda else ""
        reasons["decode_attention"] = (f"{dtype_text}: batched GEMMs beat SDPA's fused kernels for a decode step's few "
                                       f"queries (2x on an H200){refusal}")
    # the fp32 Triton attention's products on TF32 tensor cores, three per product: as close to an fp64 reference
    # as exact FMA products, in half the time (bench numbers in TF32X3_REASON)
    rollout.attention_tf32x3 = rollout.decode_attention == DECODE_TRITON and not half
    reasons["attention_tf32x3"] = (
        f"on: {TF32X3_REASON}" if rollout.attention_tf32x3 else
        "off: half-precision attention runs on the tensor cores as it is" if half else
        f"off: {dtype_text} decode attention runs as {rollout.decode_attention}, not the Triton kernel")
    rollout.match_hf_numerics = True
    reasons["match_hf_numerics"] = (
        "round like transformers in RMSNorm, RoPE and residual adds: sampling log-probs stay ~1e-4 from the "
        "trainer's in half precision" if half else f"on (no effect in {dtype_text}: rounds the same either way)")
    fp32_output_gemm = has_half_gemm_fp32_output(torch_version, on_cuda)
    rollout.fp32_logits = not (half and on_cuda and not fp32_output_gemm)
    reasons["fp32_logits"] = (
        f"logits already fp32 in {dtype_text}" if not half else
        f"fp32 LM-head output as the trainer computes log-probs (torch {torch_version}: one half-in/fp32-out GEMM)"
        if fp32_output_gemm else "fp32 LM-head output (CPU: the inputs are upcast)" if not on_cuda else
        f"off: torch {torch_version} has no torch.mm(..., out_dtype=) (>= 2.8), and an fp32 copy of the LM head every "
        "step would cost more than it gains")
    rollout.cuda_graphs = on_cuda and rollout.engine == RolloutEngineName.FAST
    reasons["cuda_graphs"] = ("CUDA: one graph per decode step shape" if rollout.cuda_graphs else
                              "CPU: no CUDA graphs" if not on_cuda else f"the {rollout.engine} engine captures none")
    if rollout.engine != RolloutEngineName.FAST:
        rollout.fuse_weights = False
        reasons["fuse_weights"] = f"the {rollout.engine} engine keeps no weight copies"
    elif weight_dtype is not None and dtype != weight_dtype:
        rollout.fuse_weights = True
        reasons["fuse_weights"] = (f"free: rollouts in {dtype_text} keep a cast copy of the {dtype_name(weight_dtype)} "
                                   "weights anyway, stored fused (fewer, larger GEMMs)")
    elif not on_cuda:
        rollout.fuse_weights = False
        reasons["fuse_weights"] = "CPU: the weights are used in place (a fused copy would double them)"
    elif shape is None or budget_bytes is None or dtype is None:
        rollout.fuse_weights = False
        reasons["fuse_weights"] = "off: no model shape or memory budget to size the copy against"
    else:
        copy = est.fused_copy_bytes(shape, dtype)
        limit = est.FUSED_COPY_BUDGET_FRACTION * budget_bytes
        rollout.fuse_weights = copy <= limit
        reasons["fuse_weights"] = (
            f"{'on' if rollout.fuse_weights else 'off'}: the fused QKV and gate/up copy takes "
            f"{est.format_bytes(copy)}, {'within' if rollout.fuse_weights else 'over'} "
            f"{est.FUSED_COPY_BUDGET_FRACTION:.0%} of the {est.format_bytes(budget_bytes)} budget"
            + (" (~10% faster decode steps)" if rollout.fuse_weights else ""))
    rollout.transpose_gate_up = True
    reasons["transpose_gate_up"] = "fused gate/up stored [hidden, 2 x intermediate]: faster for 64-256 decode rows"
    reasons.setdefault("prefill_tokens_per_chunk", f"{rollout.prefill_tokens_per_chunk} padded prompt tokens per "
                                                   "prefill forward bound its activations")
    reasons.setdefault("check_every", f"every {rollout.check_every} decode steps: finished rows and stop strings")
    rollout.span_granularity = DECODE_SPAN_GRANULARITY if on_cuda else 256
    # the compiled elementwise kernels and the fused RoPE + K/V write pay in fp32 too (H200, 128 rows, fp32 without
    # TF32: 6.54 -> 6.01 ms per step); only the attention kernel stays half-precision only
    rollout.compile_elementwise = triton_runs
    reasons["compile_elementwise"] = (
        "on: the decode step's norms, RoPE, SiLU*mul and residual adds as fused torch.compile kernels, eager's "
        "rounding kept: 14% shorter bf16 decode steps and 8% shorter fp32 ones (with the fused K/V write) on an "
        "H200 (a few seconds of compilation once)"
        if rollout.compile_elementwise else
        "off: CPU (no CUDA graphs to save launches from)" if not on_cuda else
        f"off: {_triton_decode_refusal(triton, cc, rollout.engine)}")
    rollout.fused_kv_write = triton_runs
    reasons["fused_kv_write"] = (
        "on: the decode step's RoPE and K/V cache writes as one Triton kernel per layer instead of three (models "
        "with fused QKV weights and no q/k norms; others keep the separate kernels)" if rollout.fused_kv_write else
        "off: CPU" if not on_cuda else
        f"off: {_triton_decode_refusal(triton, cc, rollout.engine)}")
    # cuBLASLt's bias epilogue picks a 2x slower fp32 GEMM at decode shapes; bf16 and training shapes are unaffected
    rollout.qkv_bias_apart = on_cuda and not half and rollout.engine == RolloutEngineName.FAST
    reasons["qkv_bias_apart"] = (
        f"on: {dtype_text} decode steps add the q/k/v biases after their GEMM (inside the RoPE kernel where it "
        "runs): with the bias in cuBLASLt's epilogue the fp32 QKV GEMM takes 30.7 instead of 14.6 us at 128 rows "
        "on an H200 (the same sum in fp32)" if rollout.qkv_bias_apart else
        "off: CPU" if not on_cuda else
        f"off: the {rollout.engine} engine" if rollout.engine != RolloutEngineName.FAST else
        f"off: {dtype_text} (the bias epilogue costs nothing there, and adding it apart would round twice)")
    # two halves of a decode step on two streams: measured on an H200 in fp32 only (128 rows: 5.83 -> 5.48 ms);
    # slower in bf16 (256 rows: 104k -> 99k tok/s) and with 32-row halves, so fp32 on cards of that class
    rollout.decode_halves = (on_cuda and not half and cc is not None and cc >= TRITON_DECODE_MIN_CC
                             and rollout.engine == RolloutEngineName.FAST)
    reasons["decode_halves"] = (
        f"on: {dtype_text} decode steps of >= {2 * DECODE_HALF_MIN_ROWS} rows as two halves on two CUDA streams, one "
        "half's attention and norms beside the other's GEMMs (H200, 128 rows: 6% shorter steps)"
        if rollout.decode_halves else
        "off: CPU" if not on_cuda else
        f"off: the {rollout.engine} engine" if rollout.engine != RolloutEngineName.FAST else
        f"off: {dtype_text} (measured slower in half precision: its GEMMs already fill the GPU)" if half else
        f"off: compute capability {cc_str(cc) if cc else 'unknown'} < {cc_str(TRITON_DECODE_MIN_CC)} (measured on "
        "an H200 only)")
    rollout.fp32_gemm_layouts, reasons["fp32_gemm_layouts"] = _fp32_gemm_layouts(
        dtype, on_cuda, cc, rollout.engine, shape, budget_bytes)
    rollout.fused_sampling = triton_runs  # the sampler does not depend on the model's dtype
    reasons["fused_sampling"] = (
        f"on: each decode step samples in one Triton pass over its logits inside the step's CUDA graph "
        f"({FUSED_SAMPLING_GAIN}); requests with top-k or top-p use the torch sampler" if rollout.fused_sampling else
        "off: CPU (the torch sampler)" if not on_cuda else
        f"off: {_triton_decode_refusal(triton, cc, rollout.engine)}")
    reasons["span_granularity"] = (
        f"decode attention reads the cache up to the next multiple of {rollout.span_granularity} slots: "
        + ("a CUDA graph per (rows, span) bucket is cheap, reading empty slots is not" if on_cuda else
           "CPU: few distinct shapes"))


def _plan_rollout(cfg: Any, plan: Plan, target: _Target, shape: ModelShape, machine: HardwareProbe) -> None:
    """The RolloutPlan's fields with their reasons: the engine's kernels for the rollout dtype, its wave size and
    cache length from the memory plan (whether the cache is freed for the training phases: _plan_kv_release)."""
    rollout = plan.rollout
    arr = cfg.actor_rollout_ref
    _rollout_policy(rollout, weight_dtype=plan.param_dtype, on_cuda=target.is_cuda,
                    torch_version=machine.torch_version, shape=shape, budget_bytes=plan.memory_budget_bytes,
                    cc=target.cc, triton=machine.triton_usable)
    rollout.rows_per_wave = plan.sizes.rollout_batch_size
    rollout.reasons["rows_per_wave"] = f"the planned rollout batch: {plan.reasons.get('rollout_batch_size', '')}"
    prompt = int(arr.rollout.prompt_length or cfg.data.max_prompt_length)
    response = int(arr.rollout.response_length or cfg.data.max_response_length)
    rollout.max_seq_len = prompt + response
    rollout.reasons["max_seq_len"] = f"prompt {prompt} + response {response} tokens"


def plan_rollout_for(model_or_shape: Any, device: Any = "cpu", dtype: Optional[torch.dtype] = None,
                     budget_bytes: Optional[int] = None, *, engine: str = RolloutEngineName.FAST.value,
                     rows_per_wave: Optional[int] = None, max_seq_len: Optional[int] = None) -> RolloutPlan:
    """The RolloutPlan a run would use for this model on `device`, without a config (benches build engines
    directly). model_or_shape: a loaded HF model (its weight dtype counts: a different `dtype` means a cast copy),
    or anything read_model_shape reads. dtype: the rollout dtype (default: the model's; fp32 for a shape).
    budget_bytes: default the device's memory on CUDA. rows_per_wave: None decodes the whole request at once."""
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    weight = next(model_or_shape.parameters(), None) if hasattr(model_or_shape, "parameters") else None
    config = getattr(model_or_shape, "config", None) if weight is not None else model_or_shape
    shape = read_model_shape(config) if config is not None else None
    weight_dtype = weight.dtype if weight is not None else None
    dtype = dtype if dtype is not None else (weight_dtype or FP32)
    if budget_bytes is None and on_cuda:
        budget_bytes = est.memory_budget_bytes(torch.cuda.get_device_properties(device).total_memory, True)
    rollout = RolloutPlan(engine=engine, fallback_allowed=False, dtype=dtype, rows_per_wave=rows_per_wave,
                          max_seq_len=max_seq_len,
                          reasons={"engine": f"engine={engine}", "dtype": f"dtype={dtype_name(dtype)}",
                                   "fallback_allowed": "a bench measures the engine it asked for",
                                   "rows_per_wave": "given" if rows_per_wave else "the whole request at once",
                                   "release_kv_between_phases": "a bench has no training phases"})
    _rollout_policy(rollout, weight_dtype=weight_dtype or dtype, on_cuda=on_cuda, torch_version=torch.__version__,
                    shape=shape, budget_bytes=budget_bytes,
                    cc=torch.cuda.get_device_capability(device) if on_cuda and torch.cuda.is_available() else None,
                    triton=triton_usable())
    return rollout


def sharded_gather_dtype(plan: Plan) -> Optional[torch.dtype]:
    """[distributed] The dtype FSDP2 gathers a sharded model's weights in: the compute dtype under bf16 autocast
    (MixedPrecisionPolicy, gradients reduced in fp32); None (the fp32 params) otherwise, fp16 included (it keeps
    today's autocast + loss scaler on fp32 weights)."""
    return BF16 if plan.use_autocast and plan.compute_dtype == BF16 else None


def _local_rank() -> int:
    """This process's GPU index under torchrun (0 alone)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def _check_host_memory(offloaded: dict[str, int], per_node: int, host_ram_bytes: int, reasons: dict[str, str]) -> None:
    """What the plan offloads lives in this machine's RAM, once per rank on it: refuse before loading when the
    ranks' offloaded state does not fit the RAM available (x est.CPU_RAM_FRACTION); else say how much it takes."""
    if not offloaded:
        return
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
    reasons["host_memory"] = f"offloaded: {text}"


def _plan_data_parallel(cfg: Any, plan: Plan, machine: HardwareProbe, for_execution: bool,
                        reasons: dict[str, str]) -> None:
    """Several ranks: each holds a full replica (memory above is per rank, batch sizes divided by the ranks)."""
    per_node = max(1, int(cfg.trainer.n_gpus_per_node))
    world = max(1, int(cfg.trainer.nnodes) * per_node)
    plan.world_size = world
    if world == 1:
        reasons["data_parallel"] = "one process (trainer.nnodes x trainer.n_gpus_per_node = 1)"
        return
    on_gpu = plan.device.startswith("cuda")
    if for_execution and on_gpu and per_node > len(machine.devices):
        raise PlanError(f"trainer.n_gpus_per_node={per_node} but this node has {len(machine.devices)} CUDA device(s): "
                        f"use trainer.n_gpus_per_node<={len(machine.devices)} (or hardware.device=cpu for CPU "
                        "processes)")
    plan.dist_backend = "nccl" if on_gpu else "gloo"
    # [distributed] plan.data_parallel ("replicate" | "shard") and its reason come from distributed.plan_sharding
    reasons["dist_backend"] = "NCCL between GPUs" if on_gpu else "gloo between CPU processes"
    if not on_gpu:
        plan.cpu_threads = max(1, (machine.cpu_cores or os.cpu_count() or 1) // per_node)
        reasons["cpu_threads"] = f"{machine.cpu_cores} cores shared by {per_node} CPU processes on this node"


def _ref_reason(plan: Plan, use_ref: bool, use_lora: bool, kl_loss: bool, kl_reward: bool,
                reasons: dict[str, str]) -> None:
    if not use_ref:
        plan.ref_device = "none"
        reasons["ref_device"] = "no reference model: no KL term (use_kl_loss and use_kl_in_reward off, or coef 0)"
    elif use_lora:
        plan.ref_device = "none"
        reasons["ref_device"] = "LoRA: the reference is the base model with the adapter disabled (no second copy)"
    else:
        why = " and ".join(w for w, on in (("use_kl_loss", kl_loss), ("use_kl_in_reward", kl_reward)) if on)
        reasons["ref_device"] = f"{why} needs a reference; " + reasons.get("ref_device", "")


def _memory_cap(plan: Plan, card: Optional[CardSpec], real: Optional[DeviceInfo], for_execution: bool,
                reasons: dict[str, str]) -> None:
    if card is None:
        reasons["memory_fraction"] = "not emulating"
        return
    if real is None:
        reasons["memory_fraction"] = f"would cap a real GPU to {card.memory_gib} GiB when run"
        return
    fraction = card.memory_bytes / real.total_memory_bytes
    if fraction > 1.0:
        message = (f"cannot emulate the {card.name} ({card.memory_gib} GiB) on the {real.name} "
                   f"({est.format_bytes(real.total_memory_bytes)}): the card has more memory than this GPU")
        if for_execution:
            raise PlanError(message + "; emulate a smaller card or use a larger GPU")
        reasons["memory_fraction"] = message
        return
    plan.memory_fraction = fraction
    reasons["memory_fraction"] = (f"{card.memory_gib} GiB of the {real.name}'s "
                                  f"{est.format_bytes(real.total_memory_bytes)}")


def _check_real_card_runs(plan: Plan, real: DeviceInfo, machine: HardwareProbe) -> None:
    """An emulated plan still executes on the real GPU: it must support what the plan uses."""
    if plan.compute_dtype == BF16 and not real.native_bf16:
        raise PlanError(f"the plan for the emulated {plan.card} computes in bf16, which the real {real.name} "
                        f"(cc {cc_str(real.compute_capability)}) cannot run. Set hardware.precision=fp32")
    if plan.attn_implementation == ATTN_FLASH and not (machine.flash_attn_installed and
                                                       flash_attn_capable(real.compute_capability)):
        raise PlanError(f"the plan for the emulated {plan.card} uses {ATTN_FLASH}, which the real {real.name} cannot "
                        f"run. Set hardware.attn_implementation={ATTN_SDPA}")



# --------------------------------------------------------------------------------------------- runtime
def prepare_environment(cfg: Any = None) -> None:
    """Call first thing, before anything touches torch.cuda: allocator settings are read when CUDA initialises."""
    device = str(cfg.hardware.device if cfg is not None else "auto").lower()
    if device == "cpu":
        return
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF


def apply_runtime(plan: Plan) -> None:
    """TF32 flags, the memory cap when emulating, allocator settings (if CUDA has not initialised yet)."""
    if not plan.device.startswith("cuda"):
        torch.set_float32_matmul_precision("highest")
        if plan.cpu_threads:
            torch.set_num_threads(plan.cpu_threads)
        return
    if plan.alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        if torch.cuda.is_initialized():
            log.warning("CUDA is already initialised: PYTORCH_CUDA_ALLOC_CONF=%s has no effect; call "
                        "planner.prepare_environment(cfg) before touching torch.cuda", plan.alloc_conf)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = plan.alloc_conf
    torch.backends.cuda.matmul.allow_tf32 = plan.allow_tf32
    torch.backends.cudnn.allow_tf32 = plan.allow_tf32
    torch.set_float32_matmul_precision("high" if plan.allow_tf32 else "highest")
    if plan.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(plan.memory_fraction, torch.device(plan.device))


def _plan_training_kernels(plan: Plan, sdpa_backends: list[str], on_cuda: bool) -> None:
    """Which SDPA backends the training passes may use, and the optimizer's step kernel."""
    reasons = plan.reasons
    if on_cuda and plan.attn_implementation == ATTN_SDPA and CUDNN_SDPA in sdpa_backends:
        plan.training_sdpa_backends = tuple(b for b in sdpa_backends if b != CUDNN_SDPA)
        reasons["training_sdpa_backends"] = (
            f"{', '.join(plan.training_sdpa_backends)}: cuDNN attention is left out of the training passes, whose "
            "sequence lengths change with every micro-batch; it builds an execution plan per new shape (1.7-2.1 ms "
            "of CPU per call in a profiled H200 step), which made the update CPU-bound")
    else:
        plan.training_sdpa_backends = ()
        reasons["training_sdpa_backends"] = ("PyTorch's choice" if plan.attn_implementation == ATTN_SDPA else
                                             f"attention is {plan.attn_implementation}, not SDPA")
    _plan_kv_head_expansion(plan, sdpa_backends, on_cuda)
    offloaded = plan.optimizer_offload or plan.param_offload
    plan.fused_optimizer = on_cuda and plan.data_parallel != "shard" and not offloaded and not plan.use_grad_scaler
    reasons["fused_optimizer"] = ("CUDA: AdamW's fused step (one kernel per parameter group)" if plan.fused_optimizer
                                  else "CPU: AdamW's foreach step" if not on_cuda else
                                  "fp16 loss scaling unscales before clipping: AdamW's foreach step"
                                  if plan.use_grad_scaler else
                                  "sharded parameters: AdamW's foreach step" if plan.data_parallel == "shard" else
                                  "offloaded weights or optimizer state: AdamW's foreach step" if offloaded else
                                  "AdamW's foreach step")


def _plan_kv_head_expansion(plan: Plan, sdpa_backends: list[str], on_cuda: bool) -> None:
    """Whether SDPA gets grouped-query models' K/V heads repeated per query head (models.sdpa_expanded_kv_attention,
    registered with transformers as vocabulary.SDPA_EXPANDED_KV).

    transformers hands SDPA the grouped heads with enable_gqa=True whenever a batch needs no mask, and packed rows
    never do. On CUDA only SDPA's flash kernel takes grouped heads; where it does not run, PyTorch falls back to
    its math kernel, which keeps T x T scores per head for the backward (more memory than the plan counted, and
    slower: measured in the P40-path update on an H200)."""
    reasons = plan.reasons
    if plan.attn_implementation != ATTN_SDPA:
        plan.expand_kv_heads = False
        reasons["expand_kv_heads"] = f"attention is {plan.attn_implementation}, not SDPA"
    elif not on_cuda:
        plan.expand_kv_heads = False
        reasons["expand_kv_heads"] = "CPU: SDPA's flash kernel takes grouped K/V heads as they are"
    elif "flash_attention" in sdpa_backends:
        plan.expand_kv_heads = False
        reasons["expand_kv_heads"] = (f"SDPA's flash kernel runs for {dtype_name(plan.compute_dtype)} here and takes "
                                      "grouped K/V heads as they are")
    else:
        plan.expand_kv_heads = True
        reasons["expand_kv_heads"] = (
            f"SDPA's flash kernel, the only CUDA kernel that takes grouped K/V heads, does not run for "
            f"{dtype_name(plan.compute_dtype)} on compute capability {cc_str(plan.compute_capability)} (bf16/fp16 on "
            ">= 8.0): given grouped heads, PyTorch falls back to its math kernel (T x T scores per head kept for the "
            "backward); repeated per query head they run in the memory-efficient kernel")


# Model families whose attention prompt_sharing.shared_prompt_attention reproduces (transformers' SDPA path with RoPE
# from position_ids; sliding windows honoured): FastEngine's families
SHARED_PROMPT_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


# Measured on one H200 (bench/vs_trl.py, Qwen2.5-0.5B shape, 16 prompts x 8 samples, ~120 + 256 tokens, one call
# each): the update with shared prompts vs packed rows; bench/shared_prompts.py for one uncompiled micro-batch
SHARED_PROMPTS_FP32 = ("fp32 without TF32 (P40 path): update 2.58-2.73 s vs 3.16-3.17 s in two calls, peak 14.5 vs "
                       "16.7 GiB")
SHARED_PROMPTS_VARLEN = ("bf16, compiled, varlen flash: update 0.294 s vs 0.313 s, 0.318 vs 0.400 s with checkpointing, "
                         "peak 28.0 vs 33.0 GiB")
SHARED_PROMPTS_CKPT = "bf16 with checkpointing, masked attention: update 0.37 s vs 0.41 s"
SHARED_PROMPTS_FLASH = "bf16, no checkpointing, masked attention: update 0.34 s vs 0.31 s"
SHARED_PROMPTS_EAGER = ("bf16 uncompiled, varlen flash: one 8-row micro-batch forward + backward 143 ms vs 89 ms (the "
                        "per-layer gathers and the varlen call cost more host time than the tokens saved)")


def _plan_prompt_sharing(plan: Plan, requested: Optional[bool], samples_per_prompt: int, model_type: str,
                         flash_runs: bool, varlen: Optional[bool] = None) -> None:
    """Whether training micro-batches run as one token stream with each distinct prompt once (prompt_sharing.py):
    a group's n samples then push its prompt through the layers, forward and backward, once instead of n times,
    and with which attention. Where packed rows run SDPA's flash kernel (bf16/fp16 on compute capability >= 8.0),
    the stream needs PyTorch's varlen flash attention (varlen: whether this torch has it; None = look) and compiled
    passes to pay, or checkpointing (the forward runs twice); elsewhere packed rows run the masked kernels anyway."""
    if varlen is None:
        varlen = varlen_attention_function() is not None
    refusal = (f"attention is {plan.attn_implementation}; shared prompts run through SDPA"
               if plan.attn_implementation != ATTN_SDPA else
               f"model type {model_type!r} is not one whose attention it reproduces ({', '.join(SHARED_PROMPT_MODEL_TYPES)})"
               if model_type not in SHARED_PROMPT_MODEL_TYPES else None)
    if requested and refusal:
        raise PlanError(f"hardware.share_prompts=true: {refusal}. Use hardware.share_prompts=auto")
    use_varlen = flash_runs and varlen
    kernel_why = (SHARED_PROMPTS_VARLEN if use_varlen else SHARED_PROMPTS_CKPT if flash_runs else
                  SHARED_PROMPTS_FP32 if plan.compute_dtype == FP32 else
                  "no flash kernel here: packed rows run the masked kernels too")
    if requested is False:
        plan.share_prompts, reason = False, "off: hardware.share_prompts=false"
    elif refusal:
        plan.share_prompts, reason = False, f"off: {refusal}"
    elif requested:
        plan.share_prompts, reason = True, "hardware.share_prompts=true"
    elif samples_per_prompt < 2:
        plan.share_prompts, reason = False, "off: one sample per prompt (actor_rollout_ref.rollout.n=1), none to share"
    elif flash_runs and not use_varlen and not plan.gradient_checkpointing:
        plan.share_prompts = False
        reason = (f"off: packed rows run SDPA's flash kernel for {dtype_name(plan.compute_dtype)} here, which takes no "
                  f"mask, and this torch has no varlen flash attention (torch.nn.attention.varlen, torch >= 2.10); the "
                  f"masked attention cost more than the tokens saved ({SHARED_PROMPTS_FLASH})")
    elif use_varlen and not plan.compile_training and not plan.gradient_checkpointing:
        plan.share_prompts = False
        reason = f"off: training passes not compiled ({SHARED_PROMPTS_EAGER})"
    else:
        plan.share_prompts = True
        reason = (f"{samples_per_prompt} samples per prompt: a micro-batch's rows of one prompt run its tokens once, "
                  f"forward and backward; attention gathers each response's keys ({kernel_why})")
    plan.reasons["share_prompts"] = reason
    plan.shared_prompt_kernel = VARLEN if use_varlen else MASKED
    plan.reasons["shared_prompt_kernel"] = (
        "flash over variable-length sequences (torch.nn.attention.varlen): no mask, no padded slots" if use_varlen else
        "SDPA with a boolean mask over padded sequence slots" + (
            "" if not flash_runs else " (no varlen flash attention in this torch)" if not varlen else ""))


# Training passes run their decoder layers compiled from this compute capability up (measured on an H200; Triton,
# which inductor generates its GPU kernels with, does not run below 7.0, and 7.x is not measured).
COMPILE_TRAINING_MIN_CC = (8, 0)
COMPILED_WIDTH_MULTIPLE = 8


def _plan_training_compile(plan: Plan, allowed: bool, on_cuda: bool, cc: Optional[tuple[int, int]],
                           triton: bool) -> None:
    """Whether the training-side passes (log-probs, values, updates) run compiled: the actor's, reference's and
    critic's decoder layers (torch.compile, one graph per layer class) and the log-prob head's chunk math."""
    refusals = (  # the first that applies is the reason
        (not allowed, "actor_rollout_ref.actor.use_torch_compile=false"),
        (not on_cuda, "CPU: compiling takes tens of seconds per layer variant (measured on 2 cores), not repaid by a "
                      "CPU run's few steps"),
        (not triton, "triton is not installed, or no C compiler to build its kernels' launcher"),
        (cc is None or cc < COMPILE_TRAINING_MIN_CC,
         f"compute capability {cc_str(cc) if cc else 'unknown'} < {cc_str(COMPILE_TRAINING_MIN_CC)} (Triton does not "
         "run on Pascal; Volta and Turing not measured)"),
        (plan.data_parallel == "shard", "sharded models (FSDP2): compiled layers under fully_shard not measured here"),
        (plan.param_offload, "offloaded weights (moved between devices each phase): compiled layers not measured "
                             "there"),
    )
    why_not = next((reason for refused, reason in refusals if refused), None)
    plan.compile_training = why_not is None
    # inductor compiles a graph for widths that are multiples of 8 and another for the rest (an alignment guard)
    plan.micro_batch_width_multiple = COMPILED_WIDTH_MULTIPLE if plan.compile_training else 1
    plan.reasons["compile_training"] = why_not or (
        "torch.compile per decoder layer (dynamic shapes, one graph shared by every layer) and of the log-prob "
        "head's softmax math: the norms, RoPE, SiLU*mul, residual adds and casts run as fused kernels (the update "
        "1.6-1.8x faster on an H200, docs/benchmarks.md); the first step pays the compile (~10 s, cached on disk). "
        f"Micro-batch widths are rounded up to a multiple of {COMPILED_WIDTH_MULTIPLE} (padding after every row): "
        "inductor compiles a separate graph for other widths")


def training_attention_context(plan: Plan) -> contextlib.AbstractContextManager:
    """The SDPA backends of plan.training_sdpa_backends around a training forward/backward (no-op when empty)."""
    if not plan.training_sdpa_backends:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name.upper()) for name in plan.training_sdpa_backends])


def autocast_context(plan: Plan, enabled: bool = True) -> contextlib.AbstractContextManager:
    """torch.autocast in the plan's compute dtype when the plan uses autocast, else a no-op."""
    if not (enabled and plan.use_autocast):
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(plan.device).type, dtype=plan.compute_dtype)


def make_grad_scaler(plan: Plan) -> Optional["torch.amp.GradScaler"]:
    """A GradScaler for fp16 plans (LOSS_SCALE_INIT, halved on overflow, doubled after LOSS_SCALE_GROWTH_INTERVAL
    clean steps), None otherwise."""
    if not plan.use_grad_scaler:
        return None
    return torch.amp.GradScaler(torch.device(plan.device).type, init_scale=LOSS_SCALE_INIT,
                                growth_interval=LOSS_SCALE_GROWTH_INTERVAL)
