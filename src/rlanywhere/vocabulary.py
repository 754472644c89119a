"""The vocabulary: the choices a config may name (as enums), dtype and attention names, capability rules, and the
planner's errors.

A leaf module (it imports only rlanywhere.errors, and torch when a dtype is first named) so every other module can name a dtype, an attention
implementation or a config choice without importing the planner. Only this module writes dtype literals
(torch.bfloat16, ...) and attention-implementation names ("flash_attention_2", ...); tests/test_vocabulary.py
checks that. Config validation (config.py) takes its lists of valid values from the enums here.
"""

from __future__ import annotations

import re
import sys
from enum import Enum
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Optional, Union

from .errors import UserError

if TYPE_CHECKING:
    import torch

# ------------------------------------------------------------------------------------------ config choices
class Choice(str, Enum):
    """A config choice: compares, hashes and prints as its string value, so configs (plain strings) and code that
    compares with strings keep working."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


class AdvantageEstimator(Choice):
    """algorithm.adv_estimator (algorithms.ADVANTAGE_ESTIMATORS has one function per member)."""

    GAE = "gae"
    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"


class LossAggMode(Choice):
    """actor.loss_agg_mode / critic.loss_agg_mode: how token losses become one number (algorithms.agg_loss)."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


class PolicyLossMode(Choice):
    """actor.policy_loss.loss_mode."""

    VANILLA = "vanilla"
    GSPO = "gspo"


class RolloutEngineName(Choice):
    """actor_rollout_ref.rollout.name: AUTO lets the planner pick (fast, falling back to hf)."""

    AUTO = "auto"
    FAST = "fast"
    HF = "hf"


class DecodeAttention(Choice):
    """How FastEngine attends in a decode step (RolloutPlan.decode_attention)."""

    SDPA = "sdpa"  # fused kernel; keeps scores in fp32 inside it
    MATMUL = "matmul"  # batched GEMMs, softmax in fp32
    TRITON = "triton"  # split-K kernels over each row's filled slots (rollout/decode_attention.py)


class AttnImplementation(Choice):
    """hardware.attn_implementation (transformers' attn_implementation names); AUTO lets the planner pick."""

    AUTO = "auto"
    FLASH = "flash_attention_2"
    SDPA = "sdpa"
    EAGER = "eager"


class Precision(Choice):
    """hardware.precision; AUTO lets the planner pick for the card."""

    AUTO = "auto"
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class Truncation(Choice):
    """data.truncation: what happens to a prompt over max_prompt_length."""

    ERROR = "error"
    LEFT = "left"  # keep the last tokens
    RIGHT = "right"  # keep the first tokens
    MIDDLE = "middle"  # keep both ends: the first half and the last half (verl: the odd token to the end)


def drops_overlong_prompts(filter_overlong_prompts: bool | None, truncation: str) -> bool:
    """data.filter_overlong_prompts as it acts: unset, overlong prompts are dropped only with truncation=error (where
    verl stops the run at the first one); with left / right / middle they are cut."""
    return truncation == Truncation.ERROR.value if filter_overlong_prompts is None else bool(filter_overlong_prompts)


# ------------------------------------------------------------------------------ dtype and attention names

# plain strings (what transformers and the Plan carry): the enum members' values
ATTN_FLASH = AttnImplementation.FLASH.value
ATTN_SDPA = AttnImplementation.SDPA.value
ATTN_EAGER = AttnImplementation.EAGER.value
ATTN_IMPLEMENTATIONS = (ATTN_FLASH, ATTN_SDPA, ATTN_EAGER)
# SDPA with grouped K/V heads repeated per query head: our attention function, registered with transformers under
# this name when the plan expands them (models.sdpa_expanded_kv_attention, planner/training.py)
SDPA_EXPANDED_KV = "rlanywhere_sdpa_expanded_kv"
# SDPA that also runs shared-prompt streams (prompt_sharing.shared_prompt_attention), over plain SDPA or the expanded
# one for other calls; registered when the plan shares prompts (planner/training.py)
SDPA_SHARED_PROMPTS = "rlanywhere_sdpa_shared_prompts"
SDPA_EXPANDED_KV_SHARED_PROMPTS = "rlanywhere_sdpa_expanded_kv_shared_prompts"
# the two kernels a shared-prompt stream's attention runs as (prompt_sharing.py; plan.shared_prompt_kernel)
SHARED_PROMPTS_MASKED = "sdpa_mask"  # SDPA over [sequences, heads, slots, D] with a boolean mask: any backend, dtype
SHARED_PROMPTS_VARLEN = "flash_varlen"  # flash over variable-length sequences, causal from the bottom right: no mask
# every attention implementation name that runs PyTorch's SDPA (transformers builds SDPA masks for each)
SDPA_NAMES = (ATTN_SDPA, SDPA_EXPANDED_KV, SDPA_SHARED_PROMPTS, SDPA_EXPANDED_KV_SHARED_PROMPTS)
DECODE_SDPA = DecodeAttention.SDPA.value
DECODE_MATMUL = DecodeAttention.MATMUL.value
DECODE_TRITON = DecodeAttention.TRITON.value
# RolloutPlan.decode_halves splits a decode step only into halves of at least this many rows (fp32 on an H200:
# 2 x 64 rows faster than 128 at once, 2 x 32 slower than 64)
DECODE_HALF_MIN_ROWS = 64
# torch SDPA backends by their SDPBackend member names, lower case (machine.sdpa_backends_that_run)
SDPA_BACKEND_NAMES = ("flash_attention", "efficient_attention", "cudnn_attention", "math")
CUDNN_SDPA = "cudnn_attention"

