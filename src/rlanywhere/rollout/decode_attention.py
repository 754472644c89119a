"""Split-K decode attention (flash-decoding) as Triton kernels: FastEngine's attention where Triton runs.

One decode step asks G query heads per KV head (GQA) of every row to attend over that row's filled cache slots
[start, slot]. A fused attention kernel gives each (row, KV head) one program that walks all slots in turn, so a
decode step of few rows leaves most of the GPU idle and reads the left padding too. Here the slots are cut into
`splits` chunks, each its own program (partial softmax: running max, sum and weighted values in fp32), and a second
kernel merges the chunks; with one chunk (enough rows to fill the GPU) the program writes the output itself and no
merge runs. Programs skip slots outside [start, slot], so padding and unwritten slots are not read.

    out = decode_attention(q, keys, values, starts, slot, scale)   # q [B, KV, G, D], keys/values [B, KV, S, D]

Numerics follow FlashAttention: scores and softmax statistics in fp32, probabilities rounded to the value dtype
before the product with V. fp32 inputs: exact fp32 products (FMA), or, planned on cc >= 8.0 (`tf32x3`), each
product as three TF32 tensor-core products (a = big + small, both TF32; big*big + big*small + small*big summed in
fp32), as close to an fp64 reference as the FMA products and twice as fast. The launch reads nothing from the
device, so a CUDA graph can capture it. Tests run the kernels on a CPU with Triton's interpreter (TRITON_INTERPRET=1).

Also here, the step before it: `rope_and_store` rotates the fused QKV output and writes this step's keys and
values into the cache in one kernel, rounding as llama.apply_rope does; and, in half precision, both in one:
`rope_store_attention` starts the attention from the fused QKV output, each program rotating its queries, the one
whose chunk holds this step's slot writing the rotated key and the value there and attending to them from
registers. The kernels live in decode_kernels.py.
"""

from __future__ import annotations

import math
import os

import torch

from ..machine import triton_usable
from ..vocabulary import ACCUMULATE_DTYPE, FP32
from .kernel_compiles import launch

BLOCK_SLOTS = 64  # cache slots per inner iteration of a program
PROGRAMS_PER_SM = 4  # enough programs in flight to cover memory latency
# fp32 splits pipeline two blocks deep, not Triton's default three (H200, 64 rows, 384 slots, 3xTF32: 14.2 vs
# 18.8 us per layer; 128 rows: 23.7 vs 28.2); half precision measured the same either way
FP32_LAUNCH = {"num_stages": 2}
# half precision: two warps, two stages deep, not Triton's default four and three (H200, bf16, 384 slots, one split,
# per layer: 512 rows 26.8 vs 31.1 us; 1024 rows 48.7 vs 48.9; 256 rows about 16 vs 15.3). At most 128 registers a
# thread, so that 8 programs fit an SM's 64K registers: left to itself ptxas gave the fused RoPE + attention kernel
# 160-166 (Triton 3.6, sm_90), 6 programs an SM, and 512 rows x 2 KV heads took 1.3 waves of an H200's 132 SMs
HALF_LAUNCH = {"num_warps": 2, "num_stages": 2, "maxnreg": 128}


