"""Precision and attention: the training precision (fp32, bf16 autocast, or fp16 autocast with loss scaling), the
rollout's dtype, TF32 for fp32 matmuls, and the attention implementation the models load with. Each a pure function
of what was asked, the target hardware and what the probe saw run, returning the decision with its reason."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..machine import DeviceInfo, HardwareProbe, fp16_problems, predicted_sdpa_backends, sdpa_backends_that_run
from ..vocabulary import ATTN_EAGER, ATTN_FLASH, ATTN_IMPLEMENTATIONS, ATTN_SDPA, BF16, FP16, FP32, \
    AttnImplementation, PlanError, Precision, cc_str, dtype_from_name, dtype_name, flash_attn_capable, is_half
from .device import Decision, Target

log = logging.getLogger(__name__)


@dataclass
class PrecisionChoice:
    name: str
    param: torch.dtype
    compute: torch.dtype
    autocast: bool
    scaler: bool


class Fp16Checks:
    """What is known about fp16 on the device that will run the plan. The checks launch kernels (a second or more on
    a new machine), so a live device runs them when a decision first reads `problems`: a plan that never
    considers fp16 (a card with bf16 and no fp16 request) does not wait for them."""

    def __init__(self, problems: Optional[list[str]], where: str,
                 run: Optional[Callable[[], list[str]]] = None):
        self._problems = problems  # None: nothing could be run (planning without a GPU, a hand-made probe)
        self.where = where  # the device they ran on, or why they did not run
        self._run = run

    @property
    def problems(self) -> Optional[list[str]]:
        if self._run is not None:
            self._problems, self._run = self._run(), None
        return self._problems


def fp16_checks(target: Target, real: Optional[DeviceInfo], device: str, machine: HardwareProbe) -> Fp16Checks:
    if real is None:
        return Fp16Checks(None, "planning without a GPU")
    where = f"{device} ({real.name}" + (f", standing in for the {target.name})" if target.emulated else ")")
    if real.fp16_problems is not None:
        return Fp16Checks(real.fp16_problems, where)
    if not machine.live:
        return Fp16Checks(None, "a probe not taken on this machine")

    def run() -> list[str]:
        real.fp16_problems = fp16_problems(device)
        return real.fp16_problems

    return Fp16Checks(None, where, run)


def decide_precision(requested: str, target: Target, fp16: Fp16Checks) -> Decision:
    """Decision(PrecisionChoice, reason)."""
    cc = cc_str(target.cc)
    fp32 = PrecisionChoice(Precision.FP32.value, FP32, FP32, False, False)
    fp16_mixed = PrecisionChoice(Precision.FP16.value, FP32, FP16, True, True)
    bf16_mixed = PrecisionChoice(Precision.BF16.value, FP32, BF16, True, False)
    mixed = "fp16 autocast over fp32 master weights, dynamic loss scaling"
    if requested == Precision.AUTO:
        if not target.is_cuda:
            return Decision(fp32, "fp32: CPU (hardware.precision=bf16 opts in to bf16 autocast on CPU)")
        if target.bf16:
            return Decision(bf16_mixed, f"bf16 autocast over fp32 master weights: compute capability {cc} has "
                                        "native bf16")
        if not target.fast_fp16:
            return Decision(fp32, f"fp32: compute capability {cc} has no bf16 and no fp16 tensor cores (fp16 would "
                                  "not be faster)")
        why = f"compute capability {cc} has fp16 tensor cores and no bf16"
        if fp16.problems is None:
            return Decision(fp16_mixed, f"{mixed}: {why} (fp16 checks not run: {fp16.where}; `rlanywhere doctor` "
                                        "runs them on the card)")
        if not fp16.problems:
            return Decision(fp16_mixed, f"{mixed}: {why}; the fp16 checks passed on {fp16.where}")
        log.warning("precision: fp32 instead of fp16 - the fp16 checks failed on %s: %s", fp16.where,
                    "; ".join(fp16.problems))
        return Decision(fp32, f"fp32: {why}, but the fp16 checks failed on {fp16.where}: {'; '.join(fp16.problems)}")
    if requested == Precision.FP32:
        return Decision(fp32, "fp32: hardware.precision=fp32")
    if requested == Precision.BF16:
        if target.is_cuda and not target.bf16:
            alt = " (or fp16, which this card runs on tensor cores)" if target.fast_fp16 else ""
            raise PlanError(f"hardware.precision=bf16: bf16 needs compute capability >= 8.0; the {target.name} has "
                            f"{cc}. Use hardware.precision=fp32 (or auto){alt}")
        where = "CPU (slow without AVX512-BF16/AMX)" if not target.is_cuda else f"compute capability {cc}"
        return Decision(bf16_mixed, f"bf16 autocast over fp32 master weights: hardware.precision=bf16 on {where}")
    if requested == Precision.FP16:
        if not target.is_cuda:
            raise PlanError("hardware.precision=fp16 is not supported on CPU. Use hardware.precision=fp32 (or bf16)")
        if fp16.problems:
            raise PlanError(f"hardware.precision=fp16: the fp16 checks failed on {fp16.where}: "
                            f"{'; '.join(fp16.problems)}. Use hardware.precision=fp32 (or auto)")
        slow = "" if target.fast_fp16 else f"; compute capability {cc} has no fp16 tensor cores, so it is not faster"
        return Decision(fp16_mixed, f"{mixed}: hardware.precision=fp16{slow}")
    raise PlanError(f"hardware.precision={requested!r} is not valid; use auto, fp32, bf16 or fp16")


def decide_rollout_dtype(requested: str, precision: PrecisionChoice, target: Target) -> Decision:
    if str(requested).strip().lower() in ("auto", "", "none"):
        return Decision(precision.compute, "the compute dtype")
    try:
        wanted = dtype_from_name(requested)
    except ValueError as exc:
        raise PlanError(f"actor_rollout_ref.rollout.dtype={requested!r}: {exc}") from exc
    unsupported = (target.is_cuda and wanted == BF16 and not target.bf16) or (not target.is_cuda and wanted == FP16)
    if unsupported:
        # verl sets rollout.dtype=bfloat16 by default, so this is a default to adapt, not a hard request
        return Decision(precision.compute, f"actor_rollout_ref.rollout.dtype={requested} overridden: the "
                                           f"{target.name} cannot run it; rolling out in "
                                           f"{dtype_name(precision.compute)}")
    return Decision(wanted, f"actor_rollout_ref.rollout.dtype={requested}")


def decide_tf32(target: Target) -> Decision:
    allow = target.is_cuda and target.tf32
    return Decision(allow, f"compute capability {cc_str(target.cc)} has TF32 for fp32 matmuls" if allow else
                    "CPU" if not target.is_cuda else f"compute capability {cc_str(target.cc)} has no TF32")


def sdpa_backends(target: Target, dtype: torch.dtype, head_dim: int) -> list[str]:
    """The SDPA backends that run here (tried on live hardware, predicted for a card that is not here)."""
    if target.live_device is not None:
        return sdpa_backends_that_run(dtype, head_dim, target.live_device)
    return predicted_sdpa_backends(target.cc, dtype, head_dim)


def decide_attention(requested: str, machine: HardwareProbe, target: Target, compute: torch.dtype,
                     backends: list[str], head_dim: int) -> Decision:
    """Decision(attention implementation, reason), from the SDPA backends that run (`sdpa_backends`)."""
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
    backends_text = f"SDPA backends that run for {dtype_name(compute)}, head dim {head_dim}: {', '.join(backends)}"
    if requested == AttnImplementation.AUTO:
        if flash_problem is None:
            return Decision(ATTN_FLASH, "auto: flash_attn is installed and usable on this card")
        if backends:
            return Decision(ATTN_SDPA, f"auto: {flash_problem}; {backends_text}")
        return Decision(ATTN_EAGER, f"auto: {flash_problem}; no SDPA backend runs here")
    if requested == ATTN_FLASH:
        if flash_problem is not None:
            raise PlanError(f"hardware.attn_implementation={ATTN_FLASH}: {flash_problem}. "
                            f"Use hardware.attn_implementation={ATTN_SDPA} (or auto)")
        return Decision(ATTN_FLASH, f"hardware.attn_implementation={ATTN_FLASH}")
    if requested == ATTN_SDPA:
        if not backends:
            raise PlanError(f"hardware.attn_implementation=sdpa: no SDPA backend runs for {dtype_name(compute)} "
                            f"with head dim {head_dim} here. Use hardware.attn_implementation={ATTN_EAGER} (or auto)")
        return Decision(ATTN_SDPA, f"hardware.attn_implementation=sdpa; {backends_text}")
    if requested == ATTN_EAGER:
        return Decision(ATTN_EAGER, "hardware.attn_implementation=eager")
    raise PlanError(f"hardware.attn_implementation={requested!r} is not valid; use auto, "
                    f"{', '.join(ATTN_IMPLEMENTATIONS)}")