# `rlanywhere prepare TASK`: the datasets it writes (the CLI's choices; named in hints about missing data)
PREPARE_TASKS = ("gsm8k", "arithmetic", "tool-arithmetic", "generic")

ALLOC_CONF = "expandable_segments:True"  # fewer fragmentation OOMs when phase shapes change

# Dynamic loss scaling for fp16 (torch.amp.GradScaler). An RL run takes a few optimizer steps per RL step, so
# torch's default growth interval (2000 steps) would leave a scale halved by one early overflow low for the whole
# run; 100 lets it grow back within tens of RL steps (DeepSpeed and Megatron use windows of 1000 for pre-training).
LOSS_SCALE_INIT = 2.0 ** 16
LOSS_SCALE_GROWTH_INTERVAL = 100
FP16_MATMUL_TOLERANCE = 5e-3  # relative error of a fp16-autocast matmul against fp64 (the doctor uses it too)

# The dtype names are torch objects, made when one is first named (from this module or through __getattr__): the
# CLI's commands that load no model (`--help`, `demo --list`, errors in the command line) start without torch.
DTYPE_CONSTANTS = ("FP32", "BF16", "FP16", "ACCUMULATE_DTYPE", "REFERENCE_DTYPE", "STATISTICS_DTYPE",
                   "EXCHANGE_DTYPE", "PRECISION_DTYPES")


@lru_cache(maxsize=None)
def _dtypes() -> dict[str, Any]:
    import torch

    fp32, bf16, fp16 = torch.float32, torch.bfloat16, torch.float16
    named = dict(
        FP32=fp32, BF16=bf16, FP16=fp16,
        ACCUMULATE_DTYPE=torch.float32,  # log-softmax, advantages, losses: always reduced in fp32
        REFERENCE_DTYPE=torch.float64,  # numerical references (doctor, tests)
        STATISTICS_DTYPE=torch.float64,  # sums of many terms (advantages, token counts across ranks): exact in fp64
        EXCHANGE_DTYPE=torch.float64,  # per-row numbers moved between ranks (balance_batch): fp32 and floats exact
        PRECISION_DTYPES={Precision.FP32.value: fp32, Precision.BF16.value: bf16, Precision.FP16.value: fp16},
    )
    aliases = {
        fp32: ("fp32", "float32", "float", "f32", "torch.float32", "32"),
        bf16: ("bf16", "bfloat16", "torch.bfloat16"),
        fp16: ("fp16", "float16", "half", "f16", "torch.float16", "16"),
    }
    named["by_name"] = {alias: dtype for dtype, names in aliases.items() for alias in names}
    named["precision_by_dtype"] = {dtype: name for name, dtype in named["PRECISION_DTYPES"].items()}
    return named


def __getattr__(name: str) -> Any:
    """vocabulary.FP32 and the other DTYPE_CONSTANTS (importing torch the first time)."""
    if name in DTYPE_CONSTANTS:
        return _dtypes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_from_name(name: Union[str, torch.dtype]) -> torch.dtype:
    """'fp32' / 'float32' / 'bfloat16' / 'bf16' / 'fp16' / 'half' / a torch.dtype -> torch.dtype."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    key, by_name = str(name).strip().lower(), _dtypes()["by_name"]
    if key not in by_name:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16 (or float32, bfloat16, float16)")
    return by_name[key]


def dtype_name(dtype: Union[str, torch.dtype]) -> str:
    """torch.bfloat16 -> 'bfloat16' (also accepts the aliases dtype_from_name takes)."""
    return str(dtype_from_name(dtype) if isinstance(dtype, str) else dtype).replace("torch.", "")


def precision_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bf16'."""
    return _dtypes()["precision_by_dtype"].get(dtype, dtype_name(dtype))


def is_half(dtype: torch.dtype) -> bool:
    return dtype in (_dtypes()["BF16"], _dtypes()["FP16"])


def to_jsonable(value: Any) -> Any:
    """Dicts, lists and tuples with torch.dtype leaves -> the same with dtype names (for JSON records)."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    torch = sys.modules.get("torch")  # a torch.dtype exists only once torch is loaded
    if torch is not None and isinstance(value, torch.dtype):
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


# The rollout's Triton kernels (decode attention, fused sampler, elementwise ops) are planned from this compute
# capability up (planner/rollout.py says why), and so is an emulated plan's real card checked (planner/device.py)
TRITON_DECODE_MIN_CC = (8, 0)
# Training passes run their decoder layers compiled from this compute capability up (measured on an H200; Triton,
# which inductor generates its GPU kernels with, does not run below 7.0, and 7.x is not measured).
COMPILE_TRAINING_MIN_CC = (8, 0)


def has_tf32(cc: Optional[tuple[int, int]]) -> bool:
    return cc is not None and tuple(cc) >= (8, 0)


def has_half_gemm_fp32_output(torch_version: str, on_cuda: bool) -> bool:
    """Whether `torch.mm(half, half, out_dtype=torch.float32)` exists: CUDA with torch >= 2.8. Elsewhere an fp32
    result needs the inputs upcast (cheap on CPU, an fp32 copy of the LM head every step on CUDA)."""
    if not on_cuda:
        return False
    numbers = re.match(r"(\d+)\.(\d+)", str(torch_version))
    return numbers is not None and (int(numbers.group(1)), int(numbers.group(2))) >= (2, 8)


# FlashAttention-2 (the flash-attn package, SDPA's flash kernel, torch.nn.attention.varlen): Ampere, Ada, Hopper
FLASH_ATTENTION_MIN_CC = (8, 0)


def flash_attn_capable(cc: Optional[tuple[int, int]]) -> bool:
    """FlashAttention-2 supports Ampere, Ada and Hopper."""
    return cc is not None and tuple(cc) >= FLASH_ATTENTION_MIN_CC


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
