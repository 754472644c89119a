"""The rollout plan: how the generation engine runs (`RolloutPlan`): the decode attention kernel, fused weight
copies, fp32 logits, CUDA graphs, the Triton kernels of FastEngine, its wave size and cache length, and whether the
KV cache is freed between the rollout and the training phases.

`rollout_policy` is shared by a run's plan (`plan_rollout`) and a bench's (`plan_rollout_for`, no config).
Reasons say why in a user's words; the measurements behind these choices are in docs/benchmarks.md."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import estimator as est
from ..machine import HardwareProbe, triton_usable
from ..model_shape import ModelShape, read_model_shape
from ..plans import Plan, RolloutPlan
from ..vocabulary import DECODE_HALF_MIN_ROWS, DECODE_MATMUL, DECODE_SDPA, DECODE_TRITON, FP32, TRITON_DECODE_MIN_CC, \
    RolloutEngineName, cc_str, dtype_name, has_half_gemm_fp32_output, is_half
from .device import Decision, Target

# FastEngine's split-K Triton decode attention (rollout/decode_attention.py) is planned from TRITON_DECODE_MIN_CC
# up (measured on an H200 only; Pascal has no fast half math): in half precision, and in fp32 with its products as
# three TF32 products (TF32 tensor cores start at 8.0 too). Volta and Turing are untimed, and there the kernels would
# need other launch settings: compiled for sm_70 and sm_75 (Triton 3.6, fp16, two warps) they spill 640 bytes or
# more a thread to local memory, where from sm_80 on they fit 128 registers without spilling.
TRITON_DECODE_REASON = ("split-K Triton kernel over each row's filled cache slots: faster than SDPA's fused kernel, "
                        "which gives each (row, KV head) one program and reads the left padding too")
TRITON_FP32_DECODE_REASON = ("split-K Triton kernel with its fp32 products on TF32 tensor cores (attention_tf32x3): "
                             "faster than batched GEMMs, and as close to an fp64 reference")
TF32X3_REASON = ("the fp32 decode attention's products as three TF32 tensor-core products each (x = big + small, "
                 "both TF32; big*big + big*small + small*big summed in fp32): as close to an fp64 reference as exact "
                 "fp32 products, in about half their time")
FUSED_SAMPLING_GAIN = "one pass instead of about nine kernels over the fp32 logits"

# Decode attention on a GPU reads the cache up to the next multiple of this many slots. Attention time grows with
# the slots read (bench/decode_profile.py); finer spans read fewer empty slots at the price of more CUDA graphs (one
# per rows bucket and span, captured once).
DECODE_SPAN_GRANULARITY = 64


def triton_decode_refusal(triton: bool, cc: Optional[tuple[int, int]], engine: str) -> str:
    """Why FastEngine's Triton kernels are not planned on this CUDA target."""
    if engine != RolloutEngineName.FAST:
        return f"the {engine} engine runs none of FastEngine's kernels"
    if not triton:
        return "triton is not installed, or no C compiler to build its kernels' launcher"
    return (f"compute capability {cc_str(cc) if cc else 'unknown'} < {cc_str(TRITON_DECODE_MIN_CC)} (not measured "
            "there)")


