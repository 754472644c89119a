"""Which device a run uses and what it is: the device asked for (or found), the hardware the decisions are for
(the emulated card, the real GPU or the CPU: a `Target`), and the memory cap that makes a real GPU stand in for a
smaller emulated card. Pure functions of the config, the probe and the environment's torchrun variables."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from .. import estimator as est
from ..machine import CardSpec, DeviceInfo, HardwareProbe
from ..plans import Plan
from ..rank_layout import rank_gpu_index
from ..vocabulary import ATTN_FLASH, ATTN_SDPA, BF16, COMPILE_TRAINING_MIN_CC, DECODE_TRITON, FLASH_ATTENTION_MIN_CC, \
    SHARED_PROMPTS_VARLEN, TRITON_DECODE_MIN_CC, PlanError, cc_str, flash_attn_capable, has_fast_fp16, \
    has_native_bf16, has_tf32


class Decision(NamedTuple):
    """A decision and the reason for it, one value: whoever applies the decision writes both."""

    value: Any
    reason: str


@dataclass
class Target:
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


def auto_flag(value: Any) -> Optional[bool]:
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


def local_rank() -> int:
    """This process's GPU index under torchrun (0 alone)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def resolve_device(cfg: Any, machine: HardwareProbe, card: Optional[CardSpec], for_execution: bool
                   ) -> tuple[str, Optional[DeviceInfo], str]:
    """(device, the real GPU's probe or None, the reason)."""
    requested = str(cfg.hardware.device or "auto").strip().lower()
    trainer_device = str(cfg.trainer.get("device", "auto") or "auto").strip().lower()
    reason = None
    if requested == "auto" and trainer_device == "cpu":
        requested = "cpu"
        reason = "trainer.device=cpu"
    if requested == "cpu":
        if card is not None:
            if for_execution:
                raise PlanError(f"emulating the {card.name} caps a real GPU to its memory, but hardware.device=cpu. "
                                "Drop hardware.device=cpu (or the emulation) to run; `rlanywhere plan --emulate "
                                f"{card.key}` plans without running")
            reason = f"planning only: the decisions are for the {card.name}"
        return "cpu", None, reason or "hardware.device=cpu"
    if requested == "auto":
        if not machine.devices:
            if card is not None and for_execution:
                raise PlanError(f"--emulate {card.key} caps a real GPU to the {card.name}'s memory, and this machine "
                                f"has no CUDA device. Run `rlanywhere plan --emulate {card.key}` to plan without a "
                                "GPU, or drop the emulation to train on CPU")
            if card is not None:
                return "cpu", None, f"planning only (no CUDA device here): the decisions are for the {card.name}"
            return "cpu", None, "no CUDA device visible: training on CPU"
        index, why = rank_gpu_index(local_rank(), len(machine.devices))  # torchrun's layout, or SLURM's
        reason = f"auto: {why}" if "LOCAL_RANK" in os.environ else "auto: first CUDA device"
        if index is None:
            raise PlanError(why)
    else:
        match = re.fullmatch(r"cuda(?::(\d+))?", requested)
        if match is None:
            raise PlanError(f"hardware.device={requested!r} is not valid; use auto, cpu, cuda or cuda:N")
        index = int(match.group(1) or 0)
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            if match.group(1) is not None:
                raise PlanError(f"hardware.device={requested} under torchrun would put every rank on one GPU: use "
                                "hardware.device=cuda (or auto); each rank takes cuda:LOCAL_RANK")
            index = rank_gpu_index(local_rank(), len(machine.devices))[0]
            index = local_rank() if index is None else index  # none fits: the error below names the index
        if not machine.devices:
            if card is not None and not for_execution:
                return "cpu", None, f"planning only (no CUDA device here): the decisions are for the {card.name}"
            raise PlanError(f"hardware.device={requested} but no CUDA device is visible (torch.cuda.is_available() "
                            "is False). Use hardware.device=cpu (or auto)")
        if index >= len(machine.devices):
            raise PlanError(f"hardware.device={requested} but only {len(machine.devices)} CUDA device(s) are visible; "
                            f"use cuda:0..cuda:{len(machine.devices) - 1}")
        reason = f"hardware.device={requested}"
    return f"cuda:{index}", machine.devices[index], reason


