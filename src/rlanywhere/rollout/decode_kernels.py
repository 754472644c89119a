"""Triton kernels of rollout/decode_attention.py (imported only where Triton is: see that module)."""

import triton
import triton.language as tl


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to `dtype` as a cast rounds (to nearest even), kept in fp32. bf16 by integer arithmetic: a
    cast round trip may be folded away by the compiler, and the interpreter's cast truncates."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def split_kernel(q_ptr, k_ptr, v_ptr, starts_ptr, slot_ptr, acc_ptr, max_ptr, sum_ptr,
                 stride_qb, stride_qh, stride_qg, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                 stride_vs, kv_heads, groups, head_dim, span, chunk, scale,
                 SPLITS: tl.constexpr, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                 HALF_DOT: tl.constexpr, FP32_DOT: tl.constexpr):
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
        else:  # fp32: FP32_DOT "ieee" (exact products, FMA) or "tf32x3" (three TF32 tensor-core products each)
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=FP32_DOT)
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
            acc = acc * correction[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision=FP32_DOT)
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


@triton.jit
def rope_store_kernel(y_ptr, bias_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, stride_yb, stride_yh,
                      stride_cb, stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                      stride_vs, heads, kv_heads, head_dim, BLOCK_D: tl.constexpr, MATCH_HF: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    slot = tl.load(slot_ptr)
    x = tl.load(y_ptr + row * stride_yb + head * stride_yh + d, mask=d_ok, other=0.0)
    rolled_d = (d + head_dim // 2) % head_dim
    if HAS_BIAS:  # the projection's bias, added here instead of in the GEMM (rounded once to x's dtype)
        bias = tl.load(bias_ptr + head * head_dim + d, mask=d_ok, other=0.0).to(tl.float32)
        x = _round_to(x.to(tl.float32) + bias, x.dtype).to(x.dtype)
    if head < heads + kv_heads:  # a query or key head: rotate
        rolled = tl.load(y_ptr + row * stride_yb + head * stride_yh + rolled_d, mask=d_ok, other=0.0)
        if HAS_BIAS:
            rolled_bias = tl.load(bias_ptr + head * head_dim + rolled_d, mask=d_ok, other=0.0).to(tl.float32)
            rolled = _round_to(rolled.to(tl.float32) + rolled_bias, x.dtype).to(x.dtype)
        cos = tl.load(cos_ptr + row * stride_cb + d, mask=d_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_cb + d, mask=d_ok, other=0.0).to(tl.float32)
        # eager's rounding (llama.apply_rope): x*cos rounded; then + rolled*sin rounded (transformers) or
        # one fused multiply-add (addcmul), rounded once
        first = _round_to(x.to(tl.float32) * cos, x.dtype)
        second = rolled.to(tl.float32) * sin
        if MATCH_HF:
            second = _round_to(second, x.dtype)
        out = _round_to(first + second, x.dtype).to(x.dtype)  # exact: already rounded
        if head < heads:
            tl.store(q_ptr + row * stride_qb + head * stride_qh + d, out, mask=d_ok)
        else:
            tl.store(k_ptr + row * stride_kb + (head - heads) * stride_kh + slot * stride_ks + d, out, mask=d_ok)
    else:  # a value head: into the cache as it is
        tl.store(v_ptr + row * stride_vb + (head - heads - kv_heads) * stride_vh + slot * stride_vs + d, x,
                 mask=d_ok)
