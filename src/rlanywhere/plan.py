"""The Plan's data: what was decided for a run (no decisions are made here; see the planner).

`RolloutPlan` is everything the rollout engine needs to know about the hardware, each field decided by the planner
with a reason in `reasons`; its defaults are the portable choice (any device, no CUDA graphs, no extra weight
copies) so a test or a bench can build one by hand. `RuntimeSizes` holds the sizes that change while a run goes
(OOM recovery halves them): saved and restored whole with a checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Optional

import torch


@dataclass
class RolloutPlan:
    """How responses are generated: engine, dtype, kernels, memory. Every field has its reason in `reasons`."""

    engine: str = "hf"  # "fast" (the built-in engine) | "hf" (transformers generate)
    fallback_allowed: bool = True  # may "fast" fall back to "hf" when FastEngine cannot run the model?
    dtype: Optional[torch.dtype] = None  # engine compute dtype; None: the model's weight dtype
    decode_attention: str = "sdpa"  # "sdpa" | "matmul" (batched GEMMs, softmax in fp32)
    fuse_weights: bool = False  # keep fused QKV and gate/up weight copies (fewer, larger GEMMs)
    transpose_gate_up: bool = True  # fused gate/up stored [hidden, 2 x intermediate]
    fp32_logits: bool = True  # LM head with fp32 output in half precision, as the trainer computes it
    match_hf_numerics: bool = True  # round like transformers inside RMSNorm, RoPE, residual adds
    cuda_graphs: bool = False  # capture each decode step as a CUDA graph (CUDA only)
    rows_per_wave: Optional[int] = None  # sequences decoded together; None: the whole request at once
    max_seq_len: Optional[int] = None  # KV cache length (prompt + response) to allocate up front
    prefill_tokens_per_chunk: int = 16384  # padded prompt tokens per prefill forward
    check_every: int = 8  # decode steps between host checks for finished rows
    release_kv_between_phases: bool = False  # free the KV cache after each rollout for the training phases
    reasons: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["dtype"] = str(self.dtype).replace("torch.", "") if self.dtype is not None else None
        return record


class SizeKind(str, Enum):
    """Which runtime size a phase runs at: each member's value is the RuntimeSizes field holding it."""

    ACTOR_MICRO_BATCH = "actor_micro_batch_size"
    CRITIC_MICRO_BATCH = "critic_micro_batch_size"
    LOGPROB_MICRO_BATCH = "logprob_micro_batch_size"
    TOKENS_PER_MICRO_BATCH = "max_token_len_per_micro_batch"
    ROLLOUT_BATCH = "rollout_batch_size"


@dataclass
class RuntimeSizes:
    """The batch sizes a run may lower while it goes (OOM recovery); saved and restored whole."""

    actor_micro_batch_size: int = 4
    critic_micro_batch_size: Optional[int] = 4
    logprob_micro_batch_size: int = 4
    max_token_len_per_micro_batch: Optional[int] = None
    rollout_batch_size: Optional[int] = None  # sequences generated at once (None: the whole batch)

    def get(self, kind: SizeKind) -> Optional[int]:
        return getattr(self, _field_of(kind))

    def set(self, kind: SizeKind, size: Optional[int]) -> None:
        setattr(self, _field_of(kind), size)

    def to_dict(self) -> dict[str, Optional[int]]:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> "RuntimeSizes":
        """Restore from a checkpoint's record; keys this version does not know are an error, not dropped."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(record) - known)
        if unknown:
            raise ValueError(f"unknown runtime sizes in the checkpoint: {unknown}; known: {sorted(known)}")
        return cls(**record)


def _field_of(kind: SizeKind) -> str:
    if not isinstance(kind, SizeKind):
        raise TypeError(f"a runtime size is named by a SizeKind (e.g. SizeKind.ACTOR_MICRO_BATCH), got {kind!r}")
    return kind.value
