"""Split-K decode attention (flash-decoding) as Triton kernels: FastEngine's attention where Triton runs.

One decode step asks G query heads per KV head (GQA) of every row to attend over that row's filled cache slots
[start, slot]. A fused attention kernel gives each (row, KV head) one program that walks all slots in turn, so a
decode step of few rows leaves most of the GPU idle and reads the left padding too. Here the slots are cut into
`splits` chunks, each its own program (partial softmax: running max, sum and weighted values in fp32), and a second
kernel merges the chunks. Programs skip slots outside [start, slot], so padding and unwritten slots are not read.

    out = decode_attention(q, keys, values, starts, slot, scale)   # q [B, KV, G, D], keys/values [B, KV, S, D]

Numerics follow FlashAttention: scores and softmax statistics in fp32, probabilities rounded to the value dtype
before the product with V. fp32 inputs: exact fp32 products (FMA), or, planned on cc >= 8.0 (`tf32x3`), each
product as three TF32 tensor-core products (a = big + small, both TF32; big*big + big*small + small*big summed in
fp32), as close to an fp64 reference as the FMA products and twice as fast. The launch reads nothing from the
device, so a CUDA graph can capture it. Tests run the kernels on a CPU with Triton's interpreter (TRITON_INTERPRET=1).

Also here, the step before it: `rope_and_store` rotates the fused QKV output and writes this step's keys and
values into the cache in one kernel, rounding as llama.apply_rope does. The kernels live in decode_kernels.py.
"""

from __future__ import annotations

import math
import os

import torch

from ..machine import triton_usable
from ..vocabulary import ACCUMULATE_DTYPE, FP32

BLOCK_SLOTS = 64  # cache slots per inner iteration of a program
PROGRAMS_PER_SM = 4  # enough programs in flight to cover memory latency
# fp32 splits pipeline two blocks deep, not Triton's default three (H200, 64 rows, 384 slots, 3xTF32: 14.2 vs
# 18.8 us per layer; 128 rows: 23.7 vs 28.2); half precision measured the same either way
FP32_LAUNCH = {"num_stages": 2}


def triton_interpreting() -> bool:
    """Triton's CPU interpreter (tests): its half-precision tl.dot is wrong, so half inputs are multiplied as
    fp32 there, exactly (a product of two half values is exact in fp32); only the summation order differs."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernels():
    from . import decode_kernels as kernels  # imports triton: only where the kernels run

    return kernels.split_kernel, kernels.merge_kernel, kernels.rope_store_kernel


def plan_chunks(items: int, length: int, block: int, programs_wanted: int) -> tuple[int, int]:
    """(splits, chunk): each of `items` independent reductions over `length` elements cut into `splits` chunks of
    `chunk` elements (a multiple of `block`, none empty), enough programs to fill the GPU, none shorter than a
    block. Shared by the split-K attention (slots per (row, KV head)) and the fused sampler (vocabulary per row)."""
    blocks = max(1, math.ceil(length / block))
    splits = max(1, min(blocks, math.ceil(programs_wanted / max(items, 1))))
    chunk = math.ceil(blocks / splits) * block
    return math.ceil(blocks * block / chunk), chunk


def plan_splits(rows_x_heads: int, span: int, programs_wanted: int) -> tuple[int, int]:
    """`plan_chunks` of each (row, KV head)'s span in blocks of BLOCK_SLOTS slots."""
    return plan_chunks(rows_x_heads, span, BLOCK_SLOTS, programs_wanted)


