"""The fused sampler (rollout/fused_sampling.py): one Triton pass per decode step draws each row's token and its
log-prob; run on the CPU by Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)."""

from __future__ import annotations

import pytest
import torch

from rlanywhere.plans import RolloutPlan
from rlanywhere.rollout import FastEngine, SamplingParams
from rlanywhere.rollout import fused_sampling

from .test_decode_attention import interpreter_runs
from .test_rollout import PAD, PROMPTS, chi_square_pvalue, forward_logits, reference_greedy, responses, tiny_model

pytestmark = pytest.mark.skipif(not interpreter_runs(),
                                reason="needs triton >= 3.9 and TRITON_INTERPRET=1 (scripts/test.sh, conftest.py)")


def draw(logits, temperature, seed=1234, step=5, splits=None, row_offset=0):
    rows = logits.shape[0]
    tokens = torch.full((rows,), -1, dtype=torch.long)
    logprobs = torch.full((rows,), float("nan"))
    fused_sampling.sample_into(logits, torch.tensor([seed]), torch.tensor([step]),
                               torch.tensor([float(temperature)]), tokens, logprobs, splits=splits,
                               row_offset=row_offset)
    return tokens, logprobs


def test_plan_vocab_splits_fills_the_gpu_with_whole_blocks():
    assert fused_sampling.BLOCK_VOCAB == 1024
    assert fused_sampling.plan_vocab_splits(256, 49152, 528) == (3, 16384)  # 48 blocks, 3 chunks per row
    assert fused_sampling.plan_vocab_splits(64, 49152, 528) == (8, 6144)
    assert fused_sampling.plan_vocab_splits(1024, 49152, 528) == (1, 49152)
    assert fused_sampling.plan_vocab_splits(4, 100, 528) == (1, 1024)  # never a chunk shorter than a block


def test_greedy_is_the_first_argmax_with_the_unscaled_log_prob():
    torch.manual_seed(0)
    logits = torch.randn(5, 3000) * 3
    logits[1, 2500] = logits[1, 700] = 50.0  # a tie across chunks: the first index wins, as torch.argmax
    logits[2, 10] = logits[2, 11] = 50.0  # a tie inside one block
    logits[3, :1500] = float("-inf")  # whole blocks masked out
    for splits in (1, 2, 3):
        tokens, logprobs = draw(logits, 0.0, splits=splits)
        assert torch.equal(tokens, logits.argmax(-1)), splits
        expected = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None]).squeeze(1)
        assert torch.allclose(logprobs.double(), expected, atol=1e-5), splits


def test_sampled_log_probs_are_the_tempered_softmax_and_the_draws_do_not_depend_on_the_chunking():
    torch.manual_seed(1)
    logits = torch.randn(6, 2500) * 2
    first, _ = draw(logits, 0.7)
    for splits in (1, 2, 3):
        tokens, logprobs = draw(logits, 0.7, splits=splits)
        assert torch.equal(tokens, first), splits
        # the trainer's arithmetic (logprobs.py): logits times 1/temperature
        expected = torch.log_softmax(logits.double() * (1 / 0.7), -1).gather(1, tokens[:, None]).squeeze(1)
        assert torch.allclose(logprobs.double(), expected, atol=1e-5), splits
    assert not torch.equal(first, logits.argmax(-1))  # it samples


def test_a_batch_sampled_in_two_parts_draws_what_it_draws_whole():
    """row_offset counts the noise by batch row: the two halves of a decode step (RolloutPlan.decode_halves)
    draw the tokens the whole batch would; without it both halves would reuse rows 0.. 's noise."""
    torch.manual_seed(2)
    logits = torch.zeros(8, 1500)  # equal logits: the token is the noise alone
    whole, whole_lp = draw(logits, 1.0)
    first, first_lp = draw(logits[:4], 1.0)
    second, second_lp = draw(logits[4:], 1.0, row_offset=4)
    assert torch.equal(torch.cat([first, second]), whole)
    assert torch.equal(torch.cat([first_lp, second_lp]), whole_lp)
    reused, _ = draw(logits[4:], 1.0)  # no offset: rows 4.. draw rows 0..'s tokens
    assert torch.equal(reused, first) and not torch.equal(reused, second)


