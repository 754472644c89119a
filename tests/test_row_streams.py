"""Per-row random streams (rollout.base.RowStreams): each response row draws its noise from a stream keyed by (seed,
global prompt index, sample index), so the samples do not depend on how the rollout is split: in one call or in
waves of any size, in one process or as ranks holding blocks of the prompts. Both engines; the noise itself is
checked against the exponential distribution."""

from __future__ import annotations

import dataclasses
import math

import torch

from rlanywhere.plans import RolloutPlan
from rlanywhere.rollout import FastEngine, HFEngine, SamplingParams
from rlanywhere.rollout.base import RowStreams, keyed_exponential, sample_from_logits

from .test_rollout import PAD, PROMPTS, chi_square_pvalue, responses, tiny_model

PARAMS = SamplingParams(10, temperature=1.0, n=3, ignore_eos=True)


def splits(engine, streams: RowStreams, whole=None, params: SamplingParams = PARAMS) -> dict[str, list[list[int]]]:
    """The same request whole (or `whole`, its batch generated already), in waves of 3 rows (one prompt each), and
    as two "ranks" of two prompts each."""
    if whole is None:
        whole = engine.generate(PROMPTS, params, generator=streams)
    waves = engine.generate(PROMPTS, params, generator=streams, rows_per_wave=3)
    ranks = [engine.generate(PROMPTS[:2], params, generator=streams),
             engine.generate(PROMPTS[2:], params, generator=streams.offset(2), rows_per_wave=2)]
    return {"whole": responses(whole), "waves": responses(waves),
            "ranks": responses(ranks[0]) + responses(ranks[1])}


def test_fast_engine_rows_draw_the_same_whatever_the_split():
    engine = FastEngine(tiny_model("qwen2"), None, RolloutPlan(check_every=2), pad_token_id=PAD)
    got = splits(engine, RowStreams(seed=11))
    assert got["whole"] == got["waves"] == got["ranks"]
    assert len({tuple(r) for r in got["whole"]}) > 6  # samples of one prompt differ: the rows' streams differ
    other = responses(engine.generate(PROMPTS, PARAMS, generator=RowStreams(seed=12)))
    assert other != got["whole"]  # another seed (step) draws other samples


def test_hf_engine_rows_draw_the_same_whatever_the_split():
    engine = HFEngine(tiny_model("qwen2"), None, pad_token_id=PAD)
    got = splits(engine, RowStreams(seed=11))
    assert got["whole"] == got["waves"] == got["ranks"]
    assert len({tuple(r) for r in got["whole"]}) > 6


def test_keyed_sampling_log_probs_are_the_models():
    """The log-prob recorded for a keyed draw is the processed distribution's (HF engine: the recorder runs before
    the keyed sampler masks the other tokens)."""
    model = tiny_model("qwen2")
    batch = HFEngine(model, None, pad_token_id=PAD).generate(PROMPTS, PARAMS, generator=RowStreams(seed=3))
    fast = FastEngine(model, None, pad_token_id=PAD).generate(PROMPTS, PARAMS, generator=RowStreams(seed=3))
    assert responses(batch) == responses(fast)  # same model, same streams: the same draws from either engine
    torch.testing.assert_close(batch.response_logprobs, fast.response_logprobs, atol=1e-4, rtol=1e-4)


def test_keyed_noise_is_exponential_and_depends_on_key_position_and_token_only():
    keys = RowStreams(seed=5).keys(2, 2)[:-1]
    noise = keyed_exponential(keys, position=7, vocab=50_000)
    assert noise.shape == (4, 50_000) and bool((noise > 0).all())
    assert abs(noise.mean().item() - 1.0) < 0.01 and abs(noise.var().item() - 1.0) < 0.03
    # a row's noise does not depend on the other rows of the batch, nor on the vocabulary's length
    torch.testing.assert_close(keyed_exponential(keys[2:3], 7, 50_000)[0], noise[2], atol=0, rtol=0)
    torch.testing.assert_close(keyed_exponential(keys, 7, 1_000), noise[:, :1_000], atol=0, rtol=0)
    assert not torch.equal(keyed_exponential(keys, 8, 1_000), noise[:, :1_000])  # each position draws afresh
    # rows of different keys are independent: their correlation is near 0
    assert abs(torch.corrcoef(noise[:2])[0, 1].item()) < 0.02


def test_keyed_draws_follow_the_softmax():
    """The exponential race with keyed noise draws exactly from softmax(logits / T): 4000 rows (4000 keys) of one
    distribution, chi-square against it."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 4000
    keys = RowStreams(seed=9).keys(rows, 1)[:-1]
    tokens, logprobs = sample_from_logits(logits.expand(rows, -1), SamplingParams(1, temperature=0.7), None,
                                          keys, position=0)
    probs = torch.softmax(logits / 0.7, dim=-1)
    assert chi_square_pvalue(torch.bincount(tokens, minlength=6), probs) > 1e-3
    torch.testing.assert_close(logprobs, probs[tokens].log())
    assert math.isclose(float(keys.unique().numel()), rows)


def test_fused_sampler_rows_draw_the_same_whatever_the_split():
    """FastEngine sampling inside the decode step (the Triton sampler, here under Triton's interpreter): the rows'
    keys travel with them through compaction, so waves, blocks and a whole batch draw the same; the log-probs are
    the forward pass's."""
    from .test_rollout import forward_logits

    model = tiny_model("qwen2")
    engine = FastEngine(model, None, RolloutPlan(fused_sampling=True, check_every=2), pad_token_id=PAD)
    # 6 tokens, not 10: the same waves, blocks and row keys, and a check of finished rows every 2 steps, in fewer
    # steps of the interpreted sampler (each a second of CPU over the four generate calls)
    params = dataclasses.replace(PARAMS, max_new_tokens=6)
    batch = engine.generate(PROMPTS, params, generator=RowStreams(seed=11))  # whole, kept for its log-probs
    got = splits(engine, RowStreams(seed=11), whole=batch, params=params)
    assert got["whole"] == got["waves"] == got["ranks"]
    assert len({tuple(r) for r in got["whole"]}) > 6
    width, mask = batch.prompt_ids.shape[1], batch.response_mask.bool()
    expected = torch.log_softmax(forward_logits(model, batch)[:, width - 1: width - 1 + params.max_new_tokens], -1)
    expected = expected.gather(2, batch.response_ids[..., None]).squeeze(2)
    assert (batch.response_logprobs - expected)[mask].abs().max() < 1e-4
