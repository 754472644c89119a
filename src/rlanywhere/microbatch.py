"""Micro-batching for the training and log-prob passes, and padding removal for one micro-batch.

* ``split_fixed``: consecutive groups of ``micro_batch_size`` rows.
* ``split_rows_by_length``: groups of ``micro_batch_size`` rows of a RolloutBatch, rows of similar compacted
  length together, so each micro-batch pads only to its own longest row (the update's default).
* ``split_by_token_budget``: verl's ``use_dynamic_bsz`` idea: groups of rows whose padded cost
  (rows x longest row in the group) stays within ``max_tokens``, packed by sorting rows by length.
  ``split_rows_by_token_budget`` does the same from a RolloutBatch's masks, with the exact cost of a compacted
  micro-batch (rows x (longest prompt + longest response)), which is what ``compact_rows`` produces.
* ``compact_rows``: the [b, P' + R'] training inputs for some rows of a RolloutBatch, with the columns that are
  padding in every selected row removed (left side of prompts, right side of responses), so a micro-batch of short
  sequences costs only its own length.
* ``pack_rows``: the update's layout: each row's prompt and response from column 0, padding after them; no
  attention mask needed (SDPA's flash kernel where it runs), and no wider than ``compact_rows``.
* ``select_response`` / ``scatter_back``: move per-token tensors between the full [B, R] layout and a
  micro-batch's [b, R'] layout.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Sequence

import torch

from .logprobs import default_position_ids


def split_fixed(num_rows: int, micro_batch_size: int) -> list[list[int]]:
    """Row indices 0..num_rows-1 in consecutive groups of ``micro_batch_size`` (the last may be smaller)."""
    if not (isinstance(micro_batch_size, int) and micro_batch_size > 0):
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    starts = range(0, num_rows, micro_batch_size)
    return [list(range(start, min(start + micro_batch_size, num_rows))) for start in starts]


def split_rows_by_length(prompt_mask: torch.Tensor, response_mask: torch.Tensor,
                         micro_batch_size: int) -> list[list[int]]:
    """Groups of ``micro_batch_size`` row positions (the last may be smaller), rows sorted longest first by their
    compacted length (prompt extent + response extent) before grouping: as many micro-batches as ``split_fixed``,
    but each pads only to its own longest row. Indices inside a group are ascending; every row appears once."""
    if not (isinstance(micro_batch_size, int) and micro_batch_size > 0):
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    lengths = (_prompt_extent(prompt_mask) + _response_extent(response_mask)).tolist()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep index order
    return [sorted(order[start:start + micro_batch_size]) for start in range(0, len(order), micro_batch_size)]


def _greedy_pack(parts: Sequence[tuple[int, ...]], max_tokens: int) -> list[list[int]]:
    """Pack rows into groups costing ``len(group) * sum(max of each length part over the group)`` <= max_tokens.

    ``parts[i]`` are row i's lengths (one part for a plain length; prompt and response for a RolloutBatch row,
    whose compacted width is longest prompt + longest response). Rows are walked longest first and a new group
    starts whenever adding a row would break the budget.
    """
    order = sorted(range(len(parts)), key=lambda i: -sum(parts[i]))  # stable: ties keep index order
    groups: list[list[int]] = []
    current: list[int] = []
    current_max: tuple[int, ...] = ()
    oversized: list[int] = []
    for row in order:
        if current:
            widened = tuple(max(a, b) for a, b in zip(current_max, parts[row]))
            if (len(current) + 1) * sum(widened) <= max_tokens:
                current.append(row)
                current_max = widened
                continue
            groups.append(current)
        current, current_max = [row], parts[row]
        if sum(current_max) > max_tokens:
            oversized.append(row)
            groups.append(current)
            current, current_max = [], ()
    if current:
        groups.append(current)
    if oversized:
        longest = max(sum(parts[row]) for row in oversized)
        warnings.warn(
            f"{len(oversized)} row(s) (e.g. row {oversized[0]}, up to {longest} tokens) are longer than the "
            f"micro-batch token budget of {max_tokens}; each gets a micro-batch of its own. Raise "
            "max_token_len_per_micro_batch to at least the longest prompt + response to silence this",
            stacklevel=3,
        )
    return [sorted(group) for group in groups]


def _check_budget(max_tokens):
    if not (isinstance(max_tokens, int) and max_tokens > 0):
        raise ValueError(f"max_tokens (max_token_len_per_micro_batch) must be a positive int, got {max_tokens!r}")


def split_by_token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Groups of row indices whose padded cost ``len(group) * max(lengths[group])`` stays <= ``max_tokens``.

    Rows are packed longest first, so rows of similar length share a group. Every index appears exactly once;
    a row longer than the budget gets a group of its own (with a warning) rather than being dropped.
    Groups come longest first; indices inside a group are ascending.
    """
    _check_budget(max_tokens)
    lengths = [int(length) for length in lengths]
    if any(length < 0 for length in lengths):
        raise ValueError(f"lengths must be >= 0, got {min(lengths)}")
    return _greedy_pack([(length,) for length in lengths], max_tokens)