def triton_interpreting() -> bool:
    """Triton's CPU interpreter (tests): its half-precision tl.dot is wrong, so half inputs are multiplied as
    fp32 there, exactly (a product of two half values is exact in fp32); only the summation order differs."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernels():
    from . import decode_kernels as kernels  # imports triton: only where the kernels run

    return kernels


def plan_chunks(items: int, length: int, block: int, programs_wanted: int) -> tuple[int, int]:
    """(splits, chunk): each of `items` independent reductions over `length` elements cut into `splits` chunks of
    `chunk` elements (a multiple of `block`, none empty), enough programs to fill the GPU, none shorter than a
    block (the split-K attention's slots per (row, KV head))."""
    blocks = max(1, math.ceil(length / block))
    splits = max(1, min(blocks, math.ceil(programs_wanted / max(items, 1))))
    chunk = math.ceil(blocks / splits) * block
    return math.ceil(blocks * block / chunk), chunk


def plan_splits(rows_x_heads: int, span: int, programs_wanted: int, nearest: bool = False) -> tuple[int, int]:
    """`plan_chunks` of each (row, KV head)'s span in blocks of BLOCK_SLOTS slots. nearest: the number of splits
    nearest programs_wanted / rows_x_heads, not the next above it: a second split costs a merge kernel, which one
    split skips (half precision, H200, 256 rows x 2 KV heads, 384 slots: one split 15.3 us a layer, two 16.2 + 1.7
    for the merge)."""
    if nearest:
        programs_wanted = max(1, round(programs_wanted / max(rows_x_heads, 1))) * max(rows_x_heads, 1)
    return plan_chunks(rows_x_heads, span, BLOCK_SLOTS, programs_wanted)


def programs_wanted(device: torch.device) -> int:
    """Programs that fill `device` (a few per SM, to cover memory latency); on the CPU (the interpreter in
    tests) a few, so that rows still cut into several chunks."""
    if device.type != "cuda":
        return 8
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


_UNUSED_PARTIALS: dict = {}  # device -> a one-element fp32 tensor


def _split_buffers(rows_x_heads: int, splits: int, g_pad: int, block_d: int, out: torch.Tensor):
    """The merge kernel's inputs (fp32 partials per split); with one split the kernels write `out` directly and
    the buffers are not touched: one fp32 element stands in for them (fp32, as the partials are: the kernels'
    argument types stay the same, so one compiled kernel serves every split count)."""
    partial = dict(dtype=ACCUMULATE_DTYPE, device=out.device)
    if splits == 1:
        unused = _UNUSED_PARTIALS.get(out.device)
        if unused is None:
            unused = _UNUSED_PARTIALS[out.device] = torch.empty(1, **partial)
        return unused, unused, unused
    return (torch.empty(rows_x_heads, splits, g_pad, block_d, **partial),
            torch.empty(rows_x_heads, splits, g_pad, **partial), torch.empty(rows_x_heads, splits, g_pad, **partial))


def _merge(kernels, buffers, out: torch.Tensor, splits: int, g_pad: int, block_d: int) -> None:
    if splits == 1:
        return
    batch, kv_heads, groups, head_dim = out.shape
    launch(kernels.merge_kernel, (batch * kv_heads,),
        *buffers, out, out.stride(0), out.stride(1), out.stride(2), kv_heads, groups, head_dim, splits,
        G_PAD=g_pad, BLOCK_D=block_d)


def pow2_block(width: int) -> int:
    """The power of two at or above `width`, at least 16: a Triton block over `width` entries (tl.dot needs 16)."""
    return max(16, 1 << (width - 1).bit_length())


def _pads(groups: int, head_dim: int) -> tuple[int, int]:
    """(G_PAD, BLOCK_D): tl.dot needs 16 rows; head dims padded to a power of two."""
    return pow2_block(groups), pow2_block(head_dim)


def _splits(rows_x_heads: int, span: int, device: torch.device, half: bool, splits: int | None) -> tuple[int, int]:
    if splits is None:
        return plan_splits(rows_x_heads, span, programs_wanted(device), nearest=half)
    return splits, math.ceil(span / splits / BLOCK_SLOTS) * BLOCK_SLOTS


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
                     slot: torch.Tensor, scale: float, splits: int | None = None, tf32x3: bool = False) -> torch.Tensor:
    """softmax(q K^T * scale) V over each row's slots [starts[row], slot], for q [B, KV, G, D] and keys/values
    [B, KV, S, D] (any strides with a contiguous last dim: views of the cache); starts [B] and slot [1] long on the
    device. Returns [B, KV, G, D] in q's dtype. splits: chunks per (row, KV head) (default: fill the GPU).
    tf32x3: fp32 products as three TF32 tensor-core products (cc >= 8.0; planned as RolloutPlan.attention_tf32x3)."""
    kernels = _kernels()
    batch, kv_heads, groups, head_dim = q.shape
    span = keys.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("decode_attention: keys/values need a contiguous last dimension")
    rows_x_heads = batch * kv_heads
    half = q.dtype != FP32
    splits, chunk = _splits(rows_x_heads, span, q.device, half, splits)
    g_pad, block_d = _pads(groups, head_dim)
    out = torch.empty(batch, kv_heads, groups, head_dim, dtype=q.dtype, device=q.device)
    buffers = _split_buffers(rows_x_heads, splits, g_pad, block_d, out)
    launch(kernels.split_kernel, (rows_x_heads, splits),
        q, keys, values, starts, slot, *buffers, out,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1), out.stride(2),
        kv_heads, groups, head_dim, span, chunk, float(scale), splits, G_PAD=g_pad, BLOCK_D=block_d,
        BLOCK_S=BLOCK_SLOTS, HALF_DOT=half and not triton_interpreting(), FP32_DOT="tf32x3" if tf32x3 else "ieee",
        **(HALF_LAUNCH if half else FP32_LAUNCH))
    _merge(kernels, buffers, out, splits, g_pad, block_d)
    return out


