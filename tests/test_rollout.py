"""Rollout engines on CPU with tiny random Qwen2 / Llama / Qwen3 models in fp32.

References are independent of the engines: transformers' own `generate` for greedy tokens, a full forward pass
over prompt+response for log-probs, and a naive temperature / top-k / top-p distribution for sampling statistics.
"""

import copy
import logging
import math

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rlanywhere.logprobs import response_logprobs
from rlanywhere.plans import RolloutPlan
from rlanywhere.rollout import FastEngine, HFEngine, SamplingParams, make_engine
from rlanywhere.rollout.base import RolloutBatch

VOCAB = 128
PAD = 0
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27], [40, 41, 42]]


def tiny_model(kind: str = "qwen2", seed: int = 0):
    torch.manual_seed(seed)
    # initializer_range 0.2 gives peaked, varied logits, so greedy runs do not just repeat a token
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.2)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, rope_theta=5000.0, **common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=False, head_dim=16, **common))
    else:
        raise ValueError(kind)
    model.generation_config.eos_token_id = None
    return model.eval()


def with_random_biases(model, seed: int = 1):
    """`model` with its Linear biases (Qwen2's q/k/v) drawn at random: transformers initialises them to zero, which
    would let a test of where the bias is added pass whatever it does."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.5)
    return model


def char_tokenizer():
    """Character-level tokenizer: id 0 <pad>, id 1 <eos>, other ids one printable character each."""
    from tokenizers import Tokenizer, decoders, models

    chars = [chr(c) for c in range(33, 33 + VOCAB - 2)]
    vocab = {"<pad>": 0, "<eos>": 1, **{ch: i + 2 for i, ch in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def reference_greedy(model, prompts, max_new_tokens, eos_id=None):
    """transformers' generate, row by row (no padding involved), cut at the first EOS (included)."""
    rows = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=PAD)
        resp = out[0, len(p):].tolist()
        if eos_id is not None and eos_id in resp:
            resp = resp[: resp.index(eos_id) + 1]
        rows.append(resp)
    return rows


def responses(batch: RolloutBatch) -> list[list[int]]:
    return [ids[: int(m.sum())].tolist() for ids, m in zip(batch.response_ids, batch.response_mask)]


def naive_processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """log of the sampling distribution for one logits vector, written out step by step in float64."""
    x = logits.double() / temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k:
        kth = sorted(x.tolist(), reverse=True)[top_k - 1]
        keep &= x >= kth
    x = torch.where(keep, x, torch.tensor(-math.inf, dtype=x.dtype))
    if top_p < 1.0:
        probs = torch.softmax(x, -1)
        order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
        mass, kept = 0.0, set()
        for i in order:  # smallest set of most likely tokens with mass >= top_p
            kept.add(i)
            mass += probs[i].item()
            if mass >= top_p:
                break
        mask = torch.tensor([i in kept for i in range(len(x))])
        x = torch.where(mask, x, torch.tensor(-math.inf, dtype=x.dtype))
    return torch.log_softmax(x, -1)