def make_target(card: Optional[CardSpec], real: Optional[DeviceInfo], device: str, machine: HardwareProbe) -> Target:
    if card is not None:
        return Target(card.name, card.compute_capability, card.memory_bytes, True, emulated=card.key)
    if real is not None:
        return Target(real.name, tuple(real.compute_capability), real.total_memory_bytes, True,
                      live_device=device if machine.live else None)
    return Target(f"CPU ({machine.cpu_cores} cores)", None, machine.ram_available_bytes or machine.ram_total_bytes,
                  False, live_device="cpu" if machine.live else None)


def card_reason(card: Optional[CardSpec], real: Optional[DeviceInfo], target: Target) -> str:
    if card is not None:
        return (f"emulated: cc {cc_str(card.compute_capability)}, {card.memory_gib} GiB"
                + (f" on the real {real.name}" if real is not None else ""))
    if real is not None:
        return f"probed: cc {cc_str(real.compute_capability)}"
    return f"RAM {est.format_bytes(target.memory_bytes)} available"


def decide_memory_cap(card: Optional[CardSpec], real: Optional[DeviceInfo], for_execution: bool) -> Decision:
    """The fraction of the real GPU's memory this process may use when it stands in for `card` (None: no cap)."""
    if card is None:
        return Decision(None, "not emulating")
    if real is None:
        return Decision(None, f"would cap a real GPU to {card.memory_gib} GiB when run")
    fraction = card.memory_bytes / real.total_memory_bytes
    if fraction > 1.0:
        message = (f"cannot emulate the {card.name} ({card.memory_gib} GiB) on the {real.name} "
                   f"({est.format_bytes(real.total_memory_bytes)}): the card has more memory than this GPU")
        if for_execution:
            raise PlanError(message + "; emulate a smaller card or use a larger GPU")
        return Decision(None, message)
    return Decision(fraction, f"{card.memory_gib} GiB of the {real.name}'s {est.format_bytes(real.total_memory_bytes)}")


def check_real_card_runs(plan: Plan, real: DeviceInfo, machine: HardwareProbe) -> None:
    """An emulated plan still executes on the real GPU: it must support what the plan uses."""
    if plan.compute_dtype == BF16 and not real.native_bf16:
        raise PlanError(f"the plan for the emulated {plan.card} computes in bf16, which the real {real.name} "
                        f"(cc {cc_str(real.compute_capability)}) cannot run. Set hardware.precision=fp32")
    if plan.attn_implementation == ATTN_FLASH and not (machine.flash_attn_installed and
                                                       flash_attn_capable(real.compute_capability)):
        raise PlanError(f"the plan for the emulated {plan.card} uses {ATTN_FLASH}, which the real {real.name} cannot "
                        f"run. Set hardware.attn_implementation={ATTN_SDPA}")
    rollout = plan.rollout
    kernels = [name for name, used, min_cc in (
        ("compiled training passes (actor_rollout_ref.actor.use_torch_compile)", plan.compile_training,
         COMPILE_TRAINING_MIN_CC),
        ("the rollout's Triton kernels", rollout.decode_attention == DECODE_TRITON or rollout.fused_sampling
         or rollout.compile_elementwise or rollout.fused_kv_write, TRITON_DECODE_MIN_CC),
        ("varlen flash attention for shared prompts (hardware.share_prompts)",
         plan.share_prompts and plan.shared_prompt_kernel == SHARED_PROMPTS_VARLEN,
         FLASH_ATTENTION_MIN_CC)) if used and (
        real.compute_capability is None or tuple(real.compute_capability) < min_cc)]
    if kernels:
        raise PlanError(f"the plan for the emulated {plan.card} uses {' and '.join(kernels)}, which the real "
                        f"{real.name} (cc {cc_str(real.compute_capability)}) cannot run: emulate a card of compute "
                        f"capability {cc_str(real.compute_capability)} or lower, or run on a card at least as new "
                        f"as the {plan.card}")
