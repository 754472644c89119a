"""Fused sampling as Triton kernels: one pass over a decode step's logits gives each row its token and log-prob.

The torch sampler (base.sample_from_logits) makes about nine passes over the [rows, vocab] fp32 logits per decode
step (softmax, noise, divide, argmax, gather, log), each its own kernel launched from Python: 0.41 ms of a 2.6 ms
step at 256 rows of a 49k vocabulary. Here the logits are read once. Each (row, vocabulary chunk) program keeps a
running max and sum of exp (the log-sum-exp) and a running winner of the Gumbel-max race, argmax(x + G) with
G = -log(-log(U)) and x = logit * (1 / temperature) (the trainer's arithmetic, logprobs.py), which draws exactly
from softmax(x); a second kernel merges the chunks of a row. The uniform draws come from Triton's Philox keyed by a
seed and counted by (vocabulary position, batch row, decode step), so they depend on neither the chunking nor the
launch (nor on a batch sampled in two parts: `row_offset`), and the seed, step and temperature are read from device
tensors: a CUDA graph captured once replays every step with fresh noise.

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
from .decode_attention import plan_chunks, programs_wanted

BLOCK_VOCAB = 1024  # vocabulary entries per inner iteration (four quarters, one Philox call for all four)


def _kernels():
    from . import fused_sampling_kernels as kernels  # imports triton: only where the sampler runs

    return kernels.split_kernel, kernels.merge_kernel


def plan_vocab_splits(rows: int, vocab: int, programs_wanted: int) -> tuple[int, int]:
    """`plan_chunks` of each row's vocabulary in blocks of BLOCK_VOCAB entries."""
    return plan_chunks(rows, vocab, BLOCK_VOCAB, programs_wanted)


def sample_into(logits: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, temperature: torch.Tensor,
                tokens_out: torch.Tensor, logprobs_out: torch.Tensor, splits: int | None = None,
                row_offset: int = 0, row_keys: torch.Tensor | None = None) -> None:
    """Draw one token per row of `logits` [rows, vocab] (fp32 or half, contiguous last dim) from
    softmax(logits / temperature) into tokens_out [rows] long and its log-prob into logprobs_out [rows] fp32.
    seed [1] int64, step [1] int64 (the noise's counter: a new value each decode step), temperature [1] fp32 (0:
    greedy) live on the device; nothing is read back, so a CUDA graph can capture the call. splits: vocabulary
    chunks per row (default: fill the GPU); the result does not depend on it. row_offset: the batch row of
    `logits`' first row (the noise is counted by batch row: a batch sampled in parts draws what it would whole).
    row_keys: int64 [row_offset + rows] on the device (`RowStreams.keys` of the batch's rows): each row's noise is
    counted by its key instead of its batch row, so a row draws the same in any batch (`step` is then the response
    position)."""
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
    if splits is None:
        splits, chunk = plan_vocab_splits(rows, vocab, programs_wanted(logits.device))
    else:
        chunk = math.ceil(vocab / splits / BLOCK_VOCAB) * BLOCK_VOCAB
        splits = math.ceil(vocab / chunk)
    split_kernel, merge_kernel = _kernels()
    part = dict(device=logits.device)
    part_key = torch.empty(rows, splits, dtype=FP32, **part)
    part_col = torch.empty(rows, splits, dtype=torch.int32, **part)
    part_x, part_max, part_sum = (torch.empty(rows, splits, dtype=FP32, **part) for _ in range(3))
    keyed = row_keys is not None
    split_kernel[(rows, splits)](logits, logits.stride(0), seed, step, temperature, part_key, part_col, part_x,
                                 part_max, part_sum, vocab, chunk, row_offset, row_keys if keyed else seed,
                                 SPLITS=splits, QUARTER=BLOCK_VOCAB // 4, KEYED=keyed)
    merge_kernel[(rows,)](part_key, part_col, part_x, part_max, part_sum, tokens_out, logprobs_out,
                          SPLITS=splits, SPLITS_PAD=max(2, 1 << (splits - 1).bit_length()))


__all__ = ["sample_into", "plan_vocab_splits", "BLOCK_VOCAB"]
