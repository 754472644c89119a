import pytest
import torch
import transformers

from rlanywhere.logprobs import (
    chunked_logprobs_and_entropy,
    default_position_ids,
    naive_logprobs_and_entropy,
    response_logprobs,
)


def _inputs(n=3, t=7, h=16, v=50, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, t, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n, t), generator=g)
    return hidden, weight, b, labels


def _grads(fn, hidden, weight, bias, labels, coef_lp, coef_ent, **kw):
    for tensor in (hidden, weight, bias):
        if tensor is not None:
            tensor.grad = None
    logprobs, entropy = fn(hidden, weight, labels, lm_head_bias=bias, **kw)
    loss = 0
    if coef_lp is not None:
        loss = loss + (logprobs * coef_lp).sum()
    if coef_ent is not None:
        loss = loss + (entropy * coef_ent).sum()
    loss.backward()
    grads = [t.grad.clone() if t is not None else None for t in (hidden, weight, bias)]
    return logprobs.detach(), (entropy.detach() if entropy is not None else None), grads


@pytest.fixture
def traced_chunk_math(monkeypatch):
    """compiled=True traced by Dynamo with the "eager" backend: the compiled path's math, without code generation."""
    from rlanywhere import logprobs

    monkeypatch.setattr(logprobs, "COMPILE_BACKEND", "eager")


@pytest.mark.parametrize("use_logprobs,use_entropy", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("compiled", [False, True])
def test_chunked_matches_naive_values_and_gradients(use_logprobs, use_entropy, temperature, compiled,
                                                    traced_chunk_math):
    hidden, weight, bias, labels = _inputs()
    g = torch.Generator().manual_seed(1)
    coef_lp = torch.randn(labels.shape, generator=g) if use_logprobs else None
    coef_ent = torch.randn(labels.shape, generator=g) if use_entropy else None
    kw = dict(temperature=temperature, with_entropy=True)
    got_kw = dict(kw, compiled=compiled)
    # 21 tokens in chunks of 5: the last chunk is partial
    got = _grads(chunked_logprobs_and_entropy, hidden, weight, bias, labels, coef_lp, coef_ent, chunk_size=5,
                 **got_kw)
    ref = _grads(naive_logprobs_and_entropy, hidden, weight, bias, labels, coef_lp, coef_ent, **kw)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)
    for name, a, b in zip(("hidden", "weight", "bias"), got[2], ref[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"grad w.r.t. {name}")


def test_naive_reference_is_hand_checkable():
    # one token, H=1, V=2: logits = [2*1, 2*(-1)] / T
    hidden = torch.tensor([[[2.0]]])
    weight = torch.tensor([[1.0], [-1.0]])
    labels = torch.tensor([[0]])
    for fn in (naive_logprobs_and_entropy, chunked_logprobs_and_entropy):
        lp, ent = fn(hidden, weight, labels, temperature=2.0, with_entropy=True)
        # z = [1, -1]; log p0 = 1 - log(e + e^-1)
        expected_lp = 1.0 - torch.log(torch.tensor(torch.e + 1 / torch.e))
        p0 = torch.exp(expected_lp)
        expected_ent = -(p0 * torch.log(p0) + (1 - p0) * torch.log(1 - p0))
        torch.testing.assert_close(lp, expected_lp.view(1, 1))
        torch.testing.assert_close(ent, expected_ent.view(1, 1))


@pytest.mark.parametrize("chunk_size,compiled", [(1, False), (4, False), (21, False), (1000, False), (4, True)])
def test_chunk_sizes_without_entropy_and_without_bias(chunk_size, compiled, traced_chunk_math):
    hidden, weight, _, labels = _inputs(bias=False, seed=3)
    coef = torch.randn(labels.shape, generator=torch.Generator().manual_seed(4))
    got = _grads(chunked_logprobs_and_entropy, hidden, weight, None, labels, coef, None, chunk_size=chunk_size,
                 compiled=compiled)
    ref = _grads(naive_logprobs_and_entropy, hidden, weight, None, labels, coef, None)
    assert got[1] is None and ref[1] is None
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2][0], ref[2][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2][1], ref[2][1], atol=1e-5, rtol=1e-5)