def rope_store_attention(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, cache_k: torch.Tensor,
                         cache_v: torch.Tensor, starts: torch.Tensor, slot: torch.Tensor, heads: int, span: int,
                         scale: float, match_hf: bool, splits: int | None = None) -> torch.Tensor:
    """`rope_and_store` and `decode_attention` in one kernel (half precision): from the fused QKV projection qkv
    [B, heads + 2 KV, D] of one token per row, the rotated queries attend over each row's cached slots [starts,
    slot) of cache_k/cache_v [rows >= B, KV, length >= span, D] and this step's rotated key and value, which the
    kernel also writes at `slot`. Returns [B, KV, G, D]; the same rounding as the two kernels (the new slot's
    score is summed in another order)."""
    kernels = _kernels()
    batch, all_heads, head_dim = qkv.shape
    kv_heads = (all_heads - heads) // 2
    groups = heads // kv_heads
    if qkv.dtype == FP32:
        raise ValueError("rope_store_attention: half precision only (fp32 takes rope_and_store + decode_attention)")
    if qkv.stride(-1) != 1 or cache_k.stride(-1) != 1 or cache_v.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("rope_store_attention: qkv, cos and the cache need a contiguous last dimension")
    if cos.stride() != sin_signed.stride():
        raise ValueError("rope_store_attention: cos and sin_signed need the same layout")
    rows_x_heads = batch * kv_heads
    splits, chunk = _splits(rows_x_heads, span, qkv.device, True, splits)
    g_pad, block_d = _pads(groups, head_dim)
    out = torch.empty(batch, kv_heads, groups, head_dim, dtype=qkv.dtype, device=qkv.device)
    buffers = _split_buffers(rows_x_heads, splits, g_pad, block_d, out)
    launch(kernels.rope_attend_kernel, (rows_x_heads, splits),
        qkv, cos, sin_signed, cache_k, cache_v, starts, slot, *buffers, out,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        cache_v.stride(0), cache_v.stride(1), cache_v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        heads, kv_heads, groups, head_dim, span, chunk, float(scale), splits, G_PAD=g_pad, BLOCK_D=block_d,
        BLOCK_S=BLOCK_SLOTS, HALF_DOT=not triton_interpreting(), MATCH_HF=bool(match_hf), **HALF_LAUNCH)
    _merge(kernels, buffers, out, splits, g_pad, block_d)
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
    rope_store_kernel = _kernels().rope_store_kernel
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
    launch(rope_store_kernel, (batch, all_heads),
        qkv, qkv if bias is None else bias, cos, sin_signed, q, cache_k, cache_v, slot, qkv.stride(0),
        qkv.stride(1), cos.stride(0), q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1),
        cache_k.stride(2), cache_v.stride(0), cache_v.stride(1), cache_v.stride(2), heads, kv_heads, head_dim,
        BLOCK_D=max(16, 1 << (head_dim - 1).bit_length()), MATCH_HF=bool(match_hf), HAS_BIAS=bias is not None)
    return q


__all__ = ["decode_attention", "rope_and_store", "rope_store_attention", "plan_chunks", "plan_splits", "pow2_block",
           "programs_wanted", "triton_usable", "triton_interpreting", "BLOCK_SLOTS"]
