"""The rollout scheduler: which rows run together, when they stop, where their tokens go.

One job: turn a request (prompts x n samples) into waves of at most `rows_per_wave` rows, and run each wave on a
`DecodeRunner`: shared prefill, then decode steps until every row has finished (EOS, a stop string, or the token
limit). Every `check_every` steps (the loop's only host synchronisation) it scans for stop strings and compacts
the still-active rows into the next smaller power-of-two batch bucket, so finished rows stop costing compute.

Waves follow the prompts: a wave holds `rows_per_wave // n` whole prompts (one prompt split into several waves
only when n > rows_per_wave), exactly as one engine call per chunk of prompts did, so the draws for a given
generator are the same as such chunked calls (see base.prompt_chunks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ..vocabulary import FP32
from .base import SamplingParams, StopStringMatcher, sample_from_logits
from .runner import DecodeRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WaveUnit:
    """`count` samples of prompt `prompt`, starting at sample `first_sample`: rows prompt*n + first_sample.."""

    prompt: int
    first_sample: int
    count: int


def plan_waves(prompts: range, n: int, rows_per_wave: int) -> list[list[WaveUnit]]:
    """Waves of at most rows_per_wave rows over the given prompts, whole prompts packed in order; a prompt is
    split into several units only when n > rows_per_wave."""
    units = [WaveUnit(p, s, min(rows_per_wave, n - s)) for p in prompts for s in range(0, n, rows_per_wave)]
    waves: list[list[WaveUnit]] = [[]]
    for unit in units:
        if waves[-1] and sum(u.count for u in waves[-1]) + unit.count > rows_per_wave:
            waves.append([])
        waves[-1].append(unit)
    return waves


@dataclass
class RequestOutputs:
    """Where a request's tokens go: [steps, rows + 1] (the last column is a scratch row that filler rows of a
    batch bucket write to), and the response length of each row that a stop string ended."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    stop_lengths: dict[int, int] = field(default_factory=dict)

    @classmethod
    def empty(cls, steps: int, rows: int, pad_token_id: int, device: torch.device) -> "RequestOutputs":
        return cls(torch.full((steps, rows + 1), pad_token_id, dtype=torch.long, device=device),
                   torch.zeros((steps, rows + 1), dtype=FP32, device=device))

    @property
    def scratch(self) -> int:
        return self.tokens.shape[1] - 1


@dataclass
class StopRule:
    """How rows end: any of the `eos` ids (empty: never), and/or a stop string found by `matcher`."""

    eos: torch.Tensor  # long [E] on the device ([-1] when there is no EOS)
    use_eos: bool
    matcher: StopStringMatcher

    @classmethod
    def of(cls, eos_ids: list[int], matcher: StopStringMatcher, device: torch.device) -> "StopRule":
        return cls(torch.tensor(eos_ids or [-1], dtype=torch.long, device=device), bool(eos_ids), matcher)


@dataclass
class WaveState:
    """One wave in flight. Batch row i of the runner holds output row `row_map[i]` (scratch for filler rows);
    `done[i]`: the row has finished. `history`: response tokens of the rows still scanned for stop strings,
    read up to response position `scanned`."""

    width: int  # padded prompt width: decode step t writes cache slot width + t - 1
    batch: int  # current batch bucket
    row_map: torch.Tensor  # long [batch]
    done: torch.Tensor  # bool [batch]
    scanned: int = 0
    history: dict[int, list[int]] = field(default_factory=dict)

    def slot(self, step: int) -> int:
        return self.width + step - 1