def test_draws_follow_the_softmax_and_change_with_seed_and_step():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])
    temperature = 0.8
    # 128 rows x 2 steps = 256 draws (the interpreter runs each row's program in Python: ~40 ms apiece)
    logits = (probs.log() * temperature).expand(128, -1).contiguous()  # softmax(logits / T) = probs
    counts = torch.zeros(len(probs))
    seen = []
    for step in range(2):
        tokens, logprobs = draw(logits, temperature, seed=99, step=step)
        counts += torch.bincount(tokens, minlength=len(probs))
        assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-5)
        seen.append(tokens)
    assert chi_square_pvalue(counts, probs) > 1e-3
    # the test can fail: the same 256 draws are rejected against the distribution at another temperature
    assert chi_square_pvalue(counts, torch.softmax(logits[0] / 1.6, -1)) < 1e-3
    assert not torch.equal(seen[0], seen[1])  # each step draws afresh
    few = logits[:16]  # a row's draw depends on its index, the seed and the step only
    assert torch.equal(draw(few, temperature, seed=99, step=0)[0], seen[0][:16])  # reproducible
    assert not torch.equal(draw(few, temperature, seed=100, step=0)[0], seen[0][:16])


def test_sample_into_refuses_host_or_wrongly_typed_state():
    logits = torch.randn(2, 10)
    out = torch.empty(2, dtype=torch.long), torch.empty(2)
    with pytest.raises(ValueError, match="temperature must be a one-element torch.float32"):
        fused_sampling.sample_into(logits, torch.tensor([1]), torch.tensor([0]), torch.tensor([1.0], dtype=torch.float64),
                                   *out)


def fused_engine(model, **plan):
    return FastEngine(model, None, RolloutPlan(fused_sampling=True, check_every=2, **plan), pad_token_id=PAD)


def test_engine_with_fused_sampling_decodes_greedily_like_transformers():
    model = tiny_model("qwen2")
    batch = fused_engine(model).generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0))
    assert responses(batch) == reference_greedy(model, PROMPTS, 8)


def test_engine_with_fused_sampling_log_probs_match_the_forward_pass_and_runs_reproduce():
    model = tiny_model("qwen2")
    engine = fused_engine(model)
    params = SamplingParams(max_new_tokens=5, temperature=0.7, n=2)  # 4 decode steps, 2 checks: the same paths
    batch = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(3))
    logits = forward_logits(model, batch)
    width, mask = batch.prompt_ids.shape[1], batch.response_mask.bool()
    steps = batch.response_ids.shape[1]
    expected = torch.log_softmax(logits[:, width - 1: width - 1 + steps] / 0.7, -1)
    expected = expected.gather(2, batch.response_ids[..., None]).squeeze(2)
    assert (batch.response_logprobs - expected)[mask].abs().max() < 1e-4
    again = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(3))
    assert torch.equal(again.response_ids, batch.response_ids)
    other = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(other.response_ids, batch.response_ids)


def test_engine_sampling_in_two_halves_draws_the_whole_batchs_tokens(monkeypatch):
    from rlanywhere.rollout import runner

    monkeypatch.setattr(runner, "DECODE_HALF_MIN_ROWS", 2)
    model = tiny_model("qwen2")
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2)
    whole = fused_engine(model).generate(PROMPTS, params, generator=torch.Generator().manual_seed(3))
    halves = fused_engine(model, decode_halves=True).generate(PROMPTS, params,
                                                              generator=torch.Generator().manual_seed(3))
    assert torch.equal(halves.response_ids, whole.response_ids)
    assert torch.allclose(halves.response_logprobs, whole.response_logprobs, atol=1e-5)


def test_requests_with_top_k_or_top_p_use_the_torch_sampler():
    model = tiny_model("qwen2")
    plain = FastEngine(model, None, RolloutPlan(check_every=2), pad_token_id=PAD)
    fused = fused_engine(model)
    for top_k, top_p in ((5, 1.0), (0, 0.8)):
        params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=top_k, top_p=top_p)
        assert not fused.scheduler.fused_sampling_for(params)
        a = plain.generate(PROMPTS, params, generator=torch.Generator().manual_seed(5))
        b = fused.generate(PROMPTS, params, generator=torch.Generator().manual_seed(5))
        assert torch.equal(a.response_ids, b.response_ids)
    assert fused.scheduler.fused_sampling_for(SamplingParams(max_new_tokens=6, top_k=10_000))  # k >= vocab: off


def test_fused_sampling_off_a_gpu_needs_the_interpreter(monkeypatch):
    from rlanywhere.errors import UserError

    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(UserError, match="fused_sampling=True runs on CUDA GPUs"):
        fused_engine(tiny_model("qwen2"))
