"""Fused sampling as Triton kernels: each row's token and its log-prob from a decode step's logits, in two short
kernels and about one read of the logits.

The torch sampler (base.sample_from_logits) makes about nine passes over the [rows, vocab] fp32 logits per decode
step (softmax, noise, divide, argmax, gather, log), each its own kernel launched from Python. Here the logits are
read once and a little: x = logit * (1 / temperature) (the trainer's arithmetic, logprobs.py) is cut into chunks of
CHUNK entries; pass 1 gives each (row, chunk) its max, its sum of exp(x - max) and the first column holding the
max (one exp per entry: the draw costs what the log-sum-exp the log-prob needs costs). Pass 2, a program per row,
merges the chunks into the row's log-sum-exp and draws by inverse transform: one uniform u per row, and the token
where the running sum of the probabilities first passes u (the chunk from the chunks' sums, then a walk through that
one chunk), which draws from softmax(x) up to fp32 rounding of the running sums (a token's share is resolved to
about 1e-7 of the row's sum). Why not a Gumbel-max race, argmax(x + noise), in one pass: it needs noise, two logs
and two exps per entry, which makes it compute-bound, at a fifth of the memory bandwidth (docs/benchmarks.md).

The uniform comes from Triton's Philox keyed by a seed and counted by (batch row, decode step), and the chunks are a
fixed size, so a row's draw depends on its logits, the seed, the step and its row alone: not on the launch, nor on
a batch sampled in two parts (`row_offset`). The seed, step and temperature are read from device tensors: a CUDA
graph captured once replays every step with fresh noise.

    sample_into(logits, seed, step, temperature, tokens_out, logprobs_out)   # logits [rows, vocab] fp32

temperature 0 is greedy (argmax, the first index among ties, log-prob of the unscaled logits), as
base.sample_from_logits does. No top-k or top-p: the scheduler uses it only for requests without them
(`Scheduler.fused_sampling_for`); the planner decides where it may run (`RolloutPlan.fused_sampling`).
Tests run the kernels on a CPU with Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math

import torch

from ..vocabulary import FP32
from .kernel_compiles import launch

BLOCK_VOCAB = 1024  # vocabulary entries per inner iteration
CHUNK = 4 * BLOCK_VOCAB  # vocabulary entries per pass-1 program: enough programs to fill a GPU at a few rows


def _kernels():
    from . import fused_sampling_kernels as kernels  # imports triton: only where the sampler runs

    return kernels.chunk_kernel, kernels.draw_kernel


def sample_into(logits: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, temperature: torch.Tensor,
                tokens_out: torch.Tensor, logprobs_out: torch.Tensor, row_offset: int = 0,
                row_keys: torch.Tensor | None = None) -> None:
    """Draw one token per row of `logits` [rows, vocab] (fp32 or half, contiguous last dim) from
    softmax(logits / temperature) into tokens_out [rows] long and its log-prob into logprobs_out [rows] fp32.
    seed [1] int64, step [1] int64 (the noise's counter: a new value each decode step), temperature [1] fp32 (0:
    greedy) live on the device; nothing is read back, so a CUDA graph can capture the call. row_offset: the batch
    row of `logits`' first row (the noise is counted by batch row: a batch sampled in parts draws what it would
    whole). row_keys: int64 [row_offset + rows] on the device (`RowStreams.keys` of the batch's rows): each row's
    noise is counted by its key instead of its batch row, so a row draws the same in any batch (`step` is then the
    response position)."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("sample_into: logits need a contiguous last dimension")
    for name, tensor, dtype in (("seed", seed, torch.int64), ("step", step, torch.int64),
                                ("temperature", temperature, FP32)):
        if tensor.dtype != dtype or tensor.numel() != 1 or tensor.device != logits.device:
            raise ValueError(f"sample_into: {name} must be a one-element {dtype} tensor on {logits.device}, got "
                             f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}")
    if rows == 0:
        return
    chunks = math.ceil(vocab / CHUNK)
    chunk_kernel, draw_kernel = _kernels()
    part = dict(device=logits.device)
    part_max, part_sum = (torch.empty(rows, chunks, dtype=FP32, **part) for _ in range(2))
    part_col = torch.empty(rows, chunks, dtype=torch.int32, **part)
    launch(chunk_kernel, (rows, chunks), logits, logits.stride(0), temperature, part_max, part_sum, part_col, vocab,
           CHUNKS=chunks, CHUNK=CHUNK, BLOCK=BLOCK_VOCAB)
    keyed = row_keys is not None
    launch(draw_kernel, (rows,), logits, logits.stride(0), seed, step, temperature, part_max, part_sum, part_col,
           tokens_out, logprobs_out, vocab, row_offset, row_keys if keyed else seed, CHUNKS=chunks,
           CHUNKS_PAD=max(2, 1 << (chunks - 1).bit_length()), CHUNK=CHUNK, BLOCK=BLOCK_VOCAB, KEYED=keyed)


__all__ = ["sample_into", "BLOCK_VOCAB", "CHUNK"]