def forward_logits(model, batch: RolloutBatch) -> torch.Tensor:
    ids, mask, pos = batch.sequences()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.double()


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square test; categories with expected count < 5 are pooled into one bin."""
    total = counts.sum().item()
    expected = probs.double() * total
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp[-1] < 5:  # pool too small to test on its own: fold it into the largest bin
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        obs[exp.argmax()] += counts[~big].sum()
        exp[exp.argmax()] += expected[~big].sum()
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


# ------------------------------------------------------------------------------------------------------------------


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_new_tokens=4, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(max_new_tokens=4, top_k=-3)
    with pytest.raises(ValueError, match="n "):
        SamplingParams(max_new_tokens=4, n=0)
    with pytest.raises(ValueError, match="stop_strings"):
        SamplingParams(max_new_tokens=4, stop_strings=("",))
    assert SamplingParams(max_new_tokens=4, stop_strings="</a>").stop_strings == ("</a>",)
    assert SamplingParams(max_new_tokens=4, temperature=0).greedy


@pytest.mark.parametrize("kind,attention,fuse,match_hf", [
    ("qwen2", "sdpa", False, False), ("qwen2", "matmul", True, True), ("llama", "sdpa", True, False),
    ("llama", "matmul", False, True), ("qwen3", "sdpa", True, False), ("qwen3", "matmul", False, False)])
def test_fast_greedy_matches_transformers(kind, attention, fuse, match_hf):
    model = tiny_model(kind)
    params = SamplingParams(max_new_tokens=12, temperature=0)
    expected = reference_greedy(model, PROMPTS, 12)
    engine = FastEngine(model, None, RolloutPlan(decode_attention=attention, check_every=2, fuse_weights=fuse,
                                                 match_hf_numerics=match_hf), pad_token_id=PAD)
    assert responses(engine.generate(PROMPTS, params)) == expected
    # EOS in play: a token the model emits mid-response for one prompt becomes EOS; rows stop at different steps
    eos = expected[0][4]
    expected_eos = reference_greedy(model, PROMPTS, 12, eos_id=eos)
    assert len(expected_eos[0]) == 5 and any(len(r) == 12 for r in expected_eos)
    model.generation_config.eos_token_id = eos
    batch = FastEngine(model, None, RolloutPlan(decode_attention=attention, check_every=2, fuse_weights=fuse),
                       pad_token_id=PAD).generate(PROMPTS, params)
    assert responses(batch) == expected_eos
    assert batch.response_ids.shape[1] == max(len(r) for r in expected_eos)
    assert responses(HFEngine(model, None, pad_token_id=PAD).generate(PROMPTS, params)) == expected_eos
    # ignore_eos runs to the full length
    fixed = FastEngine(model, None, pad_token_id=PAD).generate(PROMPTS, SamplingParams(12, temperature=0, ignore_eos=True))
    assert fixed.response_lengths().tolist() == [12] * len(PROMPTS)


def test_batch_layout_and_shared_prefill(monkeypatch):
    model = tiny_model("qwen2")
    engine = FastEngine(model, None, pad_token_id=PAD)
    prefill_rows = []
    original = engine.runner.prefill

    def counting_prefill(ids, lengths, copies, row_start):
        prefill_rows.append(ids.shape[0])
        return original(ids, lengths, copies, row_start)

    monkeypatch.setattr(engine.runner, "prefill", counting_prefill)
    batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0, n=3))
    assert sum(prefill_rows) == len(PROMPTS)  # each prompt prefilled once for its 3 samples
    assert batch.num_prompts == 4 and batch.n == 3 and batch.prompt_ids.shape == (12, 8)
    single = responses(engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0)))
    got = responses(batch)
    for i, p in enumerate(PROMPTS):
        for j in range(3):
            row = i * 3 + j
            assert got[row] == single[i]
            assert batch.prompt_ids[row, -len(p):].tolist() == p
            assert batch.prompt_mask[row].tolist() == [0] * (8 - len(p)) + [1] * len(p)
            assert (batch.prompt_ids[row, : 8 - len(p)] == PAD).all()
    ids, mask, pos = batch.sequences()
    assert pos[1].tolist()[-8:] == list(range(3, 11))  # prompt of length 5 -> positions continue after it


def test_waves_and_buckets_match_single_batch():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 50
    params = SamplingParams(max_new_tokens=10, temperature=0, n=3)
    full = FastEngine(model, None, pad_token_id=PAD).generate(PROMPTS, params)
    waves_plan = RolloutPlan(rows_per_wave=2, max_seq_len=16)
    waves = FastEngine(model, None, waves_plan, pad_token_id=PAD).generate(PROMPTS, params)
    assert responses(full) == responses(waves)
    assert torch.allclose(full.response_logprobs, waves.response_logprobs, atol=1e-5)
    waves_engine = FastEngine(model, None, waves_plan, pad_token_id=PAD)
    assert waves_engine.runner.cache.k.shape[1] == 2  # pre-allocated rows
    waves_engine.release_memory()
    assert waves_engine.runner.cache.k is None
    assert responses(waves_engine.generate(PROMPTS, params)) == responses(full)


def test_decode_buckets_hold_at_least_two_rows():
    """A last long row decodes in a bucket of 2: compiled kernels specialize a batch of 1, and the first such tail
    would recompile them mid-run (seconds each on a GPU)."""
    engine = FastEngine(tiny_model("qwen2"), None, pad_token_id=PAD)
    engine.runner.reserve(8, 32)
    assert [engine.runner.bucket(rows) for rows in (1, 2, 3, 5, 8)] == [2, 2, 4, 8, 8]
    single = FastEngine(tiny_model("qwen2"), None, pad_token_id=PAD)
    single.runner.reserve(1, 32)
    assert single.runner.bucket(1) == 1  # a one-row cache holds no bucket of 2


def test_decode_halves_bias_apart_and_gemm_layouts_decode_like_one_batch_and_transformers(monkeypatch):
    """RolloutPlan.decode_halves (two halves of a step, each its own stream on a GPU; one after the other here),
    qkv_bias_apart (q/k/v biases added after the GEMM) and fp32_gemm_layouts (o_proj and LM head from [in, out]
    copies, down as W @ x^T) change where and how work runs, not what is computed."""
    from rlanywhere.rollout import runner

    monkeypatch.setattr(runner, "DECODE_HALF_MIN_ROWS", 2)  # halve the 4- and 8-row buckets of this tiny batch
    model = with_random_biases(tiny_model("qwen2"))
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    expected = reference_greedy(model, PROMPTS, 8)
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, n=2)
    whole = FastEngine(model, None, RolloutPlan(check_every=2), pad_token_id=PAD)
    reference = whole.generate(PROMPTS, sampled, generator=torch.Generator().manual_seed(3))
    for fuse in (False, True):
        for kw in ({"decode_halves": True}, {"qkv_bias_apart": True}, {"decode_halves": True, "qkv_bias_apart": True},
                   {"fp32_gemm_layouts": True}, {"decode_halves": True, "fp32_gemm_layouts": True}):
            engine = FastEngine(model, None, RolloutPlan(check_every=2, fuse_weights=fuse, **kw), pad_token_id=PAD)
            assert responses(engine.generate(PROMPTS, greedy)) == expected, (fuse, kw)
            batch = engine.generate(PROMPTS, sampled, generator=torch.Generator().manual_seed(3))
            assert torch.equal(batch.response_ids, reference.response_ids), (fuse, kw)
            assert torch.allclose(batch.response_logprobs, reference.response_logprobs, atol=1e-5), (fuse, kw)
    halves = FastEngine(model, None, RolloutPlan(decode_halves=True), pad_token_id=PAD)
    calls = []
    original = halves.forward.decode
    monkeypatch.setattr(halves.forward, "decode", lambda tokens, *a: calls.append(len(tokens)) or original(tokens, *a))
    halves.generate(PROMPTS, SamplingParams(max_new_tokens=2, temperature=0, n=2))  # 8 rows: two halves of 4
    assert calls and set(calls) == {4}


@pytest.mark.slow
def test_compiled_decode_kernels_compile_once_for_every_bucket():
    """The compiled elementwise kernels (dynamic shapes) serve every batch bucket and span with one graph each:
    residual add + norm, the decode's RoPE and SiLU*mul (the prefill's RoPE and the first norm run eagerly)."""
    from rlanywhere.compiling import compiles_so_far

    engine = FastEngine(tiny_model("qwen2"), None, RolloutPlan(compile_elementwise=True), pad_token_id=PAD)
    torch._dynamo.reset()
    before = compiles_so_far()
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    for prompts in (PROMPTS * 2, PROMPTS[:3], PROMPTS[1:3], PROMPTS * 4):  # buckets 8, 4, 2, 16
        engine.generate(prompts, params, generator=torch.Generator().manual_seed(0))
    assert compiles_so_far() - before == 3


@pytest.mark.parametrize("engine_cls", [FastEngine, HFEngine])
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_logprobs_match_forward_pass(engine_cls, kind):
    model = tiny_model(kind)
    engine = engine_cls(model, None, pad_token_id=PAD)
    for temperature, top_k, top_p in [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 20, 0.9)]:
        params = SamplingParams(max_new_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p, n=2)
        batch = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(3))
        logits = forward_logits(model, batch)
        width = batch.prompt_ids.shape[1]
        for row in range(batch.response_ids.shape[0]):
            for t in range(int(batch.response_mask[row].sum())):
                token = batch.response_ids[row, t]
                step_logits = logits[row, width + t - 1]
                if temperature == 0:
                    ref = torch.log_softmax(step_logits, -1)[token]
                    assert token == step_logits.argmax()
                else:
                    ref = naive_processed_logprobs(step_logits, temperature, top_k, top_p)[token]
                assert math.isfinite(ref)
                assert abs(batch.response_logprobs[row, t].item() - ref.item()) < 1e-4
        assert (batch.response_logprobs[batch.response_mask == 0] == 0).all()


@pytest.mark.parametrize("engine_cls", [FastEngine, HFEngine])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (12, 1.0), (0, 0.75), (20, 0.85)])
def test_first_token_distribution_chi_square(engine_cls, top_k, top_p):
    model = tiny_model("qwen2")
    prompt = [5, 6, 7]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    exact = naive_processed_logprobs(logits, 0.7, top_k, top_p).exp()
    draws = 4000
    engine = engine_cls(model, None, pad_token_id=PAD)
    params = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=top_k, top_p=top_p, n=draws)
    batch = engine.generate([prompt], params, generator=torch.Generator().manual_seed(1234))
    counts = torch.bincount(batch.response_ids[:, 0], minlength=VOCAB)
    assert counts[exact == 0].sum() == 0  # nothing drawn outside the top-k / top-p set
    assert chi_square_pvalue(counts, exact) > 1e-3
    # the test can fail: the same draws are rejected against the distribution at temperature 1.2
    wrong = naive_processed_logprobs(logits, 1.2, top_k, top_p).exp()
    assert chi_square_pvalue(counts, wrong) < 1e-3


def test_sampling_is_reproducible_with_generator_and_seed():
    model = tiny_model("qwen2")
    engine = FastEngine(model, None, pad_token_id=PAD)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2)
    a = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(7))
    b = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(7))
    c = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, c.response_ids)
    seeded = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=11)
    assert torch.equal(engine.generate(PROMPTS, seeded).response_ids, engine.generate(PROMPTS, seeded).response_ids)
    hf = HFEngine(model, None, pad_token_id=PAD)
    assert torch.equal(hf.generate(PROMPTS, seeded).response_ids, hf.generate(PROMPTS, seeded).response_ids)


@pytest.mark.parametrize("engine_cls", [FastEngine, HFEngine])
def test_stop_strings(engine_cls):
    model = tiny_model("llama")
    tokenizer = char_tokenizer()
    model.generation_config.eos_token_id = None
    full = reference_greedy(model, PROMPTS, 14)
    # a stop string made of two characters the model emits for prompt 0 at steps 3-4
    stop = tokenizer.decode(full[0][3:5])
    engine = engine_cls(model, tokenizer, pad_token_id=PAD) if engine_cls is HFEngine else engine_cls(
        model, tokenizer, RolloutPlan(check_every=3), pad_token_id=PAD)
    batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=14, temperature=0, stop_strings=(stop,), ignore_eos=True))
    got = responses(batch)
    for ref, resp in zip(full, got):
        text = tokenizer.decode(ref)
        if stop in text:
            # cut right after the first token whose prefix ends with the stop string
            cut = next(k for k in range(1, len(ref) + 1) if tokenizer.decode(ref[:k]).endswith(stop))
            assert resp == ref[:cut] and tokenizer.decode(resp).endswith(stop)
        else:
            assert resp == ref
    assert len(got[0]) == 5
    if engine_cls is FastEngine:  # a row that hit its stop string stops costing decode steps
        calls = []
        original = engine.runner.decode_step
        engine.runner.decode_step = lambda batch, slot: calls.append(batch) or original(batch, slot)
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=14, temperature=0, stop_strings=(stop,)))
        assert len(calls) < 5 + 3


def test_peft_lora_model_uses_adapted_policy():
    peft = pytest.importorskip("peft")
    model = tiny_model("qwen2")
    base_out = reference_greedy(model, PROMPTS, 10)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    torch.manual_seed(1)
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)  # non-zero B so the adapter changes the outputs
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    expected = reference_greedy(lora, PROMPTS, 10)
    assert expected != base_out
    engine = FastEngine(lora, None, pad_token_id=PAD)
    params = SamplingParams(max_new_tokens=10, temperature=0)
    batch = engine.generate(PROMPTS, params)
    assert responses(batch) == expected
    assert responses(HFEngine(lora, None, pad_token_id=PAD).generate(PROMPTS, params)) == expected
    logits = forward_logits(lora, batch)
    ref = torch.log_softmax(logits[:, batch.prompt_ids.shape[1] - 1 : -1], -1)
    ref = ref.gather(-1, batch.response_ids[..., None])[..., 0]
    assert torch.allclose(batch.response_logprobs.double(), ref * batch.response_mask, atol=1e-4)
    for k, v in lora.state_dict().items():  # generation left the model's weights untouched
        assert torch.equal(v, before[k]), k
    # disabling the adapter gives the base policy
    with lora.disable_adapter():
        assert responses(engine.generate(PROMPTS, params)) == base_out


def test_sync_weights_after_in_place_update():
    model = tiny_model("qwen2")
    engine = FastEngine(model, None, RolloutPlan(fuse_weights=True), pad_token_id=PAD)  # engine-owned fused copies
    params = SamplingParams(max_new_tokens=8, temperature=0)
    before = responses(engine.generate(PROMPTS, params))
    assert before == reference_greedy(model, PROMPTS, 8)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.mul_(-1.5)
            layer.self_attn.q_proj.bias.add_(0.5)
    engine.sync_weights()
    qkv = engine.forward.weights.layers[0]["qkv"]
    assert torch.equal(qkv[:64], model.model.layers[0].self_attn.q_proj.weight)
    after = responses(engine.generate(PROMPTS, params))
    assert after != before
    assert after == reference_greedy(model, PROMPTS, 8)


def test_cast_copy_engine_dtype():
    model = tiny_model("llama")
    engine = FastEngine(model, None, RolloutPlan(dtype=torch.float64, fuse_weights=True), pad_token_id=PAD)
    layers = engine.forward.weights.layers
    assert layers[0]["qkv"].dtype == torch.float64  # one cast copy, fused
    assert layers[0]["o"].data_ptr() != model.model.layers[0].self_attn.o_proj.weight.data_ptr()
    assert engine.owned_weight_bytes() > 0
    plain = FastEngine(model, None, pad_token_id=PAD)
    plain_o = plain.forward.weights.layers[0]["o"]
    assert plain_o.data_ptr() == model.model.layers[0].self_attn.o_proj.weight.data_ptr()  # no copy
    assert plain.owned_weight_bytes() == 0
    batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0))
    assert responses(batch) == reference_greedy(model, PROMPTS, 8)


def test_gate_up_layout():
    model = tiny_model("qwen2")
    expected = reference_greedy(model, PROMPTS, 10)
    params = SamplingParams(max_new_tokens=10, temperature=0)
    for transpose in (True, False):
        engine = FastEngine(model, None, RolloutPlan(fuse_weights=True, transpose_gate_up=transpose), pad_token_id=PAD)
        hidden, inter = model.config.hidden_size, model.config.intermediate_size
        gate_up = engine.forward.weights.layers[0]["gate_up"]
        assert gate_up.shape == ((hidden, 2 * inter) if transpose else (2 * inter, hidden))
        assert responses(engine.generate(PROMPTS, params)) == expected


# ATen's CPU kernels whose bf16 results we have seen not depend on the shape they run at. With AVX-512 (seen on a
# CPU with avx512_bf16/AMX) a decode step and the trainer's full forward round differently: ~5e-3 mean gap in
# log-probs, gone when the same process runs with ATEN_CPU_CAPABILITY=avx2.
SHAPE_INVARIANT_BF16_KERNELS = ("AVX2", "DEFAULT")


def test_bf16_logprobs_match_the_trainer():
    """In bf16 the default engine reproduces the trainer's log-probs (transformers' bf16 decoder, LM head with fp32
    output: rlanywhere.logprobs), the other side of a PPO ratio; with fp32_logits=False it reproduces a plain
    transformers bf16 forward (logits rounded to bf16) instead. Fused numerics are measurably further off, so
    these comparisons can tell the modes apart.

    On every CPU the engine must sit well inside bf16's own error (the trainer's bf16 log-probs against the same
    weights in fp32) and closer to the trainer than the fused mode; with ATen's AVX2 or default kernels, whose bf16
    rounding does not depend on the shape, it must match the trainer to 1e-5."""
    model = tiny_model("qwen2").to(torch.bfloat16)
    exact = copy.deepcopy(model).float()
    params = SamplingParams(max_new_tokens=16, temperature=1.0)

    def trainer_logprobs(batch, which=model):
        ids, mask, pos = batch.sequences()
        with torch.no_grad():
            return response_logprobs(which, ids, mask, batch.response_ids.shape[1], position_ids=pos)[0]

    def hf_forward_logprobs(batch):
        width = batch.prompt_ids.shape[1]
        logits = forward_logits(model, batch).float()[:, width - 1 : -1]
        return torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None])[..., 0]

    gaps = {}
    for label, kwargs, reference in (("default", {}, trainer_logprobs),
                                     ("bf16 logits", {"fp32_logits": False}, hf_forward_logprobs),
                                     ("default vs bf16 forward", {}, hf_forward_logprobs),
                                     ("fused", {"match_hf_numerics": False}, trainer_logprobs)):
        engine = FastEngine(model, None, RolloutPlan(**kwargs), pad_token_id=PAD)
        batch = engine.generate(PROMPTS * 4, params, generator=torch.Generator().manual_seed(0))
        gaps[label] = (reference(batch) - batch.response_logprobs)[batch.response_mask.bool()].abs()
        if label == "default":
            bf16_error = (trainer_logprobs(batch) - trainer_logprobs(batch, exact))[batch.response_mask.bool()].abs()
    assert gaps["default"].mean() < 0.5 * bf16_error.mean()
    assert gaps["default"].mean() < gaps["fused"].mean()
    if torch.backends.cpu.get_cpu_capability() in SHAPE_INVARIANT_BF16_KERNELS:
        assert gaps["default"].max() < 1e-5
        assert gaps["bf16 logits"].max() < 1e-5
        assert gaps["default vs bf16 forward"].mean() > 1e-4  # the bf16 rounding of the logits the default avoids
        assert gaps["fused"].mean() > 1e-3


def test_make_engine_and_supports(caplog):
    qwen = tiny_model("qwen2")
    assert FastEngine.supports(qwen) == (True, "")
    assert isinstance(make_engine(qwen, None), FastEngine)
    assert isinstance(make_engine(qwen, None, engine="hf"), HFEngine)

    from rlanywhere.plans import Plan, RolloutPlan

    assert isinstance(make_engine(qwen, None, plan=Plan(rollout=RolloutPlan(engine="hf"))), HFEngine)
    engine = make_engine(qwen, None, plan=Plan(rollout=RolloutPlan(engine="fast", dtype=torch.float64)))
    assert isinstance(engine, FastEngine) and engine.dtype == torch.float64

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=64))
    ok, reason = FastEngine.supports(gpt2)
    assert not ok and "gpt2" in reason
    with caplog.at_level(logging.WARNING):
        assert isinstance(make_engine(gpt2, None), HFEngine)
    assert "gpt2" in caplog.text
    with pytest.raises(ValueError, match="engine='hf'"):
        make_engine(gpt2, None, engine="fast")
    # the trainer passes the plan's automatic "fast" as engine=: that may still fall back
    automatic = Plan(rollout=RolloutPlan(engine="fast", fallback_allowed=True))
    assert isinstance(make_engine(gpt2, None, plan=automatic, engine="fast"), HFEngine)
    asked = Plan(rollout=RolloutPlan(engine="fast", fallback_allowed=False))
    with pytest.raises(ValueError, match="engine='hf'"):
        make_engine(gpt2, None, plan=asked, engine="fast")
    with pytest.raises(ValueError, match="engine must be"):
        make_engine(qwen, None, engine="vllm")


def test_rope_scaling_llama3_and_unsupported_rope():
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.2)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    model = LlamaForCausalLM(LlamaConfig(rope_scaling=llama3, rope_theta=5000.0, **common)).eval()
    model.generation_config.eos_token_id = None
    batch = FastEngine(model, None, pad_token_id=PAD).generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=0))
    assert responses(batch) == reference_greedy(model, PROMPTS, 20)  # positions beyond the original 16 too
    dynamic = LlamaForCausalLM(LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, **common))
    ok, reason = FastEngine.supports(dynamic)
    assert not ok and "dynamic" in reason
    with pytest.raises(ValueError, match="engine='hf'"):
        FastEngine(dynamic, None)


def test_bad_prompts_are_rejected():
    engine = FastEngine(tiny_model("qwen2"), None, pad_token_id=PAD)
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="non-empty list"):
        engine.generate([[1, 2], []], params)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, VOCAB + 5]], params)
    with pytest.raises(ValueError, match="list\\[list\\[int\\]\\]"):
        engine.generate(torch.tensor([[1, 2]]), params)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2, stop_strings=("x",)))


# ------------------------------------------------------------------------------------------------------------------
# The engine's parts: KV cache, scheduler state, waves, plan validation
# ------------------------------------------------------------------------------------------------------------------


def _tiny_cache():
    from rlanywhere.rollout.llama import ModelDims
    from rlanywhere.rollout.runner import KVCache

    dims = ModelDims.of(tiny_model("qwen2"))
    return KVCache(dims, torch.float32, torch.device("cpu")), dims


def test_kv_cache_grow_compact_and_prompt_copies_keep_contents():
    cache, dims = _tiny_cache()
    assert cache.ensure(3, 10)
    assert (cache.rows, cache.length) == (3, 16)  # length aligned to 16 slots
    assert not cache.ensure(2, 16)  # already big enough: no reallocation
    # a prompt's K/V written once, copied to its samples: prompt 0 -> rows 0-1, prompt 1 -> row 2
    k = torch.randn(2, dims.kv_heads, 5, dims.head_dim)
    v = torch.randn(2, dims.kv_heads, 5, dims.head_dim)
    cache.store_prompt(1, 0, k, v, torch.tensor([2, 1]), rows=3)
    assert torch.equal(cache.k[1, 0, :, :5], k[0]) and torch.equal(cache.k[1, 1, :, :5], k[0])
    assert torch.equal(cache.v[1, 2, :, :5], v[1])
    cache.starts[:3] = torch.tensor([0, 1, 2])
    before_k, before_v = cache.k.clone(), cache.v.clone()
    # growing with keep_contents keeps every old row and slot
    assert cache.ensure(5, 40, keep_contents=True)
    assert (cache.rows, cache.length) == (5, 48)
    assert torch.equal(cache.k[:, :3, :, :16], before_k) and torch.equal(cache.v[:, :3, :, :16], before_v)
    assert cache.starts[:3].tolist() == [0, 1, 2]
    # compacting rows [2, 0] to the front keeps their slots and start offsets
    cache.compact(torch.tensor([2, 0]), used_slots=16)
    assert torch.equal(cache.k[:, 0, :, :16], before_k[:, 2]) and torch.equal(cache.v[:, 1, :, :16], before_v[:, 0])
    assert cache.starts[:2].tolist() == [2, 0]
    # a decode write lands at the slot for every row and the read covers the span
    slot = torch.tensor([7])
    new_k, new_v = torch.randn(2, dims.kv_heads, 1, dims.head_dim), torch.randn(2, dims.kv_heads, 1, dims.head_dim)
    keys, values = cache.append(0, 2, slot, new_k, new_v, span=8)
    assert keys.shape[2] == 8 and torch.equal(keys[:, :, 7], new_k[:, :, 0])
    assert torch.equal(values[:, :, 7], new_v[:, :, 0])
    # growing without keep_contents starts from zeros (the runner grows only between waves)
    assert cache.ensure(6, 48)
    assert cache.k.abs().sum() == 0
    cache.release()
    assert cache.k is None and cache.rows == 0


def test_plan_waves_units():
    from rlanywhere.rollout.scheduler import WaveUnit, plan_waves

    # n <= rows: whole prompts, rows_per_wave // n of them per wave
    waves = plan_waves(range(5), 2, 5)
    assert [[u.prompt for u in w] for w in waves] == [[0, 1], [2, 3], [4]]
    # n > rows: one prompt's samples split, never packed with the next prompt's
    waves = plan_waves(range(2), 3, 2)
    assert waves == [[WaveUnit(0, 0, 2)], [WaveUnit(0, 2, 1)], [WaveUnit(1, 0, 2)], [WaveUnit(1, 2, 1)]]


def test_scheduler_wave_state_compacts_finished_rows():
    from rlanywhere.rollout.base import StopStringMatcher
    from rlanywhere.rollout.scheduler import RequestOutputs, StopRule, WaveState

    engine = FastEngine(tiny_model("qwen2"), None, pad_token_id=PAD)
    runner, scheduler = engine.runner, engine.scheduler
    runner.reserve(8, 32)
    # 6 rows in a bucket of 8, then rows 1, 3 and 4 finish: 3 active rows go to a bucket of 4
    runner.load_rows(torch.arange(8) + 10, torch.arange(8), torch.zeros(8, dtype=torch.long))
    row_map = torch.tensor([10, 11, 12, 13, 14, 15, 99, 99])
    done = torch.tensor([False, True, False, True, True, False, True, True])
    state = WaveState(width=4, batch=8, row_map=row_map, done=done)
    out = RequestOutputs.empty(8, 99, PAD, torch.device("cpu"))
    stop = StopRule.of([], StopStringMatcher(None, ()), torch.device("cpu"))
    assert scheduler.check_rows(state, out, stop, step=3)
    assert state.batch == 4
    assert state.row_map.tolist() == [10, 12, 15, out.scratch]
    assert state.done.tolist() == [False, False, False, True]
    assert runner._buffers["tokens"][:3].tolist() == [10, 12, 15]  # the rows' decode state moved with them
    state.done[:] = True
    assert not scheduler.check_rows(state, out, stop, step=4)  # every row finished: the wave ends
    assert state.slot(5) == 8


@pytest.mark.parametrize("engine_cls", [FastEngine, HFEngine])
def test_waves_equal_chunked_calls(engine_cls):
    """generate(rows_per_wave=r) returns what one call per chunk of r // n prompts returned (the trainer's former
    chunking), for a generator per chunk (a function of the chunk's first prompt) and for one shared generator."""
    model = tiny_model("qwen2")
    engine = engine_cls(model, None, pad_token_id=PAD)
    prompts = PROMPTS + [[3, 4, 5, 6], [60, 61]]
    params = SamplingParams(max_new_tokens=7, temperature=1.0, n=2)

    def per_chunk(first):
        return torch.Generator().manual_seed(1000 + first)

    chunks = [prompts[0:2], prompts[2:4], prompts[4:6]]
    expected = RolloutBatch.concat([engine.generate(c, params, generator=per_chunk(2 * i))
                                    for i, c in enumerate(chunks)], PAD)
    got = engine.generate(prompts, params, generator=per_chunk, rows_per_wave=4)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.equal(got.response_logprobs, expected.response_logprobs)
    assert torch.equal(got.prompt_ids, expected.prompt_ids) and got.num_prompts == len(prompts)
    # the same from the engine's default (the plan's rows_per_wave)
    planned = FastEngine(model, None, RolloutPlan(rows_per_wave=4), pad_token_id=PAD) if engine_cls is FastEngine \
        else HFEngine(model, None, pad_token_id=PAD, rows_per_wave=4)
    assert torch.equal(planned.generate(prompts, params, generator=per_chunk).response_ids, got.response_ids)
    shared = torch.Generator().manual_seed(5)
    expected = RolloutBatch.concat([engine.generate(c, params, generator=shared) for c in chunks], PAD)
    got = engine.generate(prompts, params, generator=torch.Generator().manual_seed(5), rows_per_wave=5)
    assert torch.equal(got.response_ids, expected.response_ids)
    # one chunk for the whole request draws differently: the test above can fail
    whole = engine.generate(prompts, params, generator=per_chunk)
    assert not torch.equal(whole.response_ids, got.response_ids)
    # greedy: the same tokens whatever the wave size
    greedy = SamplingParams(max_new_tokens=7, temperature=0, n=2)
    all_rows = engine.generate(prompts, greedy, rows_per_wave=len(prompts) * 2)
    half = engine.generate(prompts, greedy, rows_per_wave=len(prompts))
    assert torch.equal(all_rows.response_ids, half.response_ids)
    assert torch.allclose(all_rows.response_logprobs, half.response_logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="rows_per_wave"):
        engine.generate(prompts, greedy, rows_per_wave=0)


def test_rollout_batch_concat_keeps_each_part_with_its_padding():
    engine = FastEngine(tiny_model("llama"), None, pad_token_id=PAD)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2)
    parts = [engine.generate(PROMPTS[:2], params, generator=torch.Generator().manual_seed(1)),
             engine.generate(PROMPTS[2:], params, generator=torch.Generator().manual_seed(2))]
    joined = RolloutBatch.concat(parts, PAD)
    start = 0
    for part in parts:  # prompts stay left-padded (real tokens at the right), responses right-padded
        rows = slice(start, start + part.prompt_ids.shape[0])
        width_p, width_r = part.prompt_ids.shape[1], part.response_ids.shape[1]
        assert torch.equal(joined.prompt_ids[rows, -width_p:], part.prompt_ids)
        assert torch.equal(joined.prompt_mask[rows, -width_p:], part.prompt_mask)
        assert not joined.prompt_mask[rows, :-width_p].any()
        for field in ("response_ids", "response_mask", "response_logprobs"):
            assert torch.equal(getattr(joined, field)[rows, :width_r], getattr(part, field)), field
        assert not joined.response_mask[rows, width_r:].any()
        start = rows.stop
    assert joined.prompt_ids.shape == (8, 8) and joined.num_prompts == 4
    assert RolloutBatch.concat(parts[:1], PAD) is parts[0]
    with pytest.raises(ValueError, match="different n"):
        RolloutBatch.concat([parts[0], engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))], PAD)


