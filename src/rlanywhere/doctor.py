"""`rlanywhere doctor`: real compute checks on the planned path, not just imports.

Each check runs the kernels the plan will use (dtype, autocast, attention implementation, checkpointing) on the
planned device and compares against a float64 reference computed on CPU:

    matmul fp32          fp32 matmul (TF32 when the plan allows it) vs fp64
    matmul compute dtype a matmul under the plan's autocast vs fp64 (skipped for fp32 plans)
    attention            the planned attention (SDPA / FlashAttention-2 / eager math) with causal + padding masks
                         vs a fp64 softmax reference, forward and backward
    tiny model           a random 2-layer Qwen2 built in code: loss and gradients on the planned path (compiled
                         layers where the plan compiles the training passes) vs the same weights in fp64
    generation           model.generate of 4 tokens in the rollout dtype
    fp16                 for fp16 plans: the planner's fp16 checks (machine.fp16_problems: fp16 autocast matmul,
                         fp16 SDPA forward and backward, a GradScaler skipping an overflowed step)
    memory cap           when emulating on CUDA: allocating beyond the emulated card's memory must fail

Before planning, `torch kernels for the GPU` checks that the installed torch build has kernels for the card
(torch.cuda.get_arch_list() against its compute capability) and names the build that does.

`run_doctor` prints the probe, the plan and a pass/fail table and returns (ok, report).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from .config import config_from
from .estimator import MIB, format_bytes
from .machine import HardwareProbe, fp16_problems, probe_machine
from .models import compile_decoder_layers, hf_attention_implementation
from .plans import Plan, format_table
from .planner import make_plan
from .runtime import apply_runtime, autocast_context, make_grad_scaler, prepare_environment
from .update import training_passes
from .vocabulary import (
    ACCUMULATE_DTYPE, ATTN_FLASH, ATTN_SDPA, FP16_MATMUL_TOLERANCE, FP32, REFERENCE_DTYPE, dtype_name, precision_name,
)

# Relative error (Frobenius) allowed against the fp64 reference, per arithmetic.
TOLERANCE = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 3e-2, "fp16": FP16_MATMUL_TOLERANCE}
# A 2-layer model compounds rounding: looser bounds for logits / loss / gradients.
MODEL_TOLERANCE = {"fp32": 1e-4, "tf32": 2e-2, "bf16": 1e-1, "fp16": 3e-2}
MATMUL_SIZE = 256
ATTENTION_SHAPE = (2, 4, 32, 64)  # batch, heads, sequence, head dim
PADDING = 5  # left padding of the second sequence
GENERATE_TOKENS = 4
CAP_OVERSHOOT_BYTES = 256 * MIB


def tiny_qwen2_config(attn_implementation: str):
    """A random 2-layer Qwen2 small enough to run anywhere."""
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False)
    config._attn_implementation = attn_implementation
    return config


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.detach().to(REFERENCE_DTYPE).cpu(), reference.detach().to(REFERENCE_DTYPE).cpu()
    return float((value - reference).norm() / reference.norm().clamp_min(1e-30))


def _arith(plan: Plan, dtype: torch.dtype) -> str:
    if dtype == FP32:
        return "tf32" if plan.allow_tf32 else "fp32"
    return precision_name(dtype)


def _planned_matmul(a: torch.Tensor, b: torch.Tensor, plan: Plan, use_autocast: bool) -> torch.Tensor:
    with autocast_context(plan, enabled=use_autocast):
        return a @ b


def _random_pair(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=gen, dtype=REFERENCE_DTYPE)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=gen, dtype=REFERENCE_DTYPE)
    return a, b


def check_matmul_fp32(plan: Plan, device: torch.device) -> tuple[str, str]:
    a, b = _random_pair(device)
    out = _planned_matmul(a.float().to(device), b.float().to(device), plan, use_autocast=False)
    err = relative_error(out, a @ b)
    arith = _arith(plan, FP32)
    ok = bool(torch.isfinite(out).all()) and err <= TOLERANCE[arith]
    return ("pass" if ok else "fail"), f"{arith}: relative error {err:.2e} (limit {TOLERANCE[arith]:.0e})"


def check_matmul_compute(plan: Plan, device: torch.device) -> tuple[str, str]:
    if not plan.use_autocast:
        return "skip", f"the plan computes in {dtype_name(plan.compute_dtype)} without autocast (checked above)"
    a, b = _random_pair(device)
    out = _planned_matmul(a.float().to(device), b.float().to(device), plan, use_autocast=True)
    if out.dtype != plan.compute_dtype:
        return "fail", f"autocast produced {dtype_name(out.dtype)}, expected {dtype_name(plan.compute_dtype)}"
    err = relative_error(out, a @ b)
    arith = _arith(plan, plan.compute_dtype)
    ok = bool(torch.isfinite(out).all()) and err <= TOLERANCE[arith]
    return ("pass" if ok else "fail"), f"{arith} autocast: relative error {err:.2e} (limit {TOLERANCE[arith]:.0e})"


def _attention_inputs(with_padding: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, heads, seq, dim = ATTENTION_SHAPE
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(batch, heads, seq, dim, generator=gen, dtype=REFERENCE_DTYPE) for _ in range(3))
    real = torch.ones(batch, seq, dtype=torch.bool)
    if with_padding:
        real[1, :PADDING] = False  # left padding, as in rollout prompts
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    mask = causal[None, None] & real[:, None, None, :]  # [batch, 1, query, key]
    return q, k, v, mask


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) masked) v in whatever dtype the inputs have."""
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _planned_attention(q, k, v, mask, plan: Plan) -> torch.Tensor:
    if plan.attn_implementation == ATTN_FLASH:
        from flash_attn import flash_attn_func  # padding goes through the varlen path in HF; causal only here

        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.transpose(1, 2)
    if plan.attn_implementation == ATTN_SDPA:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # eager, as transformers does it: scores in the compute dtype, softmax in fp32
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=ACCUMULATE_DTYPE).to(q.dtype)
    return probs @ v