def test_low_precision_inputs_give_fp32_outputs_and_input_dtype_grads():
    hidden, weight, bias, labels = _inputs(seed=5)
    hidden_bf16 = hidden.detach().to(torch.bfloat16).requires_grad_()
    weight_bf16 = weight.detach().to(torch.bfloat16).requires_grad_()
    lp, ent = chunked_logprobs_and_entropy(hidden_bf16, weight_bf16, labels, chunk_size=4, with_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    # same numbers as the fp32 reference on the bf16-rounded inputs
    ref_lp, ref_ent = naive_logprobs_and_entropy(hidden_bf16.float(), weight_bf16.float(), labels, with_entropy=True)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    (lp.sum() + ent.sum()).backward()
    assert hidden_bf16.grad.dtype == torch.bfloat16 and weight_bf16.grad.dtype == torch.bfloat16


def test_full_logits_are_never_saved_for_backward():
    n, t, v = 4, 8, 64
    hidden, weight, bias, labels = _inputs(n=n, t=t, v=v, seed=6)
    largest = {}

    def pack(tensor):
        largest["numel"] = max(largest.get("numel", 0), tensor.numel())
        return tensor

    for fn, expect_full in ((naive_logprobs_and_entropy, True), (chunked_logprobs_and_entropy, False)):
        largest.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            lp, ent = fn(hidden, weight, labels, lm_head_bias=bias, chunk_size=8, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
        assert (largest["numel"] >= n * t * v) == expect_full, (fn.__name__, largest)


def test_bad_inputs_have_clear_errors():
    hidden, weight, bias, labels = _inputs()
    with pytest.raises(ValueError, match="labels must lie in"):
        chunked_logprobs_and_entropy(hidden, weight, labels.masked_fill(labels == labels[0, 0], -100))
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs_and_entropy(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs_and_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="lm_head_weight"):
        chunked_logprobs_and_entropy(hidden, weight[:, :3], labels)


# ------------------------------------------------------------------------------------------------ from a model


def tiny_qwen2(seed=0, tie=True):
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=256, tie_word_embeddings=tie,
    )
    return transformers.Qwen2ForCausalLM(config).eval()


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=256, tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


def left_padded_batch(vocab, prompt_lens=(5, 3, 6), response_lens=(4, 2, 3), pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    p, r = max(prompt_lens), max(response_lens)
    n = len(prompt_lens)
    ids = torch.full((n, p + r), pad, dtype=torch.long)
    mask = torch.zeros(n, p + r, dtype=torch.long)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens)):
        ids[i, p - pl : p + rl] = torch.randint(1, vocab, (pl + rl,), generator=g)
        mask[i, p - pl : p + rl] = 1
    return ids, mask, r


def hf_reference_logprobs(model, ids, mask, r, temperature=1.0):
    logits = model(input_ids=ids, attention_mask=mask, position_ids=default_position_ids(mask)).logits
    logp = torch.log_softmax(logits[:, -r - 1 : -1].float() / temperature, dim=-1)
    return logp.gather(-1, ids[:, -r:, None]).squeeze(-1)


@pytest.mark.parametrize("make_model", [tiny_qwen2, tiny_llama])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_response_logprobs_match_hf_full_forward_values_and_param_grads(make_model, temperature):
    model = make_model()
    ids, mask, r = left_padded_batch(model.config.vocab_size)
    response_mask = mask[:, -r:].float()

    ref = hf_reference_logprobs(model, ids, mask, r, temperature)
    (ref * response_mask).sum().backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    got, ent = response_logprobs(model, ids, mask, r, temperature=temperature, chunk_size=4)
    assert ent is None and got.shape == (3, r) and got.dtype == torch.float32
    torch.testing.assert_close(got * response_mask, ref.detach() * response_mask, atol=1e-5, rtol=1e-5)
    (got * response_mask).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_response_logprobs_entropy_matches_hf():
    model = tiny_qwen2(seed=1)
    ids, mask, r = left_padded_batch(model.config.vocab_size, seed=2)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=default_position_ids(mask)).logits
        logp = torch.log_softmax(logits[:, -r - 1 : -1], dim=-1)
        ref_entropy = -(logp.exp() * logp).sum(-1)
        _, ent = response_logprobs(model, ids, mask, r, with_entropy=True, chunk_size=5)
    real = mask[:, -r:].bool()  # values at response padding are meaningless (the caller masks them)
    torch.testing.assert_close(ent[real], ref_entropy[real], atol=1e-5, rtol=1e-5)


def test_response_logprobs_under_autocast():
    model = tiny_qwen2(seed=2)
    ids, mask, r = left_padded_batch(model.config.vocab_size, seed=3)
    with torch.no_grad():
        fp32, _ = response_logprobs(model, ids, mask, r)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed, ent = response_logprobs(model, ids, mask, r, with_entropy=True)
    assert mixed.dtype == torch.float32 and ent.dtype == torch.float32
    valid = mask[:, -r:].bool()
    # bf16 decoder: close to fp32 but not equal
    assert (mixed[valid] - fp32[valid]).abs().max() < 0.1


def test_response_logprobs_rejects_bad_response_len():
    model = tiny_qwen2()
    ids, mask, r = left_padded_batch(model.config.vocab_size)
    with pytest.raises(ValueError, match="response_len"):
        response_logprobs(model, ids, mask, ids.shape[1])


@pytest.mark.parametrize(
    "config_cls,extra",
    [(transformers.GraniteConfig, {"logits_scaling": 4.0}), (transformers.CohereConfig, {"logit_scale": 0.25})],
)
def test_constant_logit_scalings_are_folded_into_temperature(config_cls, extra):
    torch.manual_seed(0)
    config = config_cls(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=128, **extra,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, mask, r = left_padded_batch(64, seed=4)
    with torch.no_grad():
        ref = hf_reference_logprobs(model, ids, mask, r, temperature=0.5)
        got, _ = response_logprobs(model, ids, mask, r, temperature=0.5)
    valid = mask[:, -r:].bool()
    torch.testing.assert_close(got[valid], ref[valid], atol=1e-5, rtol=1e-5)


def test_logit_softcapping_is_refused_clearly():
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, max_position_embeddings=128, final_logit_softcapping=30.0,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, mask, r = left_padded_batch(64, seed=4)
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        response_logprobs(model, ids, mask, r)