def fp32_gemm_layouts(dtype: Optional[torch.dtype], on_cuda: bool, cc: Optional[tuple[int, int]], engine: str,
                      shape: Optional[ModelShape], budget_bytes: Optional[int]) -> Decision:
    """Decision(RolloutPlan.fp32_gemm_layouts, reason): fp32 decode GEMMs in the layouts cuBLAS runs fastest at
    64-128 rows (measured on an H200, fp32 without TF32; docs/benchmarks.md): o_proj and the LM head from [in, out]
    copies, down as W @ x^T. cuBLAS only, no Triton."""
    if engine != RolloutEngineName.FAST:
        return Decision(False, f"off: the {engine} engine")
    if not on_cuda:
        return Decision(False, "off: CPU")
    if dtype != FP32:
        return Decision(False, f"off: {dtype_name(dtype) if dtype is not None else 'the model dtype'} (measured in "
                               "fp32 only)")
    if cc is None or cc < TRITON_DECODE_MIN_CC:
        return Decision(False, f"off: compute capability {cc_str(cc) if cc else 'unknown'} < "
                               f"{cc_str(TRITON_DECODE_MIN_CC)} (measured on an H200 only)")
    if shape is None or budget_bytes is None:
        return Decision(False, "off: no model shape or memory budget to size the copies against")
    copy = est.layout_copy_bytes(shape, dtype)
    within = copy <= est.FUSED_COPY_BUDGET_FRACTION * budget_bytes
    return Decision(within, (
        f"{'on' if within else 'off'}: fp32 decode GEMMs in the layouts cuBLAS runs fastest at 64-128 rows: o_proj "
        "and the LM head from [in, out] copies (x @ W), down as W @ x^T; the copies take "
        f"{est.format_bytes(copy)}, {'within' if within else 'over'} {est.FUSED_COPY_BUDGET_FRACTION:.0%} of the "
        f"{est.format_bytes(budget_bytes)} budget"))


