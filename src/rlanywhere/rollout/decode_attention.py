"""Split-K decode attention (flash-decoding) as Triton kernels: FastEngine's attention where Triton runs.

One decode step asks G query heads per KV head (GQA) of every row to attend over that row's filled cache slots
[start, slot]. A fused attention kernel gives each (row, KV head) one program that walks all slots in turn, so a
decode step of few rows leaves most of the GPU idle and reads the left padding too. Here the slots are cut into
`splits` chunks, each its own program (partial softmax: running max, sum and weighted values in fp32), and a second
kernel merges the chunks. Programs skip slots outside [start, slot], so padding and unwritten slots are not read.

    out = decode_attention(q, keys, values, starts, slot, scale)   # q [B, KV, G, D], keys/values [B, KV, S, D]

Numerics follow FlashAttention: scores and softmax statistics in fp32, probabilities rounded to the value dtype
before the product with V (fp32 inputs: exact fp32 products, no TF32). The launch reads nothing from the device,
so a CUDA graph can capture it. Tests run the kernels on a CPU with Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math
import os

import torch

from ..machine import triton_usable
from ..vocabulary import ACCUMULATE_DTYPE, FP32

BLOCK_SLOTS = 64  # cache slots per inner iteration of a program
PROGRAMS_PER_SM = 4  # enough programs in flight to cover memory latency


def triton_interpreting() -> bool:
    """Triton's CPU interpreter (tests): its half-precision tl.dot is wrong, so half inputs are multiplied as
    fp32 there, exactly (a product of two half values is exact in fp32); only the summation order differs."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _build_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, starts_ptr, slot_ptr, acc_ptr, max_ptr, sum_ptr,
                     stride_qb, stride_qh, stride_qg, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                     stride_vs, kv_heads, groups, head_dim, span, chunk, scale,
                     SPLITS: tl.constexpr, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                     HALF_DOT: tl.constexpr):
        row_head = tl.program_id(0)
        split = tl.program_id(1)
        row = (row_head // kv_heads).to(tl.int64)  # 64-bit offsets: a long cache's row stride times rows > 2^31
        head = (row_head % kv_heads).to(tl.int64)
        first = tl.load(starts_ptr + row)  # the row's first real slot (left padding before it)
        last = tl.load(slot_ptr)  # the slot this step wrote: slots [first, last] are filled
        lo = tl.maximum(split * chunk, first)
        hi = tl.minimum(tl.minimum((split + 1) * chunk, last + 1), span)

        g = tl.arange(0, G_PAD)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q = tl.load(q_ptr + row * stride_qb + head * stride_qh + g[:, None] * stride_qg + d[None, :],
                    mask=(g[:, None] < groups) & d_ok[None, :], other=0.0)
        k_base = k_ptr + row * stride_kb + head * stride_kh
        v_base = v_ptr + row * stride_vb + head * stride_vh
        running_max = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
        for block in range(lo, hi, BLOCK_S):
            s = block + tl.arange(0, BLOCK_S)
            s_ok = s < hi
            k = tl.load(k_base + s[:, None] * stride_ks + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            if HALF_DOT:
                scores = tl.dot(q, tl.trans(k))
            else:  # exact fp32 products (no TF32)
                scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            scores = tl.where(s_ok[None, :], scores * scale, float("-inf"))
            # every block holds at least one filled slot (block < hi, block >= lo >= first): the max is finite
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            correction = tl.exp(running_max - new_max)
            p = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * correction + tl.sum(p, 1)
            v = tl.load(v_base + s[:, None] * stride_vs + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            p = p.to(v.dtype)  # probabilities rounded to the value dtype, as FlashAttention does
            if HALF_DOT:
                acc = acc * correction[:, None] + tl.dot(p, v)
            else:
                acc = acc * correction[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
            running_max = new_max
        out = (row_head * SPLITS + split) * G_PAD + g
        tl.store(max_ptr + out, running_max)
        tl.store(sum_ptr + out, running_sum)
        tl.store(acc_ptr + out[:, None] * BLOCK_D + d[None, :], acc)

    @triton.jit
    def merge_kernel(acc_ptr, max_ptr, sum_ptr, o_ptr, stride_ob, stride_oh, stride_og, kv_heads, groups, head_dim,
                     SPLITS: tl.constexpr, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
        row_head = tl.program_id(0)
        row = (row_head // kv_heads).to(tl.int64)
        head = (row_head % kv_heads).to(tl.int64)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, BLOCK_D)
        base = row_head * SPLITS * G_PAD
        overall = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        for split in range(SPLITS):
            overall = tl.maximum(overall, tl.load(max_ptr + base + split * G_PAD + g))
        total = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
        for split in range(SPLITS):
            at = base + split * G_PAD + g
            weight = tl.exp(tl.load(max_ptr + at) - overall)  # an empty split has max -inf: weight 0
            total += tl.load(sum_ptr + at) * weight
            acc += tl.load(acc_ptr + at[:, None] * BLOCK_D + d[None, :]) * weight[:, None]
        out = acc / total[:, None]
        tl.store(o_ptr + row * stride_ob + head * stride_oh + g[:, None] * stride_og + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=(g[:, None] < groups) & (d[None, :] < head_dim))

    return split_kernel, merge_kernel


_KERNELS = None


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _build_kernels()
    return _KERNELS


def plan_splits(rows_x_heads: int, span: int, programs_wanted: int) -> tuple[int, int]:
    """(splits, chunk): each (row, KV head) cuts the span into `splits` chunks of `chunk` slots (a multiple of
    BLOCK_SLOTS), enough programs to fill the GPU, none shorter than one block."""
    blocks = max(1, math.ceil(span / BLOCK_SLOTS))
    splits = max(1, min(blocks, math.ceil(programs_wanted / max(rows_x_heads, 1))))
    chunk = math.ceil(blocks / splits) * BLOCK_SLOTS
    return math.ceil(blocks * BLOCK_SLOTS / chunk), chunk


def _programs_wanted(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
                     slot: torch.Tensor, scale: float, splits: int | None = None) -> torch.Tensor:
    """softmax(q K^T * scale) V over each row's slots [starts[row], slot], for q [B, KV, G, D] and keys/values
    [B, KV, S, D] (any strides with a contiguous last dim: views of the cache); starts [B] and slot [1] long on the
    device. Returns [B, KV, G, D] in q's dtype. splits: chunks per (row, KV head) (default: fill the GPU)."""
    split_kernel, merge_kernel = _kernels()
    batch, kv_heads, groups, head_dim = q.shape
    span = keys.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("decode_attention: keys/values need a contiguous last dimension")
    rows_x_heads = batch * kv_heads
    if splits is None:
        splits, chunk = plan_splits(rows_x_heads, span, _programs_wanted(q.device))
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
        HALF_DOT=q.dtype != FP32 and not triton_interpreting())
    merge_kernel[(rows_x_heads,)](
        acc, maxes, sums, out, out.stride(0), out.stride(1), out.stride(2), kv_heads, groups, head_dim,
        SPLITS=splits, G_PAD=g_pad, BLOCK_D=block_d)
    return out


__all__ = ["decode_attention", "plan_splits", "triton_usable", "triton_interpreting", "BLOCK_SLOTS"]
