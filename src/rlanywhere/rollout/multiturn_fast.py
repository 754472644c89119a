"""Multi-turn rollouts inside FastEngine's waves: a row continues in its own KV cache, its history never prefilled
again.

The wave decodes step by step as a single-turn wave does (same prefill, CUDA graphs, compaction of finished rows).
After every step the host looks at the tokens just sampled (one small device-to-host read per step: the single-turn
wave reads every `check_every` steps). A row whose turn ended with EOS and holds tool calls has them executed (every
such row of the step in parallel threads), and the rendered tool messages become the row's next inputs: at each
following step the row's sampled token is replaced by the next tool token, so the decode step writes the tool
tokens' keys and values into the row's cache one step after another, while the other rows of the wave go on
sampling. The model's next turn then starts right after the last tool token. Tool tokens get mask 0 and log-prob 0.
A turn also ends where it ends with one of `rollout.stop`'s strings (as each turn of the re-prefill driver does):
its calls run and the model goes on, or, without calls, the row ends there.

Every turn of every row stays in the wave's lockstep slots, so nothing about the cache or the graphs changes; a tool
result costs one decode step per token (no prompt-sized re-prefill), and the wave waits for the tools of a step (a
calculator call is microseconds; slow tools hold the wave: the re-prefill driver in multiturn.py runs them between
turns instead).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import (RolloutBatch, SamplingParams, StopStringMatcher, chunk_generator, left_pad, prompt_chunks,
                   resolve_generator, sample_from_logits)
from .scheduler import RequestOutputs, StopRule, plan_waves


def fast_multiturn_generate(driver: Any, engine: Any, rows: list, prompts: list[list[int]], params: SamplingParams,
                            generator: Any, rows_per_wave: int | None) -> RolloutBatch:
    """The rows' multi-turn responses, generated in `engine`'s waves (rows: the driver's row states, row i*n+j)."""
    n, budget, device = params.n, params.max_new_tokens, engine.device
    total_rows = len(prompts) * n
    requested = rows_per_wave if rows_per_wave is not None else engine.rollout.rows_per_wave
    chunks = prompt_chunks(len(prompts), n, requested)
    wave_rows = total_rows if requested is None else min(total_rows, requested)
    out = RequestOutputs.empty(budget, total_rows, engine.pad_token_id, device)
    forced = torch.zeros((budget, total_rows + 1), dtype=torch.bool)  # host: tool tokens (mask 0)
    lengths = [budget] * total_rows
    stop = StopRule.of([], StopStringMatcher(None, ()), device)  # turns end on the host's look (_run_wave)
    shared = resolve_generator(None, params.seed, device) if generator is None else None
    engine.sync_weights()
    for chunk in chunks:
        gen = shared or resolve_generator(chunk_generator(generator, chunk.start), params.seed, device)
        for wave in plan_waves(chunk, n, wave_rows):
            _run_wave(driver, engine, wave, rows, prompts, params, gen, out, stop, forced, lengths)
    tokens, logprobs = out.tokens[:, :total_rows].T.cpu(), out.logprobs[:, :total_rows].T.cpu()
    generated = (~forced[:, :total_rows].T).long()
    width = max(max(lengths), 1)
    within = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    mask = generated[:, :width] * within
    pad = engine.pad_token_id
    response_ids = torch.where(within.bool(), tokens[:, :width], torch.full_like(tokens[:, :width], pad))
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], pad)
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, mask, logprobs[:, :width] * mask, len(prompts), n)


def _run_wave(driver, engine, wave, rows, prompts, params, gen, out: RequestOutputs, stop: StopRule,
              forced: torch.Tensor, lengths: list[int]) -> None:
    scheduler, runner, budget = engine.scheduler, engine.runner, params.max_new_tokens
    eos = set(engine.eos_ids)
    # rollout.stop: checked on the row's current turn at every look (the re-prefill driver's turns stop there too)
    stop_strings = StopStringMatcher(driver.tokenizer, tuple(params.stop_strings or ()))
    state = scheduler._prefill(wave, prompts, params, gen, out, stop)
    fused = scheduler.fused_sampling_for(params)
    if fused:
        seed = torch.randint(0, 2**62, (1,), generator=gen, device=gen.device, dtype=torch.long)
        runner.set_sampling(seed.to(runner.device), params.temperature)
    queues: dict[int, list[int]] = {}  # row -> tool tokens still to feed
    for t in range(1, budget + 1):
        # the host's look at step t-1: turns that ended, tools, rows that finished
        row_map = state.row_map.tolist()
        previous = out.tokens[t - 1].index_select(0, state.row_map).tolist()
        done = state.done.tolist()
        ended = []
        for i, (r, token) in enumerate(zip(row_map, previous)):
            if done[i] or r == out.scratch:
                continue
            if forced[t - 1, r]:
                continue  # a tool token: already in the row's history
            rows[r].add([token], True)
            # a turn ends at EOS, at a stop string, or at the response budget (then its calls, cut off, are
            # counted as the re-prefill driver counts them, and the row ends)
            if (token in eos or t == budget
                    or (stop_strings and stop_strings.ends_with_stop(rows[r].tokens[rows[r].turn_start:]))):
                ended.append((i, r))
        if ended:
            _end_turns(driver, rows, ended, budget, t, state, queues, lengths)
        if t == budget:
            break
        if state.done.all():
            break
        if not scheduler.check_rows(state, out, stop, t):
            break
        if fused:
            tok, logp = runner.decode_sample(state.batch, state.slot(t))
            tok, logp = tok.clone(), logp.clone()
        else:
            tok, logp = sample_from_logits(runner.decode_step(state.batch, state.slot(t)), params, gen)
        if queues:
            override = torch.full((state.batch,), -1, dtype=torch.long)
            for i, r in enumerate(state.row_map.tolist()):
                queue = queues.get(r)
                if queue:
                    override[i] = queue.pop(0)
                    forced[t, r] = True
                    if not queue:
                        del queues[r]
            override = override.to(tok.device)
            tok = torch.where(override >= 0, override, tok)
            logp = torch.where(override >= 0, torch.zeros_like(logp), logp)
        out.tokens[t].index_copy_(0, state.row_map, tok)
        out.logprobs[t].index_copy_(0, state.row_map, logp)
        runner.advance(tok)


def _end_turns(driver, rows, ended, budget, t, state, queues, lengths) -> None:
    """Rows whose turn ended at step t-1: run their tools (in parallel) and queue the results, or finish them."""
    members = [r for _, r in ended]
    for r in members:
        rows[r].done = False
    before = {r: len(rows[r].tokens) for r in members}
    subset = [rows[r] for r in members]
    continuing = set(driver._run_tools(subset, budget))
    for k, (i, r) in enumerate(ended):
        if k in continuing:
            queues[r] = rows[r].tokens[before[r]:]
            rows[r].turn_start = len(rows[r].tokens)
            rows[r].stats.assistant_turns += 1
        else:
            rows[r].done = True
            lengths[r] = t
            state.done[i] = True


__all__ = ["fast_multiturn_generate"]
