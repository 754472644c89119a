"""Triton kernels of rollout/fused_sampling.py (imported only where Triton is: see that module)."""

import triton
import triton.language as tl
from triton.language.random import philox, uint_to_uniform_float


@triton.jit
def _visit(x, key, cols, best_key, best_col, best_x, running_max, running_sum):
    """Fold one quarter block (x: scaled logits, key: race keys, -inf where masked) into each lane's running state
    (elementwise: no reduction inside the loop)."""
    new_max = tl.maximum(running_max, x)
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing but -inf yet: exp(-inf - 0) = 0, not NaN
    running_sum = running_sum * tl.exp(running_max - shift) + tl.exp(x - shift)
    better = key > best_key  # strictly: a lane's earlier column keeps a tie
    best_x = tl.where(better, x, best_x)
    best_col = tl.where(better, cols, best_col)
    best_key = tl.where(better, key, best_key)
    return best_key, best_col, best_x, new_max, running_sum


@triton.jit
def _quarter(logits_row, cols, hi, u, inv_temperature, greedy):
    ok = cols < hi
    x = tl.load(logits_row + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_temperature
    gumbel = -tl.log(-tl.log(u))  # u = 0 gives -inf: never wins
    key = tl.where(greedy, x, x + gumbel)
    return x, tl.where(ok, key, float("-inf"))


@triton.jit
def split_kernel(logits_ptr, stride_row, seed_ptr, step_ptr, temperature_ptr, part_key_ptr, part_col_ptr,
                 part_x_ptr, part_max_ptr, part_sum_ptr, vocab, chunk, row_offset, row_key_ptr,
                 SPLITS: tl.constexpr, QUARTER: tl.constexpr, KEYED: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab)
    seed = tl.load(seed_ptr)
    step = tl.load(step_ptr).to(tl.uint32)
    temperature = tl.load(temperature_ptr)
    greedy = temperature == 0.0
    inv_temperature = 1.0 / tl.where(greedy, 1.0, temperature)
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    idx = tl.arange(0, QUARTER)
    zero = (idx * 0).to(tl.uint32)
    if KEYED:  # the row's own stream: its 64-bit key as two counter words (rollout.base.RowStreams)
        row_key = tl.load(row_key_ptr + row + row_offset)
        counter_row = zero + (row_key & 0xFFFFFFFF).to(tl.uint32)
        counter_key = zero + ((row_key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    else:
        counter_row = zero + (row + row_offset).to(tl.uint32)
        counter_key = zero
    best_key = tl.full([QUARTER], float("-inf"), tl.float32)
    best_col = tl.full([QUARTER], 2147483647, tl.int32)
    best_x = tl.full([QUARTER], 0.0, tl.float32)
    running_max = tl.full([QUARTER], float("-inf"), tl.float32)
    running_sum = tl.full([QUARTER], 0.0, tl.float32)
    for start in range(lo, hi, 4 * QUARTER):
        # one Philox call, four uniforms per counter: counter (vocabulary position, batch row or row key, step)
        r0, r1, r2, r3 = philox(seed, (start + idx).to(tl.uint32), counter_row, zero + step, counter_key)
        cols = start + idx
        x, key = _quarter(logits_row, cols, hi, uint_to_uniform_float(r0), inv_temperature, greedy)
        best_key, best_col, best_x, running_max, running_sum = _visit(
            x, key, cols, best_key, best_col, best_x, running_max, running_sum)
        cols = start + QUARTER + idx
        x, key = _quarter(logits_row, cols, hi, uint_to_uniform_float(r1), inv_temperature, greedy)
        best_key, best_col, best_x, running_max, running_sum = _visit(
            x, key, cols, best_key, best_col, best_x, running_max, running_sum)
        cols = start + 2 * QUARTER + idx
        x, key = _quarter(logits_row, cols, hi, uint_to_uniform_float(r2), inv_temperature, greedy)
        best_key, best_col, best_x, running_max, running_sum = _visit(
            x, key, cols, best_key, best_col, best_x, running_max, running_sum)
        cols = start + 3 * QUARTER + idx
        x, key = _quarter(logits_row, cols, hi, uint_to_uniform_float(r3), inv_temperature, greedy)
        best_key, best_col, best_x, running_max, running_sum = _visit(
            x, key, cols, best_key, best_col, best_x, running_max, running_sum)
    # the chunk's state from its lanes: log-sum-exp parts, and the race's winner (the first column among ties)
    chunk_max = tl.max(running_max, 0)
    shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
    chunk_sum = tl.sum(running_sum * tl.exp(running_max - shift), 0)
    chunk_key = tl.max(best_key, 0)
    chunk_col = tl.min(tl.where(best_key == chunk_key, best_col, 2147483647), 0)
    chunk_x = tl.sum(tl.where(best_col == chunk_col, best_x, 0.0), 0)  # lanes hold distinct columns
    at = row * SPLITS + split
    tl.store(part_key_ptr + at, chunk_key)
    tl.store(part_col_ptr + at, chunk_col)
    tl.store(part_x_ptr + at, chunk_x)
    tl.store(part_max_ptr + at, chunk_max)
    tl.store(part_sum_ptr + at, chunk_sum)


@triton.jit
def merge_kernel(part_key_ptr, part_col_ptr, part_x_ptr, part_max_ptr, part_sum_ptr, tokens_ptr, logprobs_ptr,
                 SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, SPLITS_PAD)
    ok = s < SPLITS
    at = row * SPLITS + s
    key = tl.load(part_key_ptr + at, mask=ok, other=float("-inf"))
    maxes = tl.load(part_max_ptr + at, mask=ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + at, mask=ok, other=0.0)
    overall = tl.max(maxes, 0)
    log_norm = overall + tl.log(tl.sum(sums * tl.exp(maxes - overall), 0))
    best_key = tl.max(key, 0)
    winner = tl.min(tl.where(key == best_key, s, SPLITS_PAD), 0)  # the first chunk among ties
    col = tl.sum(tl.where(s == winner, tl.load(part_col_ptr + at, mask=ok, other=0), 0), 0)
    x = tl.sum(tl.where(s == winner, tl.load(part_x_ptr + at, mask=ok, other=0.0), 0.0), 0)
    tl.store(tokens_ptr + row, col.to(tl.int64))
    tl.store(logprobs_ptr + row, x - log_norm)
