"""Triton kernels of rollout/fused_sampling.py (imported only where Triton is: see that module)."""

import triton
import triton.language as tl
from triton.language.random import philox, uint_to_uniform_float

NO_COLUMN = tl.constexpr(2147483647)  # the int32 max: "no column yet"


@triton.jit
def _scaled(logits_row, cols, vocab, inv_temperature):
    """A block of one row's logits times 1 / temperature (the trainer's arithmetic), -inf past the vocabulary."""
    return tl.load(logits_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_temperature


@triton.jit
def _inverse_temperature(temperature_ptr):
    temperature = tl.load(temperature_ptr)
    greedy = temperature == 0.0
    return 1.0 / tl.where(greedy, 1.0, temperature), greedy


@triton.jit
def chunk_kernel(logits_ptr, stride_row, temperature_ptr, part_max_ptr, part_sum_ptr, part_col_ptr, vocab,
                 CHUNKS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1, one program per (row, chunk of CHUNK vocabulary entries): the chunk's max, its sum of exp(x - max)
    and the first column holding the max, block by block (online softmax: one exp per entry)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_temperature, _ = _inverse_temperature(temperature_ptr)  # greedy or not, the chunk's max and sum are the same
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    idx = tl.arange(0, BLOCK)
    running_max = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    running_sum = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    best_col = tl.max(tl.full([BLOCK], NO_COLUMN, tl.int32), 0)
    lo = chunk * CHUNK
    for start in range(lo, tl.minimum(lo + CHUNK, vocab), BLOCK):
        cols = start + idx
        x = _scaled(logits_row, cols, vocab, inv_temperature)
        block_max = tl.max(x, 0)
        block_col = tl.min(tl.where(x == block_max, cols, NO_COLUMN), 0)  # the first among ties
        new_max = tl.maximum(running_max, block_max)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing but -inf yet: exp(-inf - 0) = 0, not NaN
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift), 0)
        best_col = tl.where(block_max > running_max, block_col, best_col)  # strictly: an earlier block keeps a tie
        running_max = new_max
    at = row * CHUNKS + chunk
    tl.store(part_max_ptr + at, running_max)
    tl.store(part_sum_ptr + at, running_sum)
    tl.store(part_col_ptr + at, best_col)


@triton.jit
def draw_kernel(logits_ptr, stride_row, seed_ptr, step_ptr, temperature_ptr, part_max_ptr, part_sum_ptr,
                part_col_ptr, tokens_ptr, logprobs_ptr, vocab, row_offset, row_key_ptr,
                CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                KEYED: tl.constexpr):
    """Pass 2, one program per row: the row's log-sum-exp from its chunks; one uniform u, and the token where the
    running sum of the probabilities first passes u (the chunk from the chunks' sums, then the entry inside it);
    greedy: the first column holding the row's max."""
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_PAD)
    ok = c < CHUNKS
    at = row * CHUNKS + c
    maxes = tl.load(part_max_ptr + at, mask=ok, other=float("-inf"))
    weights = tl.load(part_sum_ptr + at, mask=ok, other=0.0)
    overall = tl.max(maxes, 0)
    weights = weights * tl.exp(maxes - overall)  # each chunk's share of the row's sum, on the row's scale
    total = tl.sum(weights, 0)
    log_norm = overall + tl.log(total)
    inv_temperature, greedy = _inverse_temperature(temperature_ptr)
    # greedy: the first chunk holding the max, and its first column holding it
    max_chunk = tl.min(tl.where(maxes == overall, c, CHUNKS_PAD), 0)
    greedy_col = tl.sum(tl.where(c == max_chunk, tl.load(part_col_ptr + at, mask=ok, other=0), 0), 0)
    # the row's uniform: Philox counted by (batch row or row key, step), so a row draws the same in any batch
    seed = tl.load(seed_ptr)
    step = tl.load(step_ptr).to(tl.uint32)
    zero = (row * 0).to(tl.uint32)
    if KEYED:  # the row's own stream: its 64-bit key as two counter words (rollout.base.RowStreams)
        row_key = tl.load(row_key_ptr + row + row_offset)
        counter_row = (row_key & 0xFFFFFFFF).to(tl.uint32)
        counter_key = ((row_key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    else:
        counter_row = (row + row_offset).to(tl.uint32)
        counter_key = zero
    r0, _, _, _ = philox(seed, zero, counter_row, step, counter_key)
    target = uint_to_uniform_float(r0) * total
    # the chunk: the first whose running sum passes the target (rounding can leave none: the last that can be drawn)
    running = tl.cumsum(weights, 0)
    chunk = tl.min(tl.where((running > target) & (weights > 0), c, CHUNKS_PAD), 0)
    chunk = tl.where(chunk == CHUNKS_PAD, tl.max(tl.where(weights > 0, c, -1), 0), chunk)
    chunk = tl.maximum(chunk, 0)  # no chunk can be drawn: walk the first
    before = tl.sum(tl.where(c == chunk, running - weights, 0.0), 0)
    chunk_max = tl.sum(tl.where(c == chunk, maxes, 0.0), 0)
    rest = (target - before) * tl.exp(overall - chunk_max)  # what is left of the target, on the chunk's own scale
    # the entry: walk the chunk's blocks with a running sum of exp(x - chunk max)
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    idx = tl.arange(0, BLOCK)
    col = tl.max(tl.full([BLOCK], NO_COLUMN, tl.int32), 0)
    last = tl.max(tl.full([BLOCK], -1, tl.int32), 0)
    passed = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    lo = chunk * CHUNK
    for start in range(lo, tl.minimum(lo + CHUNK, vocab), BLOCK):
        cols = start + idx
        e = tl.exp(_scaled(logits_row, cols, vocab, inv_temperature) - chunk_max)
        hit = ((passed + tl.cumsum(e, 0)) > rest) & (e > 0)
        col = tl.minimum(col, tl.min(tl.where(hit, cols, NO_COLUMN), 0))
        last = tl.maximum(last, tl.max(tl.where(e > 0, cols, -1), 0))
        passed += tl.sum(e, 0)
    col = tl.where(col == NO_COLUMN, last, col)  # rounding: the target past the chunk's sum
    col = tl.where(greedy, greedy_col, col)
    col = tl.minimum(tl.maximum(col, 0), vocab - 1)  # nothing to draw (NaN or only -inf logits): stay inside the row
    x = tl.load(logits_row + col).to(tl.float32) * inv_temperature
    tl.store(tokens_ptr + row, col.to(tl.int64))
    tl.store(logprobs_ptr + row, x - log_norm)