def test_rollout_plan_validation_errors():
    from rlanywhere.errors import UserError

    model = tiny_model("qwen2")
    for plan, match in ((RolloutPlan(cuda_graphs=True), "cuda_graphs=True needs the model on a CUDA device"),
                        (RolloutPlan(decode_attention="flash"), "decode_attention"),
                        (RolloutPlan(rows_per_wave=0), "rows_per_wave"),
                        (RolloutPlan(max_seq_len=1), "max_seq_len"),
                        (RolloutPlan(check_every=0), "check_every"),
                        (RolloutPlan(prefill_tokens_per_chunk=0), "prefill_tokens_per_chunk"),
                        (RolloutPlan(dtype=torch.long), "dtype"),
                        (RolloutPlan(dtype=torch.bfloat16, fp32_gemm_layouts=True), "fp32_gemm_layouts=True is for"),
                        (RolloutPlan(attention_tf32x3=True), "attention_tf32x3=True is a setting of the Triton"),
                        ({"decode_attention": "sdpa"}, "RolloutPlan")):
        with pytest.raises(UserError, match=match):
            FastEngine(model, None, plan)


def test_engine_follows_the_planners_rollout_plan():
    from rlanywhere.planner import plan_rollout_for
    from rlanywhere.plans import Plan

    model = tiny_model("qwen2")
    fp32 = plan_rollout_for(model, "cpu", rows_per_wave=8, max_seq_len=32)
    chosen = (fp32.decode_attention, fp32.fuse_weights, fp32.cuda_graphs, fp32.rows_per_wave)
    assert chosen == ("matmul", False, False, 8) and fp32.fp32_logits and "decode_attention" in fp32.reasons
    engine = make_engine(model, None, plan=Plan(rollout=fp32))
    assert engine.decode_attention == "matmul" and engine.runner.rows_capacity == 8
    bf16 = plan_rollout_for(model, "cpu", torch.bfloat16)
    assert bf16.decode_attention == "sdpa" and bf16.fuse_weights  # a cast copy exists anyway: fused
    planned = RolloutPlan(engine="fast", dtype=torch.float32, decode_attention="sdpa")
    assert make_engine(model, None, plan=Plan(rollout=planned)).decode_attention == "sdpa"
    assert make_engine(model, None).decode_attention == "sdpa"  # no plan: RolloutPlan() defaults