def check_attention(plan: Plan, device: torch.device) -> tuple[str, str]:
    with_padding = plan.attn_implementation != ATTN_FLASH
    q, k, v, mask = _attention_inputs(with_padding)
    dtype = plan.compute_dtype
    inputs = [t.to(device=device, dtype=dtype).requires_grad_(True) for t in (q, k, v)]
    out = _planned_attention(*inputs, mask.to(device), plan)
    valid = mask.any(-1).squeeze(1)  # query rows with at least one key (padded rows are undefined)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=REFERENCE_DTYPE)
    # Padded query rows are undefined in every kernel: they must send no gradient into k and v.
    grad_out = grad_out * valid[:, None, :, None]
    (out.float() * grad_out.to(device=device, dtype=FP32)).sum().backward()

    ref_inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*ref_inputs, mask)
    (ref.nan_to_num() * grad_out).sum().backward()
    err = relative_error(out.transpose(1, 2)[valid], ref.transpose(1, 2)[valid])
    grad_err = max(relative_error(t.grad, r.grad) for t, r in zip(inputs, ref_inputs))
    arith = _arith(plan, dtype)
    limit = TOLERANCE[arith] * 2  # two matmuls and a softmax
    finite = all(bool(torch.isfinite(t.grad).all()) for t in inputs)
    ok = finite and err <= limit and grad_err <= limit * 2
    return (("pass" if ok else "fail"),
            f"{plan.attn_implementation} {dtype_name(dtype)}{' + padding' if with_padding else ''}: forward error "
            f"{err:.2e}, grad error {grad_err:.2e} (limits {limit:.0e}, {2 * limit:.0e})")


def _tiny_batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(1, 128, (2, 16), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :PADDING] = 0
    input_ids[1, :PADDING] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[1, PADDING] = -100  # its prediction would come from a padded position, which is undefined
    return input_ids.to(device), attention_mask.to(device), labels.to(device)


