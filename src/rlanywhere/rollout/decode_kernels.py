"""Triton kernels of rollout/decode_attention.py and rollout/decode_elementwise.py (imported only where Triton is:
see those modules)."""

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
def _rope(x, rolled, cos, sin, MATCH_HF: tl.constexpr):
    """x*cos + rolled*sin in x's dtype with eager's rounding (llama.apply_rope): x*cos rounded; then + rolled*sin
    rounded (transformers, MATCH_HF) or one fused multiply-add (addcmul), rounded once. cos/sin in fp32."""
    first = _round_to(x.to(tl.float32) * cos, x.dtype)
    second = rolled.to(tl.float32) * sin
    if MATCH_HF:
        second = _round_to(second, x.dtype)
    return _round_to(first + second, x.dtype).to(x.dtype)  # exact: already rounded


@triton.jit
def _attend(q, k_base, v_base, stride_ks, stride_vs, lo, hi, d, d_ok, scale, running_max, running_sum, acc,
            BLOCK_S: tl.constexpr, HALF_DOT: tl.constexpr, FP32_DOT: tl.constexpr):
    """The online softmax of q [G_PAD, BLOCK_D] over cache slots [lo, hi): the running max, sum and weighted
    values, carried in and returned (fp32)."""
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
    return running_max, running_sum, acc