def test_compiled_elementwise_compiles_the_decode_step_only(monkeypatch):
    """compile_elementwise compiles what a decode step runs every step: the residual add + norm, SiLU*mul and (no
    fused RoPE + cache-write kernel here) the decode's RoPE; the prefill's RoPE and the first layer's norm run
    eagerly: three graphs for the first step to compile, not five. Traced with dynamo's eager backend (no code
    generation); the greedy tokens are those of the plain path."""
    from rlanywhere import compiling
    from rlanywhere.rollout import llama

    monkeypatch.setattr(llama, "compile_dynamic", lambda fn: compiling.compile_dynamic(fn, backend="eager"))
    torch._dynamo.reset()
    model = tiny_model("qwen2")
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    plain = FastEngine(model, None, RolloutPlan(), pad_token_id=PAD).generate(PROMPTS, params)
    before = compiling.compiles_so_far()
    engine = FastEngine(model, None, RolloutPlan(compile_elementwise=True), pad_token_id=PAD)
    assert not engine.runner.forward.kv_write_kernel and sorted(engine.runner.forward.ops) == [
        "add_rms_norm", "apply_rope", "silu_mul"]
    compiled = engine.generate(PROMPTS, params)
    assert compiling.compiles_so_far() - before == 3
    assert torch.equal(plain.response_ids, compiled.response_ids)
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_elementwise_decode_matches_the_plain_decode():
    """RolloutPlan.compile_elementwise: the decode step's norms, RoPE, SiLU*mul and residual adds compiled by
    torch.compile (C++ here, Triton on a GPU) with eager's rounding; in bf16, where Triton runs (here its
    interpreter), the norms and SiLU*mul are hand-written Triton kernels instead. Same samples and log-probs as
    the plain path:
    fp32 to float rounding, bf16 (transformers' rounding of every intermediate) to the reduction order of a norm."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-3)):
        model = tiny_model("qwen2").to(dtype)
        batches = {}
        for compiled in (False, True):
            engine = FastEngine(model, None, RolloutPlan(compile_elementwise=compiled), pad_token_id=PAD)
            batches[compiled] = engine.generate(PROMPTS * 2, params, generator=torch.Generator().manual_seed(0))
        plain, fused = batches[False], batches[True]
        assert torch.equal(plain.response_ids, fused.response_ids), dtype
        gap = (plain.response_logprobs - fused.response_logprobs)[plain.response_mask.bool()].abs()
        assert gap.max() < tolerance, (dtype, float(gap.max()))


def test_a_stop_string_completed_inside_a_token_stops_the_row():
    """BPE vocabularies merge a stop string's last characters with what follows (`>\\n`): the token that completes
    it stops the row (transformers' StopStringCriteria and vLLM match it too), and only that token."""
    from rlanywhere.rollout.base import StopStringMatcher

    class Pieces:  # a tokenizer whose tokens are these strings
        pieces = ("</", "answer", ">\n", ">", "x")

        def decode(self, ids, skip_special_tokens=False):
            return "".join(self.pieces[i] for i in ids)

    matcher = StopStringMatcher(Pieces(), ["</answer>"])
    assert matcher.ends_with_stop([4, 0, 1, 2]) and matcher.ends_with_stop([0, 1, 3])
    assert not matcher.ends_with_stop([0, 1]) and not matcher.ends_with_stop([0, 1, 3, 4])  # not the last token's
    assert matcher.first_stop_length([4, 0, 1, 2, 4, 4]) == 4


def test_the_decode_loop_waits_for_its_steps_before_each_host_read(monkeypatch):
    """The scheduler reads the GPU's results on the host every check_every steps and after the last one; before each
    read it waits through DecodeRunner.wait_for_steps (asleep on a GPU: a spinning wait takes a CPU core from an
    update running beside the rollout, docs/async.md). 8 tokens, checks before steps 2, 4 and 6."""
    engine = FastEngine(tiny_model("llama"), None, RolloutPlan(check_every=2), pad_token_id=PAD)
    log = []
    step = engine.runner.decode_step
    monkeypatch.setattr(engine.runner, "wait_for_steps", lambda: log.append("wait"))
    monkeypatch.setattr(engine.runner, "decode_step", lambda *a, **k: log.append("step") or step(*a, **k))
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    expected = ["step"] + [kind for t in range(2, 8) for kind in (["wait"] if t % 2 == 0 else []) + ["step"]]
    assert log == expected + ["wait"]