def _build_models(plan: Plan, device: torch.device):
    """The planned model (param dtype, planned attention) and a fp64 twin on CPU with the same weights.

    The twin uses SDPA (the math kernel in fp64): transformers' eager path yields NaN rows for left padding in fp64."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    reference = Qwen2ForCausalLM(tiny_qwen2_config(ATTN_SDPA)).to(REFERENCE_DTYPE)
    planned = Qwen2ForCausalLM(tiny_qwen2_config(hf_attention_implementation(plan)))
    planned.load_state_dict({k: v.to(plan.param_dtype) for k, v in reference.state_dict().items()})
    planned.to(device=device, dtype=plan.param_dtype)
    return planned, reference


def check_tiny_model(plan: Plan, device: torch.device) -> tuple[str, str]:
    planned, reference = _build_models(plan, device)
    planned.train()
    if plan.gradient_checkpointing:
        with warnings.catch_warnings():  # renamed in newer transformers; this name works in every 5.x
            warnings.simplefilter("ignore", FutureWarning)
            planned.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if plan.compile_training:  # the training passes' compiled layers, built as the trainer builds them
        compile_decoder_layers(planned)
    input_ids, attention_mask, labels = _tiny_batch(device)
    scaler = make_grad_scaler(plan)
    with training_passes(plan):  # a compile failure is reported with its fix
        with autocast_context(plan):
            out = planned(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        loss = out.loss
        (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        optimizer = torch.optim.SGD(planned.parameters(), lr=0.0)  # only to let the scaler unscale the grads
        scaler.unscale_(optimizer)

    ref_out = reference(input_ids=input_ids.cpu(), attention_mask=attention_mask.cpu(), labels=labels.cpu())
    ref_out.loss.backward()
    names = [n for n, p in reference.named_parameters() if p.grad is not None]
    grads = dict(planned.named_parameters())
    missing = [n for n in names if grads[n].grad is None]
    if missing:
        return "fail", f"no gradient for {missing[:3]}"
    flat = torch.cat([grads[n].grad.detach().to(REFERENCE_DTYPE).cpu().flatten() for n in names])
    ref_flat = torch.cat([p.grad.flatten() for n, p in reference.named_parameters() if n in names])
    real = attention_mask.bool().cpu()
    logit_err = relative_error(out.logits.detach().cpu()[real], ref_out.logits.detach()[real])
    loss_err = abs(float(loss.detach()) - float(ref_out.loss.detach())) / abs(float(ref_out.loss.detach()))
    grad_err = relative_error(flat, ref_flat)
    arith = _arith(plan, plan.compute_dtype)
    limit = MODEL_TOLERANCE[arith]
    finite = bool(torch.isfinite(flat).all()) and math.isfinite(float(loss.detach()))
    ok = finite and flat.abs().sum() > 0 and max(logit_err, loss_err, grad_err) <= limit
    ckpt = (", checkpointing" if plan.gradient_checkpointing else "") + (", compiled" if plan.compile_training else "")
    return (("pass" if ok else "fail"),
            f"{plan.attn_implementation}, {plan.precision}{ckpt}: logits error {logit_err:.2e}, loss error "
            f"{loss_err:.2e}, grad error {grad_err:.2e} (limit {limit:.0e})")


def check_generation(plan: Plan, device: torch.device) -> tuple[str, str]:
    planned, _ = _build_models(plan, device)
    planned.eval()
    rollout_plan = replace(plan, compute_dtype=plan.rollout.dtype,
                           use_autocast=plan.rollout.dtype != plan.param_dtype)
    input_ids, attention_mask, _ = _tiny_batch(device)
    with torch.no_grad(), autocast_context(rollout_plan):
        out = planned.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=GENERATE_TOKENS,
                               min_new_tokens=GENERATE_TOKENS, do_sample=False, pad_token_id=0,
                               output_scores=True, return_dict_in_generate=True)
    sequences = out.sequences
    expected = (input_ids.shape[0], input_ids.shape[1] + GENERATE_TOKENS)
    if tuple(sequences.shape) != expected:
        return "fail", f"generated shape {tuple(sequences.shape)}, expected {expected}"
    if not all(bool(torch.isfinite(s).any(-1).all()) for s in out.scores):
        return "fail", "non-finite logits while generating"
    new = sequences[:, input_ids.shape[1]:]
    if bool(((new < 0) | (new >= planned.config.vocab_size)).any()):
        return "fail", "generated token ids outside the vocabulary"
    return "pass", f"{GENERATE_TOKENS} tokens x {expected[0]} sequences in {dtype_name(plan.rollout.dtype)}"


def check_fp16(plan: Plan, device: torch.device) -> tuple[str, str]:
    if plan.precision != "fp16":
        return "skip", f"the plan computes in {plan.precision} ({plan.reasons.get('precision', '')})"
    problems = fp16_problems(device)
    if problems:
        return "fail", "; ".join(problems) + ". Set hardware.precision=fp32"
    return "pass", "fp16 autocast matmul, fp16 SDPA fwd+bwd, an overflowed GradScaler step skipped and the next applied"


def check_memory_cap(plan: Plan, device: torch.device) -> tuple[str, str]:
    if plan.memory_fraction is None:
        why = "not emulating" if not plan.emulated else "no CUDA device: nothing to cap"
        return "skip", why
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    cap = int(plan.memory_fraction * total)
    try:
        below = torch.empty(cap // 2, dtype=torch.uint8, device=device)
        del below
    except torch.cuda.OutOfMemoryError:
        return "fail", f"could not allocate half of the {format_bytes(cap)} cap"
    torch.cuda.empty_cache()
    try:
        beyond = torch.empty(cap + CAP_OVERSHOOT_BYTES, dtype=torch.uint8, device=device)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "pass", f"allocating {format_bytes(cap + CAP_OVERSHOOT_BYTES)} beyond the {format_bytes(cap)} cap fails"
    del beyond
    torch.cuda.empty_cache()
    return "fail", f"allocating {format_bytes(cap + CAP_OVERSHOOT_BYTES)} succeeded: the {format_bytes(cap)} cap is " \
                   "not in effect (call planner.apply_runtime(plan) before allocating)"


def check_torch_kernels() -> tuple[str, str]:
    """Does this torch build carry kernels for the GPU (torch.cuda.get_arch_list() vs the device's capability)?
    Run before planning: without them every CUDA op fails with "no kernel image is available"."""
    from rlanywhere.torch_setup import arch_list_covers, build_for

    if not torch.cuda.is_available():
        return "skip", "no CUDA device"
    arch_list = list(torch.cuda.get_arch_list())
    ccs = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    missing = sorted({cc for cc in ccs if not arch_list_covers(arch_list, cc)})
    if not missing:
        return "pass", f"torch {torch.__version__} builds {' '.join(arch_list)}; GPU sm_" + \
            ", sm_".join(f"{a}{b}" for a, b in sorted(set(ccs)))
    pip_args, why = build_for(missing, torch.__version__.split("+")[0])
    return "fail", (f"torch {torch.__version__} has no kernels for sm_{missing[0][0]}{missing[0][1]} (it builds "
                    f"{' '.join(arch_list) or 'none'}): {why}. Fix: pip install {' '.join(pip_args)} "
                    "--force-reinstall (or bash scripts/setup.sh)")


CHECKS: list[tuple[str, str]] = [
    ("matmul fp32", "check_matmul_fp32"),
    ("matmul compute dtype", "check_matmul_compute"),
    ("attention", "check_attention"),
    ("tiny model fwd+bwd", "check_tiny_model"),
    ("generation", "check_generation"),
    ("fp16", "check_fp16"),
    ("memory cap", "check_memory_cap"),
]


def _run_check(name: str, function: Callable[[], tuple[str, str]]) -> dict:
    start = time.perf_counter()
    try:
        status, detail = function()
    except Exception as exc:  # noqa: BLE001 - a crashing kernel is exactly what the doctor reports
        status, detail = "fail", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return {"name": name, "status": status, "detail": detail, "seconds": round(time.perf_counter() - start, 3)}


def run_doctor(cfg: Any = None, emulate: Optional[str] = None, machine: Optional[HardwareProbe] = None,
               print_fn: Callable[[str], None] = print) -> tuple[bool, list[dict]]:
    """Probe, plan, run every check on the planned path; print everything. ok is False on any failure."""
    report: list[dict] = []
    start = time.perf_counter()
    machine = machine if machine is not None else probe_machine(fresh=True)  # the doctor runs every kernel again
    report.append({"name": "probe", "status": "pass", "detail": machine.summary().splitlines()[0],
                   "seconds": round(time.perf_counter() - start, 3)})
    print_fn("machine:\n" + machine.summary())
    cfg = config_from(cfg)
    plan_holder: dict[str, Plan] = {}

    def make() -> tuple[str, str]:
        plan = make_plan(cfg, machine, for_execution=machine.cuda_available, emulate=emulate)
        apply_runtime(plan)
        plan_holder["plan"] = plan
        return "pass", f"{plan.precision}, {plan.attn_implementation} on {plan.device}" + \
            (f" (emulating {plan.emulated})" if plan.emulated else "")

    report.append(_run_check("torch kernels for the GPU", lambda: globals()["check_torch_kernels"]()))
    report.append(_run_check("plan", make))
    plan = plan_holder.get("plan")
    if plan is not None:
        print_fn("\nplan:\n" + plan.summary())
        device = torch.device(plan.device)
        for name, function_name in CHECKS:
            function = globals()[function_name]  # looked up at call time, so tests can replace a check
            report.append(_run_check(name, lambda f=function: f(plan, device)))
    ok = all(entry["status"] != "fail" for entry in report)
    rows = [(e["name"], e["status"], f"{e['seconds']:.2f}s", e["detail"]) for e in report]
    print_fn("\n" + format_table(("check", "status", "time", "detail"), rows, max_width=100))
    print_fn(f"\ndoctor: {'all checks passed' if ok else 'FAILED'}")
    return ok, report


def doctor_main(config: Any = None, overrides: Optional[list[str]] = None, emulate: Optional[str] = None) -> int:
    """`rlanywhere doctor`: 0 when every check passes, 1 otherwise.

    config: a loaded DictConfig, or a YAML path (None: defaults) loaded with `overrides`."""
    cfg = config_from(config, overrides)
    prepare_environment(cfg)
    ok, _ = run_doctor(cfg, emulate=emulate)
    return 0 if ok else 1