class Scheduler:
    """Runs waves of a request on a `DecodeRunner` (see the module docstring)."""

    def __init__(self, runner: DecodeRunner, pad_token_id: int, check_every: int, prefill_tokens_per_chunk: int):
        self.runner = runner
        self.pad_token_id = pad_token_id
        self.check_every = check_every
        self.prefill_tokens_per_chunk = prefill_tokens_per_chunk

    def run_wave(self, wave: list[WaveUnit], prompts: list[list[int]], params: SamplingParams,
                 gen: torch.Generator, out: RequestOutputs, stop: StopRule,
                 row_keys: Optional[torch.Tensor] = None) -> None:
        """Generate every row of `wave` into `out`. row_keys (`RowStreams.keys`, indexed by request row): each row
        samples from its own stream instead of `gen` (the fused sampler keeps the keys of the batch's rows beside
        them, compacted with them)."""
        state = self._prefill(wave, prompts, params, gen, out, stop, row_keys)
        fused = self.fused_sampling_for(params)
        if fused:  # one seed per wave from its generator (or the rows' keys); the decode step counts the draws after it
            seed = torch.randint(0, 2**62, (1,), generator=gen, device=gen.device, dtype=torch.long)
            self.runner.set_sampling(seed.to(self.runner.device), params.temperature,
                                     None if row_keys is None else row_keys[state.row_map])
        for t in range(1, params.max_new_tokens):
            if t % self.check_every == 0 and not self.check_rows(state, out, stop, t):
                break
            if fused:
                tok, logp = self.runner.decode_sample(state.batch, state.slot(t), position=t)
            else:
                keys = None if row_keys is None else row_keys[state.row_map]
                tok, logp = sample_from_logits(self.runner.decode_step(state.batch, state.slot(t)), params, gen,
                                               keys, position=t)
            out.tokens[t].index_copy_(0, state.row_map, tok)
            out.logprobs[t].index_copy_(0, state.row_map, logp)
            if stop.use_eos:
                state.done |= torch.isin(tok, stop.eos)
            self.runner.advance(tok)
        self.runner.wait_for_steps()  # the request's outputs are read on the host next
        if stop.matcher:
            self._scan_stop_strings(state, out, stop, params.max_new_tokens)

    def fused_sampling_for(self, params: SamplingParams) -> bool:
        """Whether decode steps sample inside the step (the runner's fused sampler): it has no top-k / top-p."""
        vocab = self.runner.forward.dims.vocab
        return self.runner.fused_sampling and (params.top_k == 0 or params.top_k >= vocab) and params.top_p == 1.0

    def _prefill(self, wave: list[WaveUnit], prompts: list[list[int]], params: SamplingParams,
                 gen: torch.Generator, out: RequestOutputs, stop: StopRule,
                 row_keys: Optional[torch.Tensor] = None) -> WaveState:
        """Shared prefill (each unit's prompt once, its K/V copied to its rows), the first token of every row, and
        the decode state of the wave's batch bucket."""
        n, device, runner = params.n, self.runner.device, self.runner
        width = max(len(prompts[u.prompt]) for u in wave)
        rows = sum(u.count for u in wave)
        runner.reserve(rows, width + params.max_new_tokens)
        first_logits, row = [], 0
        chunk_units = max(1, self.prefill_tokens_per_chunk // width)
        for c in range(0, len(wave), chunk_units):
            chunk = wave[c : c + chunk_units]
            ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
            for j, u in enumerate(chunk):
                ids[j, width - len(prompts[u.prompt]) :] = torch.tensor(prompts[u.prompt])
            lengths = torch.tensor([len(prompts[u.prompt]) for u in chunk], device=device)
            copies = torch.tensor([u.count for u in chunk], device=device)
            logits = runner.prefill(ids.to(device), lengths, copies, row)
            first_logits.append(logits.repeat_interleave(copies, dim=0, output_size=int(copies.sum())))
            row += int(copies.sum())
        row_ids = torch.tensor([u.prompt * n + u.first_sample + j for u in wave for j in range(u.count)],
                               device=device)
        prompt_len = torch.tensor([len(prompts[u.prompt]) for u in wave for _ in range(u.count)], device=device)
        tok, logp = sample_from_logits(torch.cat(first_logits), params, gen,
                                       None if row_keys is None else row_keys[row_ids], position=0)
        out.tokens[0].index_copy_(0, row_ids, tok)
        out.logprobs[0].index_copy_(0, row_ids, logp)

        batch = runner.bucket(rows)
        fill = batch - rows  # filler rows up to the bucket write to the scratch output row
        runner.load_rows(F.pad(tok, (0, fill), value=self.pad_token_id), F.pad(prompt_len, (0, fill)),
                         F.pad(width - prompt_len, (0, fill)))
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        done[rows:] = True
        if stop.use_eos:
            done[:rows] |= torch.isin(tok, stop.eos)
        history = {int(r): [] for r in row_ids.tolist()} if stop.matcher else {}
        return WaveState(width=width, batch=batch, row_map=F.pad(row_ids, (0, fill), value=out.scratch), done=done,
                         history=history)

    def check_rows(self, state: WaveState, out: RequestOutputs, stop: StopRule, step: int) -> bool:
        """The host check before decode step `step`: stop strings, then compaction into a smaller bucket.
        Returns False when every row has finished."""
        self.runner.wait_for_steps()
        if stop.matcher:
            self._scan_stop_strings(state, out, stop, step)
        active = (~state.done).nonzero().squeeze(1)
        if active.numel() == 0:
            return False
        smaller = self.runner.bucket(active.numel())
        if smaller < state.batch:
            self.runner.compact(active, smaller, state.slot(step))
            count = active.numel()
            index = torch.cat([active, active[:1].expand(smaller - count)]) if smaller > count else active
            state.row_map = state.row_map[index].clone()
            state.row_map[count:] = out.scratch
            state.done = torch.zeros(smaller, dtype=torch.bool, device=state.done.device)
            state.done[count:] = True
            state.batch = smaller
        return True

    @staticmethod
    def _scan_stop_strings(state: WaveState, out: RequestOutputs, stop: StopRule, upto: int) -> None:
        """Check response positions [state.scanned, upto) of rows still being scanned; mark rows that hit a stop
        string. Rows leave the scan at their first EOS or stop string, so a stop string before an EOS within the
        same window is still found."""
        if upto <= state.scanned or not state.history:
            state.scanned = max(state.scanned, upto)
            return
        rows = sorted(state.history)
        new = out.tokens[state.scanned : upto][:, rows].T.tolist()
        eos = set(stop.eos.tolist()) if stop.use_eos else set()
        stopped = []
        for r, tokens in zip(rows, new):
            seq = state.history[r]
            for token in tokens:
                seq.append(token)
                if token in eos:
                    del state.history[r]
                    break
                if stop.matcher.ends_with_stop(seq):
                    out.stop_lengths[r] = len(seq)
                    stopped.append(r)
                    del state.history[r]
                    break
        if stopped:
            state.done |= torch.isin(state.row_map, torch.tensor(stopped, dtype=torch.long, device=state.done.device))
        state.scanned = upto


__all__ = ["Scheduler", "WaveState", "WaveUnit", "RequestOutputs", "StopRule", "plan_waves"]