def split_rows_by_token_budget(
    prompt_mask: torch.Tensor, response_mask: torch.Tensor, max_tokens: int, packed: bool = False
) -> list[list[int]]:
    """Token-budget groups for a RolloutBatch, costed exactly as the micro-batches will be built.

    A compacted micro-batch (``compact_rows``) is ``rows x (longest prompt + longest response)`` wide (prompts
    left-padded, responses right-padded), which can exceed ``rows x longest(prompt + response)``, the width of a
    packed one (``packed=True``: ``pack_rows``, the update's layout), so packed groups may hold more rows.
    """
    _check_budget(max_tokens)
    prompt_lens = _prompt_extent(prompt_mask).tolist()
    response_lens = response_lengths(response_mask)
    if packed:
        return _greedy_pack([(p + r,) for p, r in zip(prompt_lens, response_lens)], max_tokens)
    return _greedy_pack(list(zip(prompt_lens, response_lens)), max_tokens)


def response_lengths(response_mask: torch.Tensor) -> list[int]:
    """Per row: the response columns a training micro-batch keeps, 1 + index of the last real token, at least 1
    (every layout keeps a response column for every row)."""
    return _response_extent(response_mask).clamp(min=1).tolist()


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple` (micro-batch widths for compiled passes)."""
    return -(-value // multiple) * multiple


def _response_extent(response_mask: torch.Tensor) -> torch.Tensor:
    """Per row: 1 + index of the last real response token (0 for an empty response)."""
    columns = torch.arange(1, response_mask.shape[-1] + 1, device=response_mask.device)
    return (response_mask.bool() * columns).amax(-1) if response_mask.shape[-1] else response_mask.sum(-1)


def _prompt_extent(prompt_mask: torch.Tensor) -> torch.Tensor:
    """Per row: number of columns from the first real prompt token to the end (0 for an empty prompt)."""
    width = prompt_mask.shape[-1]
    columns = torch.arange(width, 0, -1, device=prompt_mask.device)  # column c -> width - c
    return (prompt_mask.bool() * columns).amax(-1)


class MicroBatch(NamedTuple):
    """Inputs of one compacted micro-batch; ``response_len`` is R', the kept response columns."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_len: int


def _as_index(rows, device) -> torch.Tensor:
    index = torch.as_tensor(rows, dtype=torch.long, device=device).reshape(-1)
    if index.numel() == 0:
        raise ValueError("rows is empty: a micro-batch needs at least one row")
    return index


def _checked_rows(prompt_ids, prompt_mask, response_ids, response_mask, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, prompt length per row) for a micro-batch of a RolloutBatch, after checking the shapes and that
    every row has a prompt token (the first response token's log-prob needs one before it)."""
    if prompt_ids.shape != prompt_mask.shape or response_ids.shape != response_mask.shape:
        raise ValueError(
            "ids and masks must have the same shapes: prompt "
            f"{tuple(prompt_ids.shape)} vs {tuple(prompt_mask.shape)}, response "
            f"{tuple(response_ids.shape)} vs {tuple(response_mask.shape)}"
        )
    if prompt_ids.shape[0] != response_ids.shape[0]:
        raise ValueError(f"prompt and response row counts differ: {prompt_ids.shape[0]} vs {response_ids.shape[0]}")
    if response_ids.shape[1] == 0:
        raise ValueError("response_ids has no columns; a RolloutBatch always has at least one response column")
    index = _as_index(rows, prompt_ids.device)
    prompt_lens = _prompt_extent(prompt_mask[index])
    if int(prompt_lens.min()) == 0:
        raise ValueError(
            f"rows {index[prompt_lens == 0].tolist()} have no prompt tokens at all; the first response token needs "
            "at least one prompt token before it"
        )
    return index, prompt_lens


def compact_rows(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    rows: Sequence[int] | torch.Tensor,
    pad_token_id: int,
) -> MicroBatch:
    """Training inputs for ``rows`` of a RolloutBatch with all-padding columns removed.

    Prompt columns left of the earliest real prompt token among the rows and response columns right of the last
    real response token among the rows are dropped. Returns (input_ids, attention_mask, position_ids,
    response_len) where the last ``response_len`` = R' columns are ``response_ids[rows][:, :R']``, aligned with
    ``response_mask[rows][:, :R']`` (see ``select_response`` / ``scatter_back``). Masked-out positions hold
    ``pad_token_id`` so every id is a valid label. At least one response column is kept.
    """
    index, prompt_lens = _checked_rows(prompt_ids, prompt_mask, response_ids, response_mask, rows)
    sub_prompt_mask = prompt_mask[index]
    sub_response_mask = response_mask[index]
    prompt_width = int(prompt_lens.max())
    response_width = max(int(_response_extent(sub_response_mask).max()), 1)
    start = prompt_mask.shape[1] - prompt_width
    prompt_part_mask = sub_prompt_mask[:, start:]
    response_part_mask = sub_response_mask[:, :response_width]
    attention_mask = torch.cat([prompt_part_mask, response_part_mask], dim=1).long()
    input_ids = torch.cat([prompt_ids[index][:, start:], response_ids[index][:, :response_width]], dim=1)
    input_ids = input_ids.masked_fill(attention_mask == 0, pad_token_id)
    position_ids = default_position_ids(attention_mask)
    return MicroBatch(input_ids, attention_mask, position_ids, response_width)


class PackedMicroBatch(NamedTuple):
    """Inputs of one micro-batch with every row's tokens from column 0 (``pack_rows``): row i's response starts at
    column ``response_start[i]``; ``response_len`` is R', the longest response kept."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_len: int
    response_start: torch.Tensor


def pack_rows(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    rows: Sequence[int] | torch.Tensor,
    pad_token_id: int,
    width_multiple: int = 1,
) -> PackedMicroBatch:
    """Training inputs for ``rows`` of a RolloutBatch with each row's prompt and response side by side from column 0
    and the padding after them: [b, W] with W = the longest prompt + response among the rows (``compact_rows``
    pads to the longest prompt plus the longest response, which is wider when long prompts meet long responses),
    rounded up to a multiple of ``width_multiple`` (plan.micro_batch_width_multiple: compiled passes).

    No row has padding before a real token, so a causal mask alone is right for every real token: the model needs no
    attention mask, and SDPA can take its flash kernel (it takes none with a mask). Padding queries at the end see
    only the tokens before them; their outputs are never read. ``response_start[i]`` = row i's prompt length;
    ``response_len`` = R' as in ``compact_rows``, so per-token tensors are the same [b, R'] slices
    (``select_response``). The response mask must be a prefix (real tokens, then padding), as rollouts build it."""
    index, prompt_lens = _checked_rows(prompt_ids, prompt_mask, response_ids, response_mask, rows)
    response_lens = _response_extent(response_mask[index])
    response_width = max(int(response_lens.max()), 1)
    width = int((prompt_lens + response_lens.clamp(min=1)).max())  # a response column for every row
    width = round_up(width, width_multiple)
    # in [left-padded prompt | response], row i's tokens are one run from column P - p_i: read W columns from there
    sequences = torch.cat([prompt_ids[index], response_ids[index]], dim=1)
    columns = prompt_ids.shape[1] - prompt_lens[:, None] + torch.arange(width, device=prompt_ids.device)
    real = torch.arange(width, device=prompt_ids.device) < (prompt_lens + response_lens)[:, None]
    input_ids = sequences.gather(1, columns.clamp(max=sequences.shape[1] - 1)).masked_fill(~real, pad_token_id)
    position_ids = torch.arange(width, device=prompt_ids.device).expand(index.numel(), width)
    return PackedMicroBatch(input_ids, real.long(), position_ids, response_width, prompt_lens)


def select_response(tensor: torch.Tensor, rows: Sequence[int] | torch.Tensor, response_len: int) -> torch.Tensor:
    """``tensor[rows][:, :response_len]``: a [B, R] per-token tensor (advantages, old log-probs, mask) for a
    compacted micro-batch."""
    return tensor[_as_index(rows, tensor.device)][:, :response_len]


def scatter_back(target: torch.Tensor, rows: Sequence[int] | torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Write a micro-batch's [b, R'] ``values`` into ``target[rows, :R']`` in place (columns past R' are left as
    they are: the caller initialises ``target``, e.g. with zeros) and return ``target``."""
    index = _as_index(rows, target.device)
    if values.dim() != 2 or values.shape[0] != index.numel() or values.shape[1] > target.shape[1]:
        raise ValueError(
            f"values must be [len(rows), R'] = [{index.numel()}, <= {target.shape[1]}], got {tuple(values.shape)}"
        )
    target[index, : values.shape[1]] = values.to(target.dtype)
    return target
