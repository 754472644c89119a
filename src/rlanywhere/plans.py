"""The Plan's data: what was decided for a run, with a reason for each decision. No decisions are made here: the
planner (planner.py) fills these; everything else reads them.

`Plan` is every hardware decision for a run; `plan.rollout` (`RolloutPlan`) and `plan.sizes` (`RuntimeSizes`) are
its two parts that other modules take on their own. (The module is `plans`, not `plan`: a submodule named `plan`
would replace the API function `rlanywhere.plan` as soon as anything imported it.)

`RolloutPlan` is everything the rollout engine needs to know about the hardware, each field decided by the planner
with a reason in `reasons`; its defaults are the portable choice (any device, no CUDA graphs, no extra weight
copies) so a test or a bench can build one by hand. `RuntimeSizes` holds the sizes that change while a run goes
(OOM recovery halves them): saved and restored whole with a checkpoint.
"""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Optional

import torch

from .estimator import format_bytes
from .vocabulary import SHARED_PROMPTS_MASKED as MASKED
from .vocabulary import ATTN_SDPA, DECODE_SDPA, FP32, RolloutEngineName, dtype_name, to_jsonable


@dataclass
class RolloutPlan:
    """How responses are generated: engine, dtype, kernels, memory. Every field has its reason in `reasons`."""

    engine: str = RolloutEngineName.HF.value  # "fast" (the built-in engine) | "hf" (transformers generate)
    fallback_allowed: bool = True  # may "fast" fall back to "hf" when FastEngine cannot run the model?
    dtype: Optional[torch.dtype] = None  # engine compute dtype; None: the model's weight dtype
    decode_attention: str = DECODE_SDPA  # DecodeAttention: sdpa | matmul (batched GEMMs) | triton (split-K)
    fuse_weights: bool = False  # keep fused QKV and gate/up weight copies (fewer, larger GEMMs)
    transpose_gate_up: bool = True  # fused gate/up stored [hidden, 2 x intermediate]
    fp32_logits: bool = True  # LM head with fp32 output in half precision, as the trainer computes it
    match_hf_numerics: bool = True  # round like transformers inside RMSNorm, RoPE, residual adds
    cuda_graphs: bool = False  # capture each decode step as a CUDA graph (CUDA only)
    rows_per_wave: Optional[int] = None  # sequences decoded together; None: the whole request at once
    max_seq_len: Optional[int] = None  # KV cache length (prompt + response) to allocate up front
    prefill_tokens_per_chunk: int = 16384  # padded prompt tokens per prefill forward
    check_every: int = 8  # decode steps between host checks for finished rows
    span_granularity: int = 256  # decode attention reads the cache up to the next multiple of this many slots
    compile_elementwise: bool = False  # decode norms, RoPE, SiLU*mul, residual adds as torch.compile'd kernels
    fused_sampling: bool = False  # decode steps sample in one Triton pass over the logits (no top-k / top-p)
    fused_kv_write: bool = False  # decode's RoPE and K/V cache writes as one Triton kernel (fused QKV weights)
    qkv_bias_apart: bool = False  # decode's q/k/v biases added after their GEMM (fp32: a faster GEMM), not inside
    decode_halves: bool = False  # decode steps of >= 128 rows as two 64+-row halves on two CUDA streams (overlapped)
    attention_tf32x3: bool = False  # fp32 Triton decode attention: each product as three TF32 tensor-core products
    fp32_gemm_layouts: bool = False  # fp32 decode: o_proj and LM head from [in, out] copies, down as W @ x^T
    release_kv_between_phases: bool = False  # free the KV cache after each rollout for the training phases
    reasons: dict[str, str] = field(default_factory=dict)

    def kernels_text(self) -> str:
        """One line for a summary table: decode attention, weight fusion, logits, rounding, graphs."""
        if self.engine != RolloutEngineName.FAST:
            return f"{self.engine} engine: transformers generate (none of FastEngine's kernels)"
        logits = "fp32" if self.fp32_logits else dtype_name(self.dtype) if self.dtype is not None else "model-dtype"
        return (f"decode {self.decode_attention}, {'fused' if self.fuse_weights else 'separate'} QKV/gate-up, "
                f"{logits} logits{', HF rounding' if self.match_hf_numerics else ''}"
                f"{', compiled elementwise' if self.compile_elementwise else ''}"
                f"{', fused sampling' if self.fused_sampling else ''}"
                f"{', fused RoPE + KV write' if self.fused_kv_write else ''}"
                f"{', QKV bias apart' if self.qkv_bias_apart else ''}"
                f"{', two-stream halves' if self.decode_halves else ''}"
                f"{', 3xTF32 attention' if self.attention_tf32x3 else ''}"
                f"{', fp32 GEMM layouts' if self.fp32_gemm_layouts else ''}"
                f"{', CUDA graphs' if self.cuda_graphs else ''}")


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