def rollout_policy(rollout: RolloutPlan, *, weight_dtype: Optional[torch.dtype], on_cuda: bool, torch_version: str,
                   shape: Optional[ModelShape], budget_bytes: Optional[int], cc: Optional[tuple[int, int]] = None,
                   triton: bool = False) -> None:
    """The rollout engine's kernels and weight copies for `rollout.dtype` on this device; fills `rollout` (a plan
    being built) and its reasons, each field with its reason. cc: the compute capability the plan is for (an
    emulated card's); triton: whether Triton kernels can be built here."""
    reasons = rollout.reasons
    dtype = rollout.dtype if rollout.dtype is not None else weight_dtype
    half = dtype is not None and is_half(dtype)
    dtype_text = dtype_name(dtype) if dtype is not None else "the model's dtype"
    fast = rollout.engine == RolloutEngineName.FAST
    # FastEngine's Triton kernels run here (measured on an H200); the attention kernel in any dtype (fp32 through
    # TF32x3), the compiled elementwise ops, fused KV write and sampler in any dtype
    triton_runs = on_cuda and triton and cc is not None and cc >= TRITON_DECODE_MIN_CC and fast
    refusal = triton_decode_refusal(triton, cc, rollout.engine)
    if half and triton_runs:
        rollout.decode_attention = DECODE_TRITON
        reasons["decode_attention"] = f"{dtype_text}: {TRITON_DECODE_REASON}"
    elif triton_runs:
        rollout.decode_attention = DECODE_TRITON
        reasons["decode_attention"] = f"{dtype_text}: {TRITON_FP32_DECODE_REASON}"
    elif half:
        rollout.decode_attention = DECODE_SDPA
        reasons["decode_attention"] = f"{dtype_text}: SDPA keeps the scores in fp32 inside the kernel" + (
            "" if not on_cuda else f" (Triton's split-K kernel: {refusal})")
    else:
        rollout.decode_attention = DECODE_MATMUL
        reasons["decode_attention"] = (f"{dtype_text}: batched GEMMs are faster than SDPA's fused kernels for a "
                                       "decode step's few queries" + (f"; Triton's split-K kernel: {refusal}"
                                                                      if on_cuda else ""))
    rollout.attention_tf32x3 = rollout.decode_attention == DECODE_TRITON and not half
    reasons["attention_tf32x3"] = (
        f"on: {TF32X3_REASON}" if rollout.attention_tf32x3 else
        "off: half-precision attention runs on the tensor cores as it is" if half else
        f"off: {dtype_text} decode attention runs as {rollout.decode_attention}, not the Triton kernel")
    rollout.match_hf_numerics = True
    reasons["match_hf_numerics"] = (
        "round like transformers in RMSNorm, RoPE and residual adds, so the sampling log-probs stay close to the "
        "trainer's in half precision" if half else f"on (no effect in {dtype_text}: rounds the same either way)")
    fp32_output_gemm = has_half_gemm_fp32_output(torch_version, on_cuda)
    rollout.fp32_logits = not (half and on_cuda and not fp32_output_gemm)
    reasons["fp32_logits"] = (
        f"logits already fp32 in {dtype_text}" if not half else
        f"fp32 LM-head output as the trainer computes log-probs (torch {torch_version}: one half-in/fp32-out GEMM)"
        if fp32_output_gemm else "fp32 LM-head output (CPU: the inputs are upcast)" if not on_cuda else
        f"off: torch {torch_version} has no torch.mm(..., out_dtype=) (>= 2.8), and an fp32 copy of the LM head every "
        "step would cost more than it gains")
    rollout.cuda_graphs = on_cuda and fast
    reasons["cuda_graphs"] = ("CUDA: one graph per decode step shape" if rollout.cuda_graphs else
                              "CPU: no CUDA graphs" if not on_cuda else f"the {rollout.engine} engine captures none")
    if not fast:
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
            + (" (fewer, larger GEMMs in each decode step)" if rollout.fuse_weights else ""))
    rollout.transpose_gate_up = True
    reasons["transpose_gate_up"] = "fused gate/up stored [hidden, 2 x intermediate]: faster for 64-256 decode rows"
    reasons.setdefault("prefill_tokens_per_chunk", f"{rollout.prefill_tokens_per_chunk} padded prompt tokens per "
                                                   "prefill forward bound its activations")
    reasons.setdefault("check_every", f"every {rollout.check_every} decode steps: finished rows and stop strings")
    rollout.span_granularity = DECODE_SPAN_GRANULARITY if on_cuda else 256
    rollout.compile_elementwise = triton_runs
    reasons["compile_elementwise"] = (
        f"on: {dtype_text} decode steps run each residual add + RMSNorm and SiLU*mul as one Triton kernel (the "
        "embedding gather inside the first norm), rounding as eager does, nothing to compile (the RoPE of models "
        "with q/k norms stays a compiled kernel)"
        if rollout.compile_elementwise and half else
        "on: the decode step's norms, RoPE, SiLU*mul and residual adds as fused torch.compile kernels that keep "
        "eager's rounding: shorter decode steps for a few seconds of compilation once"
        if rollout.compile_elementwise else
        "off: CPU (no CUDA graphs to save launches from)" if not on_cuda else f"off: {refusal}")
    rollout.fused_kv_write = triton_runs
    reasons["fused_kv_write"] = (
        "on: the decode step's RoPE and K/V cache writes as one Triton kernel per layer instead of three (models "
        "with fused QKV weights and no q/k norms; others keep the separate kernels)"
        + (", in half precision inside the attention kernel itself" if half else "") if rollout.fused_kv_write else
        "off: CPU" if not on_cuda else f"off: {refusal}")
    # cuBLASLt's bias epilogue picks a much slower fp32 GEMM at decode shapes; bf16 and training shapes unaffected
    rollout.qkv_bias_apart = on_cuda and not half and fast
    reasons["qkv_bias_apart"] = (
        f"on: {dtype_text} decode steps add the q/k/v biases after their GEMM (inside the RoPE kernel where it "
        "runs): with the bias in cuBLASLt's epilogue the fp32 QKV GEMM at decode shapes runs a kernel about twice "
        "as slow, for the same sum" if rollout.qkv_bias_apart else
        "off: CPU" if not on_cuda else
        f"off: the {rollout.engine} engine" if not fast else
        f"off: {dtype_text} (the bias epilogue costs nothing there, and adding it apart would round twice)")
    # two halves of a decode step on two streams: faster in fp32 only on cards of the H200's class (measured there)
    rollout.decode_halves = on_cuda and not half and cc is not None and cc >= TRITON_DECODE_MIN_CC and fast
    reasons["decode_halves"] = (
        f"on: {dtype_text} decode steps of >= {2 * DECODE_HALF_MIN_ROWS} rows as two halves on two CUDA streams, one "
        "half's attention and norms beside the other's GEMMs (shorter steps)"
        if rollout.decode_halves else
        "off: CPU" if not on_cuda else
        f"off: the {rollout.engine} engine" if not fast else
        f"off: {dtype_text} (measured slower in half precision: its GEMMs already fill the GPU)" if half else
        f"off: compute capability {cc_str(cc) if cc else 'unknown'} < {cc_str(TRITON_DECODE_MIN_CC)} (measured on "
        "an H200 only)")
    rollout.fp32_gemm_layouts, reasons["fp32_gemm_layouts"] = fp32_gemm_layouts(dtype, on_cuda, cc, rollout.engine,
                                                                                shape, budget_bytes)
    rollout.fused_sampling = triton_runs  # the sampler does not depend on the model's dtype
    reasons["fused_sampling"] = (
        f"on: each decode step samples in one Triton pass over its logits inside the step's CUDA graph "
        f"({FUSED_SAMPLING_GAIN}); requests with top-k or top-p use the torch sampler" if rollout.fused_sampling else
        "off: CPU (the torch sampler)" if not on_cuda else f"off: {refusal}")
    reasons["span_granularity"] = (
        f"decode attention reads the cache up to the next multiple of {rollout.span_granularity} slots: "
        + ("a CUDA graph per (rows, span) bucket is cheap, reading empty slots is not" if on_cuda else
           "CPU: few distinct shapes"))


