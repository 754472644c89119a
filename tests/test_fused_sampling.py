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


def draw(logits, temperature, seed=1234, step=5, row_offset=0):
    rows = logits.shape[0]
    tokens = torch.full((rows,), -1, dtype=torch.long)
    logprobs = torch.full((rows,), float("nan"))
    fused_sampling.sample_into(logits, torch.tensor([seed]), torch.tensor([step]),
                               torch.tensor([float(temperature)]), tokens, logprobs, row_offset=row_offset)
    return tokens, logprobs


def test_greedy_is_the_first_argmax_with_the_unscaled_log_prob():
    torch.manual_seed(0)
    assert fused_sampling.CHUNK == 4096
    logits = torch.randn(5, 9000) * 3  # three chunks, the last one partly past the vocabulary
    logits[1, 8500] = logits[1, 700] = 50.0  # a tie across chunks: the first index wins, as torch.argmax
    logits[2, 10] = logits[2, 11] = 50.0  # a tie inside one block
    logits[3, 1000] = logits[3, 1030] = 50.0  # a tie across the blocks of one chunk
    logits[4, :5000] = float("-inf")  # a whole chunk and blocks of the next masked out
    tokens, logprobs = draw(logits, 0.0)
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(logprobs.double(), expected, atol=1e-5)


def test_sampled_log_probs_are_the_tempered_softmax_and_masked_tokens_are_never_drawn():
    torch.manual_seed(1)
    logits = torch.randn(6, 9000) * 2
    logits[1, 4096:] = float("-inf")  # the first chunk only
    logits[2, :8192] = float("-inf")  # the last chunk only
    logits[3, ::2] = float("-inf")  # every other token
    logits[4, :] = float("-inf")
    logits[4, 6000] = 0.0  # one token can be drawn: it is, with log-prob 0
    tokens, logprobs = draw(logits, 0.7)
    # the trainer's arithmetic (logprobs.py): logits times 1/temperature
    expected = torch.log_softmax(logits.double() * (1 / 0.7), -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(logprobs.double(), expected, atol=1e-5)
    assert torch.isfinite(logits[torch.arange(6), tokens]).all()
    assert tokens[1] < 4096 and tokens[2] >= 8192 and tokens[3] % 2 == 1 and tokens[4] == 6000
    assert not torch.equal(tokens, logits.argmax(-1))  # it samples


def test_rows_with_nothing_to_draw_still_give_a_token_of_the_vocabulary():
    """NaN logits (an fp16 overflow upstream) or only -inf: no probability to draw from; the kernels stay inside
    the row and return a valid index (the log-prob shows the problem) rather than reading outside it."""
    logits = torch.randn(3, 5000)
    logits[0] = float("nan")
    logits[1] = float("-inf")
    for temperature in (0.0, 1.0):
        tokens, logprobs = draw(logits, temperature)
        assert ((tokens >= 0) & (tokens < 5000)).all(), tokens
        assert not torch.isfinite(logprobs[:2]).any() and torch.isfinite(logprobs[2])


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
    # the tokens spread over the chunks (4096 entries) and their blocks, at their edges too
    columns = torch.tensor([4096, 5, 5100, 4095, 4500, 1024, 1023])
    # 128 rows x 2 steps = 256 draws (the interpreter runs each program in Python)
    logits = torch.full((128, 5196), float("-inf"))  # a chunk and a quarter
    logits[:, columns] = probs.log() * temperature  # softmax(logits / T) = probs over `columns`
    counts = torch.zeros(len(probs))
    seen = []
    for step in range(2):
        tokens, logprobs = draw(logits, temperature, seed=99, step=step)
        which = (tokens[:, None] == columns).long().argmax(1)
        assert torch.equal(columns[which], tokens)
        counts += torch.bincount(which, minlength=len(probs))
        assert torch.allclose(logprobs, probs.log()[which], atol=1e-5)
        seen.append(tokens)
    assert chi_square_pvalue(counts, probs) > 1e-3
    # the test can fail: the same 256 draws are rejected against the distribution at another temperature
    assert chi_square_pvalue(counts, torch.softmax(logits[0, columns] / 1.6, -1)) < 1e-3
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


def test_the_kernels_compile_for_a_gpu():
    """The interpreter runs what a GPU build refuses (a global that is not a constexpr, say): compile both kernels
    for sm_90 as a CUDA machine would, on the CPU (Triton's own compiler and ptxas), in a process without
    TRITON_INTERPRET."""
    import os
    import subprocess
    import sys

    source = os.path.join(os.path.dirname(fused_sampling.__file__), "fused_sampling_kernels.py")
    script = f"""
import importlib.util
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
spec = importlib.util.spec_from_file_location("kernels", {source!r})
kernels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernels)
types = dict(stride_row="i32", vocab="i32", row_offset="i32", seed_ptr="*i64", step_ptr="*i64", tokens_ptr="*i64",
             row_key_ptr="*i64", part_col_ptr="*i32")
sizes = dict(CHUNKS=38, CHUNKS_PAD=64, CHUNK={fused_sampling.CHUNK}, BLOCK={fused_sampling.BLOCK_VOCAB}, KEYED=True)
for kernel in (kernels.chunk_kernel, kernels.draw_kernel):
    constants = {{name: sizes[name] for name in kernel.arg_names if name in sizes}}
    signature = {{name: "constexpr" if name in sizes else types.get(name, "*fp32") for name in kernel.arg_names}}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    compiled = compile(source, target=GPUTarget("cuda", 90, 32))
    print(kernel.__name__, len(compiled.asm["cubin"]))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "chunk_kernel" in done.stdout and "draw_kernel" in done.stdout
