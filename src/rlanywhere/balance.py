"""trainer.balance_batch (verl's key, on by default): after the rollout, rows move between the data-parallel ranks
so that each holds as many rows and about as many tokens as the others.

Each rank generates the samples of its own block of prompts, and their lengths differ; without balancing, the rank
with the longer sequences runs longer log-prob passes and updates while the others wait at every collective. Every
rank gathers the per-row token counts (prompt + response), computes the same deterministic partition
(`balanced_partition`: longest rows first, each to the rank with the fewest tokens that still has room) and
receives its rows with one all-to-all per dtype (`DataParallel.exchange_rows`). Everything the rest of the step
reads per row travels with it: prompt and response ids and masks, the sampling log-probs, the score, the reward
details and the row's global group index (GRPO/RLOO groups may then span ranks: the advantages gather all rows and
group them by that index).

The losses do not depend on which rank holds a row: each loss's denominators (tokens, sequences) are summed over
all ranks before the micro-batches (`DataParallel.loss_scales`), so each row contributes the same share wherever
it is. With one process nothing happens.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .distributed import DataParallel, RowLayout
from .rollout.base import RolloutBatch
from .stepbatch import StepBatch
from .vocabulary import EXCHANGE_DTYPE

# Fields of a StepBatch computed after the rows have found their rank; balancing before them moves none of them.
_LATER_FIELDS = ("old_logprobs", "ref_logprobs", "values", "token_rewards", "advantages", "returns", "loss_mask")


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Split rows 0..len(lengths)-1 into `parts` lists of equal size with about equal sums of `lengths`.

    Greedy: rows longest first (ties: lower index first), each to the part with the smallest sum that still has
    room (ties: lower part). Each list is ascending. The same input gives the same partition on every rank."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be an int >= 1, got {parts!r}")
    if len(lengths) % parts:
        raise ValueError(f"{len(lengths)} rows cannot be split into {parts} parts of equal size")
    if any(length < 0 for length in lengths):
        raise ValueError(f"row lengths must be >= 0, got {min(lengths)}")
    room = len(lengths) // parts
    members: list[list[int]] = [[] for _ in range(parts)]
    open_parts = [(0, part) for part in range(parts)]  # (tokens so far, part): a heap of the parts with room
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, part = heapq.heappop(open_parts)
        members[part].append(row)
        if len(members[part]) < room:
            heapq.heappush(open_parts, (tokens + lengths[row], part))
    return [sorted(rows) for rows in members]


def rows_after_balancing(lengths: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """The global rows (rank-major, as the ranks hold them now: `counts[r]` rows on rank r) each rank should hold.

    The parts of `balanced_partition` go to the ranks that already hold most of their rows (fewer rows move); when
    the current layout's busiest rank has no more tokens than the balanced one's, nothing moves."""
    if sum(counts) != len(lengths):
        raise ValueError(f"{len(lengths)} row lengths for {sum(counts)} rows ({list(counts)} per rank)")
    starts = [sum(counts[:rank]) for rank in range(len(counts))]
    current = [list(range(start, start + count)) for start, count in zip(starts, counts)]
    parts = balanced_partition(lengths, len(counts))

    def busiest(layout: list[list[int]]) -> int:
        return max(sum(lengths[row] for row in rows) for rows in layout)

    if busiest(current) <= busiest(parts):
        return current
    holder = [rank for rank, count in enumerate(counts) for _ in range(count)]
    overlap = [[0] * len(counts) for _ in parts]
    for part, rows in enumerate(parts):
        for row in rows:
            overlap[part][holder[row]] += 1
    layout: list[Optional[list[int]]] = [None] * len(counts)
    placed: set[int] = set()
    for _, part, rank in sorted((-overlap[p][r], p, r) for p in range(len(parts)) for r in range(len(counts))):
        if part not in placed and layout[rank] is None:
            layout[rank] = parts[part]
            placed.add(part)
    return [rows for rows in layout if rows is not None]


def per_rank_tokens(lengths: Sequence[int], layout: Sequence[Sequence[int]]) -> list[int]:
    return [int(sum(lengths[row] for row in rows)) for rows in layout]


def balance_rows(dp: DataParallel, batch: StepBatch, pad_token_id: int) -> tuple[StepBatch, dict]:
    """This rank's rows after balancing (a new StepBatch; `dp.layout` updated) and the metrics verl logs for it:
    per-rank tokens as generated (global_seqlen/min, max, minmax_diff), after (balanced_min, balanced_max), and
    their mean. Call it right after the rollout and scoring, with `dp.set_rows` done for these rows."""
    if not dp.enabled:
        return batch, {}
    later = [name for name in _LATER_FIELDS if getattr(batch, name) is not None]
    if later:
        raise ValueError(f"balance_rows moves the rollout, scores, reward details and group index only; "
                         f"{', '.join(later)} would be left behind: balance before computing them")
    if len(dp.layout.counts) != dp.world or dp.layout.counts[dp.rank] != batch.rows:
        raise ValueError(f"dp.layout ({dp.layout.counts}) does not describe this step's {batch.rows} rows on rank "
                         f"{dp.rank}: call dp.set_rows(rows) before balance_rows")
    r = batch.rollout
    lengths = [int(v) for v in dp.gather_rows(r.prompt_mask.sum(-1) + r.response_mask.sum(-1)).tolist()]
    counts = dp.layout.counts
    starts = [sum(counts[:rank]) for rank in range(dp.world)]
    as_generated = [list(range(start, start + count)) for start, count in zip(starts, counts)]
    layout = rows_after_balancing(lengths, counts)
    tokens_before, tokens_after = per_rank_tokens(lengths, as_generated), per_rank_tokens(lengths, layout)
    metrics = {"global_seqlen/min": float(min(tokens_before)), "global_seqlen/max": float(max(tokens_before)),
               "global_seqlen/minmax_diff": float(max(tokens_before) - min(tokens_before)),
               "global_seqlen/balanced_min": float(min(tokens_after)),
               "global_seqlen/balanced_max": float(max(tokens_after)),
               "global_seqlen/mean": sum(tokens_before) / dp.world}
    if layout == as_generated:  # every rank computed the same layout: nobody sends anything
        return batch, metrics
    start, stop = dp.layout.start, dp.layout.stop
    send = [[row - start for row in rows if start <= row < stop] for rows in layout]
    receive = [sum(1 for row in layout[dp.rank] if first <= row < first + count)
               for first, count in zip(starts, counts)]
    moved = _exchange(dp, batch, send, receive, pad_token_id)
    dp.layout = RowLayout([len(rows) for rows in layout], dp.rank)
    return moved, metrics


def _exchange(dp: DataParallel, batch: StepBatch, send: list[list[int]], receive: list[int],
              pad_token_id: int) -> StepBatch:
    """The rows that arrive at this rank (rank 0's first, each rank's in order), every per-row field with them: two
    all-to-alls, one of integers (ids, masks, group index), one of numbers (log-probs, score, reward details)."""
    r = batch.rollout
    prompt_width, response_width = dp.max_ints([r.prompt_ids.shape[1], r.response_ids.shape[1]])
    # per-row reward details (acc, format, ...): the union of every rank's keys, 0.0 where a rank's reward function
    # returned none (as the reward manager fills a key missing from some results)
    info_keys = sorted({key for keys in dp.gather_objects([sorted(k for k, v in batch.reward_info.items()
                                                                  if isinstance(v, list))]) for key in keys})

    def left(t: torch.Tensor, value: int) -> torch.Tensor:
        return F.pad(t, (prompt_width - t.shape[1], 0), value=value)

    def right(t: torch.Tensor, value: float) -> torch.Tensor:
        return F.pad(t, (0, response_width - t.shape[1]), value=value)

    integers = torch.cat([left(r.prompt_ids.long(), pad_token_id), left(r.prompt_mask.long(), 0),
                          right(r.response_ids.long(), pad_token_id), right(r.response_mask.long(), 0),
                          batch.group_index.long().unsqueeze(1)], dim=1)
    numbers = torch.cat([right(r.response_logprobs.to(EXCHANGE_DTYPE), 0.0),
                         batch.scores.to(EXCHANGE_DTYPE).unsqueeze(1),
                         _reward_columns(batch.reward_info, info_keys, batch.rows)], dim=1)
    integers, numbers = dp.exchange_rows(integers, send, receive), dp.exchange_rows(numbers, send, receive)

    prompt_ids, prompt_mask, response_ids, response_mask = integers[:, :-1].split(
        [prompt_width, prompt_width, response_width, response_width], dim=1)
    rollout = RolloutBatch(prompt_ids=prompt_ids.to(r.prompt_ids.dtype),
                           prompt_mask=prompt_mask.to(r.prompt_mask.dtype),
                           response_ids=response_ids.to(r.response_ids.dtype),
                           response_mask=response_mask.to(r.response_mask.dtype),
                           response_logprobs=numbers[:, :response_width].to(r.response_logprobs.dtype),
                           num_prompts=len(integers) // r.n, n=r.n).narrowed()  # as wide as these rows need
    info = dict(batch.reward_info)  # counts such as num_errors stay with the rank that scored (summed in metrics)
    for column, key in enumerate(info_keys):
        info[key] = numbers[:, response_width + 1 + column].tolist()
    return replace(batch, rollout=rollout, group_index=integers[:, -1].to(batch.group_index.dtype),
                   scores=numbers[:, response_width].to(batch.scores.dtype), reward_info=info, metrics={})


def _reward_columns(info: dict, keys: list[str], rows: int) -> torch.Tensor:
    columns = []
    for key in keys:
        values = info.get(key, [0.0] * rows)
        if len(values) != rows:
            raise ValueError(f"reward detail {key!r} has {len(values)} values for {rows} rows")
        try:
            columns.append(torch.tensor(values, dtype=EXCHANGE_DTYPE))
        except (TypeError, ValueError) as err:
            raise ValueError(f"reward detail {key!r} holds values that are not numbers ({err}); "
                             "trainer.balance_batch moves numbers only") from None
    return torch.stack(columns, dim=1) if columns else torch.zeros((rows, 0), dtype=EXCHANGE_DTYPE)


def balance_text(enabled: bool, world: int) -> str:
    """One line for the plan and the run log of a run over `world` > 1 ranks: whether rows are balanced."""
    if enabled:
        return (f"batch balance: on (trainer.balance_batch=true): after each rollout, rows move between the {world} "
                "ranks so each trains as many rows and about as many tokens (global_seqlen/* metrics)")
    return (f"batch balance: off (trainer.balance_batch=false): each of the {world} ranks trains the rows it "
            "generated; the rank with the longer sequences sets the pace")
