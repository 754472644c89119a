"""Grouped-query K/V heads and SDPA's kernels (planner/training.py, models.sdpa_expanded_kv_attention).

transformers hands SDPA a grouped-query model's K/V heads as they are (enable_gqa=True) whenever a batch needs no
mask, and packed training rows never do. On CUDA only SDPA's flash kernel takes grouped heads, so in fp32 and on
cards below compute capability 8.0 PyTorch falls back to its math kernel (T x T scores per head kept for the
backward). The plan expands the heads there; these tests check where it does, that the expanded attention computes
what transformers' computes, and that SDPA then sees equal head counts (what lets its memory-efficient kernel run;
the kernel choice itself is only visible on a GPU: docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlanywhere.config import load_config
from rlanywhere.logprobs import response_logprobs
from rlanywhere.machine import HardwareProbe
from rlanywhere.microbatch import pack_rows
from rlanywhere.models import ModelSource, hf_attention_implementation, load_causal_lm
from rlanywhere.planner import make_plan
from rlanywhere.plans import Plan
from rlanywhere.vocabulary import SDPA_EXPANDED_KV

from .test_logprobs import tiny_llama, tiny_qwen2
from .test_rollout import tiny_model

GRPO_05B = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=grpo",
            "data.train_batch_size=16", "data.max_prompt_length=256", "data.max_response_length=256",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.rollout.n=8"]


def plan_for(card, *overrides):
    return make_plan(load_config(None, [*GRPO_05B, *overrides]), HardwareProbe.fake(card))


@pytest.mark.parametrize("card, overrides, expand", [
    ("p40", (), True),  # fp32: no flash kernel in fp32
    ("t4", (), True),  # fp16 on compute capability 7.5: no flash kernel below 8.0
    ("v100", (), True),
    ("h100", (), False),  # bf16 on 9.0: flash takes grouped heads
    ("a100-80g", ("hardware.precision=fp32",), True),
    ("h100", ("hardware.attn_implementation=eager",), False),
    (None, (), False),  # CPU: its flash kernel takes grouped heads in fp32
])
def test_kv_heads_expanded_where_sdpa_would_fall_back_to_its_math_kernel(card, overrides, expand):
    plan = plan_for(card, *overrides)
    assert plan.expand_kv_heads is expand
    reason = plan.reasons["expand_kv_heads"]
    assert ("math kernel" in reason) is expand, reason
    assert "grouped K/V heads" in plan.summary()
    plan.share_prompts = False  # the name with shared prompts: tests/test_prompt_sharing.py
    assert hf_attention_implementation(plan) == (SDPA_EXPANDED_KV if expand else plan.attn_implementation)


def _twins(make, dtype=torch.float64):
    """The same weights twice: transformers' SDPA attention, and ours with expanded heads."""
    reference = make().to(dtype)
    ours = make().to(dtype)
    ours.load_state_dict(reference.state_dict())
    reference.config._attn_implementation = "sdpa"
    ours.config._attn_implementation = hf_attention_implementation(Plan(expand_kv_heads=True))
    return reference, ours


def _batch(vocab):
    torch.manual_seed(1)
    ids = torch.randint(3, vocab, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[2, :1] = 0
    mask[1, -2:] = 0
    return ids, mask


@pytest.mark.parametrize("make", [tiny_qwen2, tiny_llama, lambda: tiny_model("qwen3")], ids=["qwen2", "llama", "qwen3"])
def test_expanded_heads_give_transformers_log_probs_and_gradients_on_packed_rows(make):
    reference, ours = _twins(make)
    ids, mask = _batch(reference.config.vocab_size)
    packed = pack_rows(ids[:, :5], mask[:, :5], ids[:, 5:], mask[:, 5:], [0, 1, 2], pad_token_id=0)
    out = []
    for model in (reference, ours):
        model.zero_grad()
        logprob, entropy = response_logprobs(model, packed.input_ids, packed.attention_mask, packed.response_len,
                                             with_entropy=True, position_ids=packed.position_ids,
                                             response_start=packed.response_start)
        (logprob.sum() + 0.1 * entropy.sum()).backward()
        out.append((logprob.detach(), [p.grad.clone() for p in model.parameters()]))
    (ref_lp, ref_grads), (our_lp, our_grads) = out
    torch.testing.assert_close(our_lp, ref_lp, rtol=0, atol=1e-12)
    for ours_g, ref_g in zip(our_grads, ref_grads):
        torch.testing.assert_close(ours_g, ref_g, rtol=1e-10, atol=1e-12)


def test_expanded_heads_match_transformers_with_left_padding_and_in_generate():
    reference, ours = _twins(tiny_qwen2)
    ids, mask = _batch(reference.config.vocab_size)
    torch.testing.assert_close(ours(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits,
                               rtol=0, atol=1e-12)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), reference.generate(ids, **kwargs))


@pytest.fixture()
def sdpa_calls(monkeypatch):
    """(query heads, key heads, value heads, enable_gqa) of every SDPA call."""
    calls = []
    original = F.scaled_dot_product_attention

    def recording(query, key, value, *args, **kwargs):
        calls.append((query.shape[1], key.shape[1], value.shape[1], bool(kwargs.get("enable_gqa", False))))
        return original(query, key, value, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


def test_sdpa_gets_equal_head_counts_and_no_enable_gqa_only_when_expanded(sdpa_calls):
    reference, ours = _twins(tiny_qwen2, torch.float32)
    ids = torch.randint(3, reference.config.vocab_size, (2, 8))
    reference(ids).logits.sum().backward()  # no mask: transformers passes the grouped heads
    assert sdpa_calls and all(c == (4, 2, 2, True) for c in sdpa_calls), sdpa_calls
    sdpa_calls.clear()
    ours(ids).logits.sum().backward()
    assert sdpa_calls and all(c == (4, 4, 4, False) for c in sdpa_calls), sdpa_calls


def test_the_loader_applies_the_plans_choice(tmp_path):
    tiny_qwen2().save_pretrained(tmp_path / "in")
    for expand, name in ((False, "sdpa"), (True, SDPA_EXPANDED_KV)):
        model = load_causal_lm(ModelSource(str(tmp_path / "in")), Plan(expand_kv_heads=expand))
        assert model.config._attn_implementation == name
    model.save_pretrained(tmp_path / "out")  # a checkpoint loads anywhere: our attention name is not written
    assert SDPA_EXPANDED_KV not in (tmp_path / "out" / "config.json").read_text()