def programs_wanted(device: torch.device) -> int:
    """Programs that fill `device` (a few per SM, to cover memory latency); on the CPU (the interpreter in
    tests) a few, so that rows still cut into several chunks."""
    if device.type != "cuda":
        return 8
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
                     slot: torch.Tensor, scale: float, splits: int | None = None, tf32x3: bool = False) -> torch.Tensor:
    """softmax(q K^T * scale) V over each row's slots [starts[row], slot], for q [B, KV, G, D] and keys/values
    [B, KV, S, D] (any strides with a contiguous last dim: views of the cache); starts [B] and slot [1] long on the
    device. Returns [B, KV, G, D] in q's dtype. splits: chunks per (row, KV head) (default: fill the GPU).
    tf32x3: fp32 products as three TF32 tensor-core products (cc >= 8.0; planned as RolloutPlan.attention_tf32x3)."""
    split_kernel, merge_kernel, _ = _kernels()
    batch, kv_heads, groups, head_dim = q.shape
    span = keys.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("decode_attention: keys/values need a contiguous last dimension")
    rows_x_heads = batch * kv_heads
    if splits is None:
        splits, chunk = plan_splits(rows_x_heads, span, programs_wanted(q.device))
    else:
        chunk = math.ceil(span / splits / BLOCK_SLOTS) * BLOCK_SLOTS
    g_pad = max(16, 1 << (groups - 1).bit_length())  # tl.dot needs 16 rows
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    partial = dict(dtype=ACCUMULATE_DTYPE, device=q.device)
    acc = torch.empty(rows_x_heads, splits, g_pad, block_d, **partial)
    maxes = torch.empty(rows_x_heads, splits, g_pad, **partial)
    sums = torch.empty(rows_x_heads, splits, g_pad, **partial)
    out = torch.empty(batch, kv_heads, groups, head_dim, dtype=q.dtype, device=q.device)
    split_kernel[(rows_x_heads, splits)](
        q, keys, values, starts, slot, acc, maxes, sums,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), kv_heads, groups, head_dim, span, chunk, float(scale),
        SPLITS=splits, G_PAD=g_pad, BLOCK_D=block_d, BLOCK_S=BLOCK_SLOTS,
        HALF_DOT=q.dtype != FP32 and not triton_interpreting(), FP32_DOT="tf32x3" if tf32x3 else "ieee",
        **({} if q.dtype != FP32 else FP32_LAUNCH))
    merge_kernel[(rows_x_heads,)](
        acc, maxes, sums, out, out.stride(0), out.stride(1), out.stride(2), kv_heads, groups, head_dim,
        SPLITS=splits, G_PAD=g_pad, BLOCK_D=block_d)
    return out


def rope_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, cache_k: torch.Tensor,
                   cache_v: torch.Tensor, slot: torch.Tensor, heads: int, match_hf: bool,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step's RoPE and cache write in one kernel (instead of RoPE, then two index copies).

    qkv [B, heads + 2 KV, D]: the fused QKV projection of one token per row; cos/sin_signed [B, D] at each row's
    position (sin_signed: llama.signed_sin); cache_k/cache_v [rows >= B, KV, length, D]: one layer's cache (views,
    contiguous last dim); slot [1] long on the device. Writes the rotated keys and the values at `slot` of rows
    [:B] and returns the rotated queries [B, heads, D], rounded as llama.apply_rope rounds (match_hf: transformers'
    order). bias [(heads + 2 KV) * D]: the projection's bias when the GEMM left it out, added first (as
    `qkv + bias` would be)."""
    _, _, rope_store_kernel = _kernels()
    batch, all_heads, head_dim = qkv.shape
    kv_heads = (all_heads - heads) // 2
    if qkv.stride(-1) != 1 or cache_k.stride(-1) != 1 or cache_v.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("rope_and_store: qkv, cos and the cache need a contiguous last dimension")
    if cos.stride() != sin_signed.stride():
        raise ValueError("rope_and_store: cos and sin_signed need the same layout")
    if bias is not None and (bias.numel() != all_heads * head_dim or not bias.is_contiguous()):
        raise ValueError(f"rope_and_store: bias must be contiguous with {all_heads * head_dim} elements, got "
                         f"{tuple(bias.shape)}")
    q = torch.empty(batch, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    rope_store_kernel[(batch, all_heads)](
        qkv, qkv if bias is None else bias, cos, sin_signed, q, cache_k, cache_v, slot, qkv.stride(0),
        qkv.stride(1), cos.stride(0), q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1),
        cache_k.stride(2), cache_v.stride(0), cache_v.stride(1), cache_v.stride(2), heads, kv_heads, head_dim,
        BLOCK_D=max(16, 1 << (head_dim - 1).bit_length()), MATCH_HF=bool(match_hf), HAS_BIAS=bias is not None)
    return q


__all__ = ["decode_attention", "rope_and_store", "plan_chunks", "plan_splits", "programs_wanted", "triton_usable", "triton_interpreting", "BLOCK_SLOTS"]