@dataclass
class Plan:
    """Every hardware decision for a run, with the reason for each (see docs/ARCHITECTURE.md).

    Defaults describe a small fp32 CPU run, so tests of other modules can write `Plan()`."""

    device: str = "cpu"
    card: str = "CPU"
    compute_capability: Optional[tuple[int, int]] = None
    precision: str = "fp32"
    param_dtype: torch.dtype = FP32
    compute_dtype: torch.dtype = FP32
    use_autocast: bool = False
    use_grad_scaler: bool = False
    allow_tf32: bool = False
    attn_implementation: str = ATTN_SDPA
    gradient_checkpointing: bool = False
    logprob_chunk_size: int = 1024
    optimizer_offload: bool = False
    param_offload: bool = False
    ref_device: str = "cpu"  # the device, "cpu" (parked; moved in for its pass), or "none" (no separate ref)
    memory_fraction: Optional[float] = None
    alloc_conf: Optional[str] = None
    reasons: dict[str, str] = field(default_factory=dict)
    emulated: Optional[str] = None
    memory_budget_bytes: Optional[int] = None
    estimate: Optional[dict] = None
    # which models exist
    use_critic: bool = False
    use_ref: bool = False  # reference log-probs are needed (a separate model, or the adapter-disabled base)
    use_lora: bool = False
    rollout: RolloutPlan = field(default_factory=lambda: RolloutPlan(dtype=FP32))  # how responses are generated
    sizes: RuntimeSizes = field(default_factory=RuntimeSizes)  # batch sizes OOM recovery may lower
    world_size: int = 1  # ranks (trainer.nnodes x trainer.n_gpus_per_node); sizes above are per rank
    data_parallel: str = "none"  # "none" | "replicate" (full models per rank) | "shard" (FSDP2; sharding.py)
    shard_group_size: int = 0  # sharded: ranks that split the weights (= world_size, or fewer: HSDP replicas of them)
    dist_backend: Optional[str] = None  # "nccl" | "gloo" when world_size > 1
    cpu_threads: Optional[int] = None  # torch threads per process (CPU ranks sharing cores; an overlapped rollout's core)
    training_sdpa_backends: tuple[str, ...] = ()  # SDPA backends training passes may use; (): PyTorch's choice
    expand_kv_heads: bool = False  # SDPA gets grouped K/V heads repeated per query head (sdpa_expanded_kv_attention)
    fused_optimizer: bool = False  # AdamW's fused (one kernel) step instead of foreach
    compile_training: bool = False  # training-side passes compiled: decoder layers and the log-prob head's math
    micro_batch_width_multiple: int = 1  # packed micro-batch widths rounded up to this (8 when compiled)
    share_prompts: bool = False  # training micro-batches as one stream, each distinct prompt once (prompt_sharing.py)
    shared_prompt_kernel: str = MASKED  # its attention: MASKED (SDPA with a mask) | VARLEN (varlen flash, no mask)
    # planned row counts are bounds: a micro-batch takes more rows while they hold no more tokens than that many
    # full-length rows (Updater.micro_batches), so short responses run in fewer, larger micro-batches
    merge_micro_batches: bool = False
    # reward_model.py's RewardModelPlan as a dict (kind, path, dtype, micro-batch, offload, reasons); None: rules only
    reward_model: Optional[dict] = None
    async_rollout: str = "sync"  # "sync" | "in turn" | "overlapped": trainer.async as planned (async_pipeline.py)
    # one_step_off: the reference's log-probs of each batch computed in the rollout's job, right after its rollout
    ref_with_rollout: bool = False
    # overlapped on a GPU: the training step on a high-priority stream of its own, the rollout's at the default
    # (trainer.async.priority=update); else the rollout's stream at high priority
    update_stream_first: bool = False

    def to_dict(self) -> dict:
        return to_jsonable(asdict(self))

    def summary(self) -> str:
        gib = format_bytes
        rows = [
            ("device", self.device, self.reasons.get("device", "")),
            ("card", self.card + (" (emulated)" if self.emulated else ""), self.reasons.get("card", "")),
            ("precision", f"{self.precision}: params {dtype_name(self.param_dtype)}, compute "
             f"{dtype_name(self.compute_dtype)}" + (", autocast" if self.use_autocast else "")
             + (", grad scaler" if self.use_grad_scaler else ""), self.reasons.get("precision", "")),
            ("rollout dtype", dtype_name(self.rollout.dtype), self.reasons.get("rollout_dtype", "")),
            ("tf32", "on" if self.allow_tf32 else "off", self.reasons.get("allow_tf32", "")),
            ("attention", self.attn_implementation, self.reasons.get("attn_implementation", "")),
            ("rollout engine", self.rollout.engine, self.reasons.get("rollout_engine", "")),
            ("rollout kernels", self.rollout.kernels_text(), self.rollout.reasons.get("fuse_weights", "")),
            ("rollout KV cache", f"{self.rollout.max_seq_len or '-'} tokens x {self.rollout.rows_per_wave or 'all'} "
             f"rows; {'freed after each rollout' if self.rollout.release_kv_between_phases else 'kept'}",
             self.rollout.reasons.get("release_kv_between_phases", "")),
            ("critic", "yes" if self.use_critic else "no", self.reasons.get("use_critic", "")),
            ("reference", self.ref_device, self.reasons.get("ref_device", "")),
            ("lora", "yes" if self.use_lora else "no", self.reasons.get("use_lora", "")),
            ("grad checkpointing", "on" if self.gradient_checkpointing else "off",
             self.reasons.get("gradient_checkpointing", "")),
            ("training attention", ", ".join(self.training_sdpa_backends) or "PyTorch's choice",
             self.reasons.get("training_sdpa_backends", "")),
            ("grouped K/V heads", "expanded per query head" if self.expand_kv_heads else "as they are",
             self.reasons.get("expand_kv_heads", "")),
            ("optimizer step", "AdamW fused" if self.fused_optimizer else "AdamW foreach",
             self.reasons.get("fused_optimizer", "")),
            ("training passes", "compiled" if self.compile_training else "not compiled",
             self.reasons.get("compile_training", "")),
            ("shared prompts", f"each prompt once per micro-batch ({self.shared_prompt_kernel})"
             if self.share_prompts else "off",
             self.reasons.get("share_prompts", "")),
            ("actor micro-batch", str(self.sizes.actor_micro_batch_size), self.reasons.get("actor_micro_batch_size", "")),
            ("critic micro-batch", str(self.sizes.critic_micro_batch_size) if self.use_critic else "-",
             self.reasons.get("critic_micro_batch_size", "")),
            ("log-prob micro-batch", str(self.sizes.logprob_micro_batch_size),
             self.reasons.get("logprob_micro_batch_size", "")),
            ("tokens per micro-batch", str(self.sizes.max_token_len_per_micro_batch or "-"),
             self.reasons.get("max_token_len_per_micro_batch", "")),
            ("rollout batch", str(self.sizes.rollout_batch_size or "all"), self.reasons.get("rollout_batch_size", "")),
            *([("multi-turn", "tools", self.reasons["multi_turn"])] if "multi_turn" in self.reasons else []),
            ("log-prob chunk", f"{self.logprob_chunk_size} tokens", self.reasons.get("logprob_chunk_size", "")),
            ("optimizer offload", "on" if self.optimizer_offload else "off", self.reasons.get("optimizer_offload", "")),
            ("param offload", "on" if self.param_offload else "off", self.reasons.get("param_offload", "")),
            *([("host memory", "offloaded state", self.reasons["host_memory"])] if "host_memory" in self.reasons
              else []),
            ("memory budget", gib(self.memory_budget_bytes) if self.memory_budget_bytes else "-",
             self.reasons.get("memory_budget", "")),
            ("memory cap", f"{self.memory_fraction:.3f} of the GPU" if self.memory_fraction else "none",
             self.reasons.get("memory_fraction", "")),
            ("allocator", self.alloc_conf or "default", self.reasons.get("alloc_conf", "")),
            ("async rollout", self.async_rollout, self.reasons.get("async_rollout", "")),
            *([("reference log-probs", "with the rollout" if self.ref_with_rollout else "in the step",
                self.reasons["ref_with_rollout"])] if "ref_with_rollout" in self.reasons else []),
            *([("cpu threads", str(self.cpu_threads), self.reasons["cpu_threads"])] if self.cpu_threads else []),
        ]
        if self.reward_model:
            rm = self.reward_model
            rows.append(("reward model", f"{rm['kind']}, {rm['dtype']}, {rm['micro_batch']} rows per forward, "
                         f"{'offloaded between scorings' if rm['offload'] else 'resident'}",
                         "; ".join(rm["reasons"].get(k, "") for k in ("offload", "micro_batch"))))
        if self.world_size > 1:
            groups = (f" in groups of {self.shard_group_size} (HSDP)"
                      if self.data_parallel == "shard" and 0 < self.shard_group_size < self.world_size else "")
            rows.append(("ranks", f"{self.world_size} x {self.data_parallel}{groups} ({self.dist_backend})",
                         self.reasons.get("data_parallel", "")))
        return format_table(("decision", "choice", "reason"), rows)


def format_table(headers: tuple[str, ...], rows: list[tuple], max_width: int = 90) -> str:
    """A plain console table; long cells wrap in their column."""
    def cells(row: tuple) -> list[list[str]]:
        return [textwrap.wrap(str(c), max_width) or [""] for c in row]

    wrapped = [cells(headers)] + [cells(r) for r in rows]
    widths = [max(len(line) for row in wrapped for line in row[i]) for i in range(len(headers))]
    out = []
    for number, row in enumerate(wrapped):
        for k in range(max(len(c) for c in row)):
            out.append(" | ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(row, widths)).rstrip())
        if number == 0:
            out.append("-+-".join("-" * w for w in widths))
    return "\n".join(out)
