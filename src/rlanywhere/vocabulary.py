"""The planner's vocabulary: dtype and attention names, capability rules, and the planner's errors.

A leaf module (it imports only torch and rlanywhere.errors) so every other module can name a dtype or an
attention implementation without importing the planner. Only this module writes dtype literals (torch.bfloat16,
...) and attention-implementation names ("flash_attention_2", ...); tests/test_vocabulary.py checks that.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .errors import UserError

# ------------------------------------------------------------------------------ dtype and attention names
FP32 = torch.float32
BF16 = torch.bfloat16
FP16 = torch.float16
ACCUMULATE_DTYPE = torch.float32  # log-softmax, advantages, losses: always reduced in fp32
REFERENCE_DTYPE = torch.float64  # numerical references (doctor, tests)
PRECISION_DTYPES = {"fp32": FP32, "bf16": BF16, "fp16": FP16}

ATTN_FLASH = "flash_attention_2"
ATTN_SDPA = "sdpa"
ATTN_EAGER = "eager"
ATTN_IMPLEMENTATIONS = (ATTN_FLASH, ATTN_SDPA, ATTN_EAGER)

ALLOC_CONF = "expandable_segments:True"  # fewer fragmentation OOMs when phase shapes change

# Dynamic loss scaling for fp16 (torch.amp.GradScaler). An RL run takes a few optimizer steps per RL step, so
# torch's default growth interval (2000 steps) would leave a scale halved by one early overflow low for the whole
# run; 100 lets it grow back within tens of RL steps (DeepSpeed and Megatron use windows of 1000 for pre-training).
LOSS_SCALE_INIT = 2.0 ** 16
LOSS_SCALE_GROWTH_INTERVAL = 100
FP16_MATMUL_TOLERANCE = 5e-3  # relative error of a fp16-autocast matmul against fp64 (the doctor uses it too)

_DTYPE_ALIASES = {
    FP32: ("fp32", "float32", "float", "f32", "torch.float32", "32"),
    BF16: ("bf16", "bfloat16", "torch.bfloat16"),
    FP16: ("fp16", "float16", "half", "f16", "torch.float16", "16"),
}
_DTYPE_BY_NAME = {alias: dtype for dtype, aliases in _DTYPE_ALIASES.items() for alias in aliases}
_PRECISION_BY_DTYPE = {dtype: name for name, dtype in PRECISION_DTYPES.items()}


def dtype_from_name(name: Union[str, torch.dtype]) -> torch.dtype:
    """'fp32' / 'float32' / 'bfloat16' / 'bf16' / 'fp16' / 'half' / a torch.dtype -> torch.dtype."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).strip().lower()
    if key not in _DTYPE_BY_NAME:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16 (or float32, bfloat16, float16)")
    return _DTYPE_BY_NAME[key]


def dtype_name(dtype: Union[str, torch.dtype]) -> str:
    """torch.bfloat16 -> 'bfloat16' (also accepts the aliases dtype_from_name takes)."""
    return str(dtype_from_name(dtype) if isinstance(dtype, str) else dtype).replace("torch.", "")


def precision_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bf16'."""
    return _PRECISION_BY_DTYPE.get(dtype, dtype_name(dtype))


def is_half(dtype: torch.dtype) -> bool:
    return dtype in (BF16, FP16)


def to_jsonable(value: Any) -> Any:
    """Dicts, lists and tuples with torch.dtype leaves -> the same with dtype names (for JSON records)."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    return value


# ------------------------------------------------------------------------------------ capability rules
def has_native_bf16(cc: Optional[tuple[int, int]]) -> bool:
    """Native bf16 math needs Ampere (8.0). torch.cuda.is_bf16_supported() also says True on a T4 because it counts
    emulation, which is slow and not what a plan should rely on."""
    return cc is not None and tuple(cc) >= (8, 0)


def has_fast_fp16(cc: Optional[tuple[int, int]]) -> bool:
    """fp16 tensor cores: Volta (7.0) and later."""
    return cc is not None and tuple(cc) >= (7, 0)


def has_tf32(cc: Optional[tuple[int, int]]) -> bool:
    return cc is not None and tuple(cc) >= (8, 0)


def flash_attn_capable(cc: Optional[tuple[int, int]]) -> bool:
    """FlashAttention-2 supports Ampere, Ada and Hopper."""
    return cc is not None and tuple(cc) >= (8, 0)


def cc_str(cc: Optional[tuple[int, int]]) -> str:
    """(8, 0) -> '8.0'; None (CPU) -> 'n/a'."""
    return f"{cc[0]}.{cc[1]}" if cc else "n/a"


# ------------------------------------------------------------------------------------------------ errors
class PlanError(UserError, RuntimeError):
    """An impossible request, found before anything loads. The message names the problem and the fix."""


class NoFitError(PlanError):
    """Nothing fits the memory budget; the message says what would (with numbers)."""

    def __init__(self, message: str, estimate: Optional[dict] = None):
        super().__init__(message)
        self.estimate = estimate
