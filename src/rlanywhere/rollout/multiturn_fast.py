"""Multi-turn rollouts inside FastEngine's waves: a row continues in its own KV cache, its history never prefilled
again.

The wave decodes step by step as a single-turn wave does (same prefill, CUDA graphs, compaction of finished rows).
The host looks at every step's tokens, one step behind the GPU: it launches decode step t, then reads step t-1's
tokens (copied into pinned host memory right after step t-1, behind a CUDA event) while step t computes. A row
whose turn ended with EOS and holds tool calls has them executed (every such row of the step in parallel threads),
and the rendered tool messages become the row's next inputs: from step t on, the row's sampled token is replaced by
the next tool token (a device-side table, written once per turn end), so the decode steps write the tool tokens'
keys and values into the row's cache one step after another, while the other rows of the wave go on sampling. The
override of step t only has to be known before step t's token is fed back, which is why the look can lag. The
model's next turn then starts right after the last tool token. Tool tokens get mask 0 and log-prob 0.
A turn also ends where it ends with one of `rollout.stop`'s strings (as each turn of the re-prefill driver does):
its calls run and the model goes on, or, without calls, the row ends there.

The look is one vectorized test for EOS on the host copy; only rows whose turn ended get Python work (their tokens
are appended to their history then, from the host copy). Stop strings, when set, are checked row by row at every
step. A row that finished is still decoded at the step already in flight (its token is dropped) and leaves the
batch when the wave is compacted after that step.

Every turn of every row stays in the wave's lockstep slots, so nothing about the cache or the graphs changes; a tool
result costs one decode step per token (no prompt-sized re-prefill), and the wave waits for the tools of a step (a
calculator call is microseconds; slow tools hold the wave: the re-prefill driver in multiturn.py runs them between
turns instead).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import (RolloutBatch, RowStreams, SamplingParams, StopStringMatcher, chunk_generator, left_pad,
                   prompt_chunks, resolve_generator, sample_from_logits)
from .scheduler import RequestOutputs, StopRule, WaveUnit, plan_waves


def fast_multiturn_generate(driver: Any, engine: Any, rows: list, prompts: list[list[int]], params: SamplingParams,
                            generator: Any, rows_per_wave: int | None) -> RolloutBatch:
    """The rows' multi-turn responses, generated in `engine`'s waves (rows: the driver's row states, row i*n+j)."""
    n, budget, device = params.n, params.max_new_tokens, engine.device
    total_rows = len(prompts) * n
    requested = rows_per_wave if rows_per_wave is not None else engine.rollout.rows_per_wave
    chunks = prompt_chunks(len(prompts), n, requested)
    wave_rows = total_rows if requested is None else min(total_rows, requested)
    out = RequestOutputs.empty(budget, total_rows, engine.pad_token_id, device)
    feed = ToolFeed(budget, total_rows + 1, device)
    lengths = [budget] * total_rows
    # RowStreams: each row draws from its own stream through all its turns (counted by response position)
    keys = generator.keys(len(prompts), n, device) if isinstance(generator, RowStreams) else None
    shared = resolve_generator(None, params.seed, device) if generator is None or keys is not None else None
    engine.sync_weights()
    for chunk in chunks:
        gen = shared or resolve_generator(chunk_generator(generator, chunk.start), params.seed, device)
        for wave in plan_waves(chunk, n, wave_rows):
            _Wave(driver, engine, rows, params, out, feed, lengths, wave).run(prompts, gen, keys)
    tokens, logprobs = out.tokens[:, :total_rows].T.cpu(), out.logprobs[:, :total_rows].T.cpu()
    generated = (~feed.forced[:, :total_rows].T).long()
    width = max(max(lengths), 1)
    within = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    mask = generated[:, :width] * within
    pad = engine.pad_token_id
    response_ids = torch.where(within.bool(), tokens[:, :width], torch.full_like(tokens[:, :width], pad))
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], pad)
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, mask, logprobs[:, :width] * mask, len(prompts), n)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without stalling the host (pinned, so the copy is truly asynchronous)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class ToolFeed:
    """The tool tokens rows feed instead of their sampled tokens: a device table [steps, rows] (-1: keep the sampled
    token) read by every decode step without the host, and its host mirror `forced` (mask 0 there)."""

    def __init__(self, steps: int, rows: int, device: torch.device):
        self.table = torch.full((steps, rows), -1, dtype=torch.long, device=device)
        self.forced = torch.zeros((steps, rows), dtype=torch.bool)
        self.until = 0  # no step from here on has a tool token
        self.device = device
        self._pending: list[tuple[int, int, list[int]]] = []

    def queue(self, row: int, first_step: int, ids: list[int]) -> None:
        """Row `row` feeds `ids` at steps first_step, first_step + 1, ... (written by the next `flush`)."""
        self._pending.append((row, first_step, ids))
        self.forced[first_step:first_step + len(ids), row] = True
        self.until = max(self.until, first_step + len(ids))

    def flush(self) -> None:
        """The queued tokens into the device table, in one copy."""
        if not self._pending:
            return
        steps = [s for row, first, ids in self._pending for s in range(first, first + len(ids))]
        rows = [row for row, _, ids in self._pending for _ in ids]
        values = [v for _, _, ids in self._pending for v in ids]
        self._pending = []
        index = _to_device(torch.tensor([steps, rows], dtype=torch.long), self.device)
        self.table.index_put_((index[0], index[1]), _to_device(torch.tensor(values, dtype=torch.long), self.device))

    def apply(self, step: int, row_map: torch.Tensor, tokens: torch.Tensor,
              logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s tokens of the batch rows `row_map` with the tool tokens in place (log-prob 0 there)."""
        if step >= self.until:
            return tokens, logprobs
        fed = self.table[step].index_select(0, row_map)
        is_fed = fed >= 0
        return torch.where(is_fed, fed, tokens), logprobs.masked_fill(is_fed, 0.0)


class HostHistory:
    """The wave's tokens of every step, copied to (pinned) host memory right after the step, without waiting:
    `at(step)` waits for that step's copy only."""

    def __init__(self, steps: int, first_row: int, rows: int, device: torch.device):
        self.first_row, self.rows = first_row, rows
        self.cuda = device.type == "cuda"
        self.tokens = torch.empty((steps, rows), dtype=torch.long, pin_memory=self.cuda)
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else []  # steps t and t-1 in flight

    def push(self, step: int, out: RequestOutputs) -> None:
        self.tokens[step].copy_(out.tokens[step, self.first_row:self.first_row + self.rows], non_blocking=self.cuda)
        if self.cuda:
            self._events[step % 2].record()

    def at(self, step: int) -> torch.Tensor:
        if self.cuda:
            self._events[step % 2].synchronize()
        return self.tokens[step]

    def of_row(self, row: int, start: int, end: int) -> list[int]:
        """Row `row`'s tokens of steps [start, end) (steps already read with `at`)."""
        return self.tokens[start:end, row - self.first_row].tolist()


def _row_range(wave: list[WaveUnit], n: int) -> tuple[int, int]:
    """(first row, row count) of a wave: plan_waves packs whole prompts in order, so its rows are consecutive."""
    rows = [u.prompt * n + u.first_sample + j for u in wave for j in range(u.count)]
    if rows != list(range(rows[0], rows[0] + len(rows))):
        raise RuntimeError(f"a multi-turn wave's rows must be consecutive, got {rows}")
    return rows[0], len(rows)


class _Wave:
    """One wave of multi-turn rows (see the module docstring)."""

    def __init__(self, driver, engine, rows: list, params: SamplingParams, out: RequestOutputs, feed: ToolFeed,
                 lengths: list[int], wave: list[WaveUnit]):
        self.driver, self.engine, self.rows, self.params = driver, engine, rows, params
        self.out, self.feed, self.lengths, self.wave = out, feed, lengths, wave
        self.runner, self.budget = engine.runner, params.max_new_tokens
        self.first_row, count = _row_range(wave, params.n)
        self.history = HostHistory(self.budget, self.first_row, count, engine.device)
        self.open = torch.ones(count, dtype=torch.bool)  # the wave's rows still generating
        self.eos = torch.tensor(sorted(set(engine.eos_ids)) or [-1], dtype=torch.long)
        # rollout.stop: checked on the row's current turn at every look (the re-prefill driver's turns stop there too)
        self.stop_strings = StopStringMatcher(driver.tokenizer, tuple(params.stop_strings or ()))
        self.finished = False  # a row finished since the last compaction

    def run(self, prompts: list[list[int]], gen: torch.Generator, row_keys: torch.Tensor | None = None) -> None:
        """row_keys (`RowStreams.keys` of the request's rows, on the device): each row samples from its own stream
        at its response position, instead of from `gen`."""
        scheduler, runner, params = self.engine.scheduler, self.runner, self.params
        no_stop = StopRule.of([], StopStringMatcher(None, ()), self.engine.device)  # turns end on the host's look
        state = scheduler._prefill(self.wave, prompts, params, gen, self.out, no_stop, row_keys)
        self.state, self.row_map = state, state.row_map.tolist()
        fused = scheduler.fused_sampling_for(params)
        if fused:  # the runner keeps the batch's keys beside its rows (compacted with them)
            seed = torch.randint(0, 2**62, (1,), generator=gen, device=gen.device, dtype=torch.long)
            runner.set_sampling(seed.to(runner.device), params.temperature,
                                None if row_keys is None else row_keys[state.row_map])
        self.history.push(0, self.out)
        for t in range(1, self.budget):
            if fused:
                tok, logp = runner.decode_sample(state.batch, state.slot(t), position=t)
            else:
                logits = runner.decode_step(state.batch, state.slot(t))
            self._look(t - 1)  # while step t computes
            if not self.open.any():
                return
            if not fused:  # drawn after the look: a wave that just ended draws nothing more from `gen`
                tok, logp = sample_from_logits(logits, params, gen,
                                               None if row_keys is None else row_keys[state.row_map], position=t)
            tok, logp = self.feed.apply(t, state.row_map, tok, logp)
            self.out.tokens[t].index_copy_(0, state.row_map, tok)
            self.out.logprobs[t].index_copy_(0, state.row_map, logp)
            runner.advance(tok)
            self.history.push(t, self.out)
            self._compact(t + 1)
        self._look(self.budget - 1)

    # -- the host's look at one step's tokens
    def _look(self, step: int) -> None:
        """Rows whose turn ended at `step`: at EOS, at a stop string, or at the response budget (then its calls,
        cut off, are counted as the re-prefill driver counts them, and the row ends). Tool tokens end nothing."""
        wave_rows = slice(self.first_row, self.first_row + len(self.open))
        sampled = self.open & ~self.feed.forced[step, wave_rows]
        if step == self.budget - 1:
            ended = sampled
        else:
            ended = sampled & torch.isin(self.history.at(step), self.eos)
            if self.stop_strings:
                ended |= self._stopped(sampled, step)
        members = (ended.nonzero().squeeze(1) + self.first_row).tolist()
        if members:
            self._end_turns(members, step)

    def _stopped(self, sampled: torch.Tensor, step: int) -> torch.Tensor:
        """Which rows' current turn ends with a stop string at `step`."""
        stopped = torch.zeros_like(sampled)
        for local in sampled.nonzero().squeeze(1).tolist():
            row = self.rows[local + self.first_row]
            self._catch_up(local + self.first_row, step)
            stopped[local] = self.stop_strings.ends_with_stop(row.tokens[row.turn_start:])
        return stopped

    def _catch_up(self, r: int, step: int) -> None:
        """Row r's history up to and including `step` (its model tokens since the last tool result)."""
        row = self.rows[r]
        if len(row.tokens) <= step:
            row.add(self.history.of_row(r, len(row.tokens), step + 1), True)

    def _end_turns(self, members: list[int], step: int) -> None:
        """Rows whose turn ended at `step`: run their tools (in parallel) and feed the results from step + 1 on,
        or finish the rows."""
        rows = self.rows
        self.history.at(step)  # the budget's last step: _look ended its rows without reading the step's tokens
        for r in members:
            self._catch_up(r, step)
            rows[r].done = False
        before = {r: len(rows[r].tokens) for r in members}
        continuing = set(self.driver._run_tools([rows[r] for r in members], self.budget))
        for k, r in enumerate(members):
            if k in continuing:
                self.feed.queue(r, step + 1, rows[r].tokens[before[r]:])
                rows[r].turn_start = len(rows[r].tokens)
                rows[r].stats.assistant_turns += 1
            else:
                rows[r].done = True
                self.lengths[r] = step + 1
                self.open[r - self.first_row] = False
                self.finished = True
        self.feed.flush()

    # -- finished rows out of the batch
    def _compact(self, next_step: int) -> None:
        """Move the open rows to the front of the smallest batch bucket that holds them (before step next_step)."""
        if not self.finished:
            return
        self.finished = False
        state, scratch = self.state, self.out.scratch
        open_rows = self.open.tolist()
        positions = [i for i, r in enumerate(self.row_map) if r != scratch and open_rows[r - self.first_row]]
        smaller = self.runner.bucket(len(positions))
        if not positions or smaller >= state.batch:
            return
        device = state.row_map.device
        self.runner.compact(_to_device(torch.tensor(positions), device), smaller, state.slot(next_step))
        self.row_map = [self.row_map[i] for i in positions] + [scratch] * (smaller - len(positions))
        state.row_map = _to_device(torch.tensor(self.row_map), device)
        state.batch = smaller


__all__ = ["fast_multiturn_generate"]