def plan_rollout(cfg: Any, plan: Plan, target: Target, shape: ModelShape, machine: HardwareProbe) -> None:
    """The RolloutPlan's fields with their reasons: the engine's kernels for the rollout dtype, its wave size and
    cache length from the memory plan (whether the cache is freed for the training phases: decide_kv_release)."""
    rollout = plan.rollout
    arr = cfg.actor_rollout_ref
    rollout_policy(rollout, weight_dtype=plan.param_dtype, on_cuda=target.is_cuda,
                   torch_version=machine.torch_version, shape=shape, budget_bytes=plan.memory_budget_bytes,
                   cc=target.cc, triton=machine.triton_usable)
    rollout.rows_per_wave = plan.sizes.rollout_batch_size
    rollout.reasons["rows_per_wave"] = f"the planned rollout batch: {plan.reasons.get('rollout_batch_size', '')}"
    prompt = int(arr.rollout.prompt_length or cfg.data.max_prompt_length)
    response = int(arr.rollout.response_length or cfg.data.max_response_length)
    rollout.max_seq_len = prompt + response
    rollout.reasons["max_seq_len"] = f"prompt {prompt} + response {response} tokens"


def decide_kv_release(plan: Plan, target: Target, requested: Optional[bool]) -> Decision:
    """Whether the rollout's KV cache is freed after each rollout (verl: actor_rollout_ref.rollout.free_cache_engine).
    The estimator counts the cache in the rollout phase only; kept, it also sits beside the log-prob and update
    phases. It stays when it fits there: a freed cache is allocated again every step and the decode step's CUDA
    graphs, which point into it, are captured again. Should the training phases still run out of memory, the OOM
    guard frees it first (Trainer)."""
    estimate = plan.estimate or {}
    phases, budget = estimate.get("phases", {}), plan.memory_budget_bytes or 0
    training = max((v for k, v in phases.items() if k != "rollout"), default=0)
    cache = estimate.get("breakdown", {}).get("rollout", {}).get("kv_cache", 0)
    fits = training + cache <= budget
    sizes = (f"the training phases' planned peak {est.format_bytes(training)} + the {est.format_bytes(cache)} cache "
             f"{'fit' if fits else 'exceed'} the {est.format_bytes(budget)} budget"
             + (f" of the {target.name}" if target.emulated else ""))
    if not target.is_cuda:
        return Decision(False, "CPU: memory is not the limit")
    if requested is not None:
        return Decision(requested, f"actor_rollout_ref.rollout.free_cache_engine={requested}" + (
            f" ({sizes}: auto would keep it and save reallocating it and capturing the CUDA graphs every step)"
            if requested and fits else f" ({sizes})" if not requested and not fits else ""))
    return Decision(not fits, f"{'kept' if fits else 'freed'}: {sizes}")


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
    rollout_policy(rollout, weight_dtype=weight_dtype or dtype, on_cuda=on_cuda, torch_version=torch.__version__,
                   shape=shape, budget_bytes=budget_bytes,
                   cc=torch.cuda.get_device_capability(device) if on_cuda and torch.cuda.is_available() else None,
                   triton=triton_usable())
    return rollout