@triton.jit
def _finish(running_max, running_sum, acc, acc_ptr, max_ptr, sum_ptr, o_ptr, row, head, row_head, split, g, d,
            stride_ob, stride_oh, stride_og, groups, head_dim, splits, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """One split's partial softmax into the merge kernel's buffers; with one split, the output itself (what the
    merge would compute from it: its weight is exp(0) = 1, so the same bits, one kernel fewer)."""
    if splits == 1:
        out = acc / running_sum[:, None]
        tl.store(o_ptr + row * stride_ob + head * stride_oh + g[:, None] * stride_og + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=(g[:, None] < groups) & (d[None, :] < head_dim))
    else:
        at = (row_head * splits + split) * G_PAD + g  # not `out`: both sides of a runtime if give a name one type
        tl.store(max_ptr + at, running_max)
        tl.store(sum_ptr + at, running_sum)
        tl.store(acc_ptr + at[:, None] * BLOCK_D + d[None, :], acc)


# The split count is a runtime argument that Triton does not specialize on (do_not_specialize): one compiled kernel
# serves every batch bucket and attention span, where a constant would compile one per split count, seconds of a
# cold run's CPU in its rollouts' long tails.
@triton.jit(do_not_specialize=["splits"])
def split_kernel(q_ptr, k_ptr, v_ptr, starts_ptr, slot_ptr, acc_ptr, max_ptr, sum_ptr, o_ptr,
                 stride_qb, stride_qh, stride_qg, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                 stride_vs, stride_ob, stride_oh, stride_og, kv_heads, groups, head_dim, span, chunk, scale, splits,
                 G_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
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
    running_max, running_sum, acc = _attend(
        q, k_ptr + row * stride_kb + head * stride_kh, v_ptr + row * stride_vb + head * stride_vh, stride_ks,
        stride_vs, lo, hi, d, d_ok, scale, tl.full([G_PAD], float("-inf"), dtype=tl.float32),
        tl.zeros([G_PAD], dtype=tl.float32), tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32), BLOCK_S, HALF_DOT,
        FP32_DOT)
    _finish(running_max, running_sum, acc, acc_ptr, max_ptr, sum_ptr, o_ptr, row, head, row_head, split, g, d,
            stride_ob, stride_oh, stride_og, groups, head_dim, splits, G_PAD, BLOCK_D)


@triton.jit(do_not_specialize=["splits"])
def rope_attend_kernel(y_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, starts_ptr, slot_ptr, acc_ptr, max_ptr, sum_ptr,
                       o_ptr, stride_yb, stride_yh, stride_cb, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                       stride_vs, stride_ob, stride_oh, stride_og, heads, kv_heads, groups, head_dim, span, chunk,
                       scale, splits, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_S: tl.constexpr, HALF_DOT: tl.constexpr, MATCH_HF: tl.constexpr):
    """split_kernel that starts from the QKV projection y [B, heads + 2 KV, D] of this step's token: it rotates
    its queries itself, and the program whose chunk holds this step's slot rotates the key, writes key and value
    into the cache there and starts its softmax from them (from registers; the cache slots before the new one come
    from memory). The new slot goes first so that only the softmax state lives across the loop over the cache:
    fewer registers, more programs per SM."""
    row_head = tl.program_id(0)
    split = tl.program_id(1)
    row = (row_head // kv_heads).to(tl.int64)
    head = (row_head % kv_heads).to(tl.int64)
    first = tl.load(starts_ptr + row)
    last = tl.load(slot_ptr)
    lo = tl.maximum(split * chunk, first)
    hi = tl.minimum(tl.minimum((split + 1) * chunk, last), span)  # the cached slots, up to this step's

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    rolled_d = (d + head_dim // 2) % head_dim
    cos = tl.load(cos_ptr + row * stride_cb + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_cb + d, mask=d_ok, other=0.0).to(tl.float32)
    y_row = y_ptr + row * stride_yb
    q_at = y_row + (head * groups + g[:, None]) * stride_yh
    q_ok = (g[:, None] < groups) & d_ok[None, :]
    q = _rope(tl.load(q_at + d[None, :], mask=q_ok, other=0.0), tl.load(q_at + rolled_d[None, :], mask=q_ok,
                                                                         other=0.0), cos[None, :], sin[None, :],
              MATCH_HF)
    k_at = y_row + (heads + head) * stride_yh
    key = _rope(tl.load(k_at + d, mask=d_ok, other=0.0), tl.load(k_at + rolled_d, mask=d_ok, other=0.0), cos, sin,
                MATCH_HF)
    value = tl.load(y_row + (heads + kv_heads + head) * stride_yh + d, mask=d_ok, other=0.0)
    k_base = k_ptr + row * stride_kb + head * stride_kh
    v_base = v_ptr + row * stride_vb + head * stride_vh
    holds_new = (split * chunk <= last) & (last < (split + 1) * chunk)  # this program's chunk holds the new slot
    if holds_new:
        tl.store(k_base + last * stride_ks + d, key, mask=d_ok)
        tl.store(v_base + last * stride_vs + d, value, mask=d_ok)
    # the softmax over the new slot alone: max = its score, sum = exp(0) = 1, weighted values = its value
    score = tl.sum(q.to(tl.float32) * key.to(tl.float32)[None, :], 1) * scale
    running_max = tl.where(holds_new, score, float("-inf"))
    running_sum = tl.zeros([G_PAD], dtype=tl.float32) + tl.where(holds_new, 1.0, 0.0)
    acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32) + tl.where(holds_new, value.to(tl.float32), 0.0)[None, :]
    running_max, running_sum, acc = _attend(
        q, k_base, v_base, stride_ks, stride_vs, lo, hi, d, d_ok, scale, running_max, running_sum, acc, BLOCK_S,
        HALF_DOT, "ieee")
    _finish(running_max, running_sum, acc, acc_ptr, max_ptr, sum_ptr, o_ptr, row, head, row_head, split, g, d,
            stride_ob, stride_oh, stride_og, groups, head_dim, splits, G_PAD, BLOCK_D)


@triton.jit(do_not_specialize=["splits"])
def merge_kernel(acc_ptr, max_ptr, sum_ptr, o_ptr, stride_ob, stride_oh, stride_og, kv_heads, groups, head_dim,
                 splits, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    row_head = tl.program_id(0)
    row = (row_head // kv_heads).to(tl.int64)
    head = (row_head % kv_heads).to(tl.int64)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    base = row_head * splits * G_PAD
    overall = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    for split in range(splits):
        overall = tl.maximum(overall, tl.load(max_ptr + base + split * G_PAD + g))
    total = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
    for split in range(splits):
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
        out = _rope(x, rolled, cos, sin, MATCH_HF)
        if head < heads:
            tl.store(q_ptr + row * stride_qb + head * stride_qh + d, out, mask=d_ok)
        else:
            tl.store(k_ptr + row * stride_kb + (head - heads) * stride_kh + slot * stride_ks + d, out, mask=d_ok)
    else:  # a value head: into the cache as it is
        tl.store(v_ptr + row * stride_vb + (head - heads - kv_heads) * stride_vh + slot * stride_vs + d, x,
                 mask=d_ok)


@triton.jit
def add_rms_norm_kernel(h_ptr, delta_ptr, tokens_ptr, weight_ptr, h_out_ptr, x_out_ptr, stride_h, stride_delta,
                        stride_h_out, stride_x, hidden, eps, HAS_DELTA: tl.constexpr, GATHER: tl.constexpr,
                        MATCH_HF: tl.constexpr, BLOCK: tl.constexpr):
    """One row: h (+ delta, rounded to h's dtype) into h_out, and its RMSNorm times the weight into x_out, rounded
    as llama.rms_norm rounds. GATHER: h is the embedding table and the row is tokens[row] (the first layer)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    if GATHER:
        source = tl.load(tokens_ptr + row).to(tl.int64)
    else:
        source = row
    h = tl.load(h_ptr + source * stride_h + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=ok, other=0.0)
        h = _round_to(h.to(tl.float32) + delta.to(tl.float32), h.dtype).to(h.dtype)
    if HAS_DELTA or GATHER:
        tl.store(h_out_ptr + row * stride_h_out + cols, h, mask=ok)
    value = h.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(value * value, 0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if MATCH_HF:  # normalised and rounded, then times the weight (transformers)
        x = _round_to(weight * _round_to(value * inverse_rms, h.dtype), h.dtype)
    else:  # the weight inside the norm, one rounding
        x = _round_to(value * inverse_rms * weight, h.dtype)
    tl.store(x_out_ptr + row * stride_x + cols, x.to(h.dtype), mask=ok)


@triton.jit
def silu_mul_kernel(y_ptr, out_ptr, stride_y, stride_out, inter, BLOCK: tl.constexpr):
    """SiLU(gate) * up for one row's block, gate = y[:inter] and up = y[inter:] (the fused gate/up GEMM's output),
    each product rounded as eager rounds (SiLU rounded to the dtype, then the product)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0)
    up = tl.load(y_ptr + row * stride_y + inter + cols, mask=ok, other=0.0)
    value = gate.to(tl.float32)
    silu = _round_to(value / (1.0 + tl.exp(-value)), gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, _round_to(silu * up.to(tl.float32), gate.dtype).to(gate.dtype),
             mask=ok)
