"""Shared prompts in the training passes (prompt_sharing.py, planner/training.py).

A micro-batch becomes one token stream with each distinct prompt once; attention gathers each response's keys (its
prompt and itself, never a sibling). These tests check the stream's layout, that log-probs, entropy, values and
gradients equal the packed-row passes' (fp64, where transformers' RMSNorm still rounds to fp32: see
test_loss_invariance.py), that a response cannot see its siblings, sliding windows, the micro-batch split, the
planner's choice and that the attention name never reaches a saved config."""

from __future__ import annotations

import pytest
import torch
import transformers

from rlanywhere.config import load_config
from rlanywhere.logprobs import response_logprobs
from rlanywhere.machine import HardwareProbe
from rlanywhere.microbatch import pack_rows
from rlanywhere.models import ModelSource, ValueModel, hf_attention_implementation, load_causal_lm, response_values
from rlanywhere.planner import PlanError, make_plan, plan_prompt_sharing
from rlanywhere.plans import Plan
from rlanywhere import prompt_sharing
from rlanywhere.prompt_sharing import MASKED, VARLEN, pack_shared_prompts, split_rows_keeping_prompts
from rlanywhere.vocabulary import SDPA_EXPANDED_KV_SHARED_PROMPTS, SDPA_SHARED_PROMPTS

from .test_logprobs import tiny_llama, tiny_qwen2

PAD = 0


def grouped_batch(vocab: int, seed: int = 0):
    """6 rows of 2 prompts (rows 0, 2, 5 share prompt A; 1, 3, 4 prompt B, shorter: left-padded), interleaved, with
    response lengths 5, 3, 1, 5, 4, 2 (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    prompt_a = torch.randint(3, vocab, (7,), generator=g)
    prompt_b = torch.randint(3, vocab, (4,), generator=g)
    prompt_ids = torch.zeros(6, 7, dtype=torch.long)
    prompt_mask = torch.zeros(6, 7, dtype=torch.long)
    for row in (0, 2, 5):
        prompt_ids[row], prompt_mask[row] = prompt_a, 1
    for row in (1, 3, 4):
        prompt_ids[row, 3:], prompt_mask[row, 3:] = prompt_b, 1
    response_ids = torch.randint(3, vocab, (6, 5), generator=g)
    response_mask = torch.zeros(6, 5, dtype=torch.long)
    for row, length in enumerate((5, 3, 1, 5, 4, 2)):
        response_mask[row, :length] = 1
        response_ids[row, length:] = PAD
    return prompt_ids, prompt_mask, response_ids, response_mask


def with_shared_attention(model, expand: bool = False):
    model.config._attn_implementation = hf_attention_implementation(
        Plan(share_prompts=True, expand_kv_heads=expand))
    return model.double()


def packed_logprobs(model, batch, rows, with_entropy=True):
    micro = pack_rows(*batch, rows, PAD)
    return response_logprobs(model, micro.input_ids, micro.attention_mask, micro.response_len, with_entropy=with_entropy,
                             position_ids=micro.position_ids, response_start=micro.response_start)


def shared_logprobs(model, batch, rows, with_entropy=True, width_multiple=1, kernel=MASKED):
    micro = pack_shared_prompts(*batch, rows, PAD, width_multiple, kernel).to("cpu")
    return response_logprobs(model, None, None, 0, with_entropy=with_entropy, shared=micro)


def reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's contract, written out with SDPA per sequence (flash is CUDA-only):
    q [Tq, H, D], k/v [Tk, KV, D]; window (left, 0) is causal from the bottom right (a sequence's queries are the
    last of its keys), at most `left` keys back."""
    assert window_size[1] == 0 and max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
    out = []
    for s in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[s]:cu_q[s + 1]].transpose(0, 1), k[cu_k[s]:cu_k[s + 1]].transpose(0, 1), v[cu_k[s]:cu_k[s + 1]].transpose(0, 1)
        if enable_gqa:
            ks, vs = (t.repeat_interleave(qs.shape[0] // ks.shape[0], dim=0) for t in (ks, vs))
        rows = torch.arange(qs.shape[1])[:, None] + ks.shape[1] - qs.shape[1]
        cols = torch.arange(ks.shape[1])[None]
        mask = (cols <= rows) & ((cols >= rows - window_size[0]) if window_size[0] >= 0 else True)
        out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(out)


@pytest.fixture(params=[MASKED, VARLEN])
def kernel(request, monkeypatch):
    """Each shared-stream attention; VARLEN through the reference above on the CPU (the GPU run compares flash's)."""
    if request.param == VARLEN:
        monkeypatch.setattr(prompt_sharing, "varlen_attention_function", lambda: reference_varlen_attn)
    return request.param


def test_the_stream_holds_each_prompt_once_and_every_token_is_one_query():
    batch = grouped_batch(50)
    micro = pack_shared_prompts(*batch, list(range(6)), PAD, width_multiple=8).to("cpu")
    real = 7 + 4 + (5 + 3 + 1 + 5 + 4 + 2)  # two prompts once, the responses
    assert micro.input_ids.shape == (1, 32) and real == 31  # rounded up to a multiple of 8
    assert micro.response_len == 5
    # prompt A, then the responses of rows 0, 2, 5; positions restart at each prompt and continue into responses
    assert micro.input_ids[0, :7].tolist() == batch[0][0].tolist()
    assert micro.position_ids[0, :7 + 5 + 1 + 2].tolist() == list(range(12)) + [7] + [7, 8]
    assert micro.input_ids[0, micro.label_index[0]].tolist() == batch[2][0].tolist()
    assert micro.before_index[0, 0] == 6 and micro.before_index[2, 0] == 6  # both predicted from A's last token
    # each stream token is the query of exactly one slot, and that slot's query is the token itself
    layout = micro.layout
    assert sorted(layout.slot_of_token.tolist()) == sorted(set(layout.slot_of_token.tolist()))
    assert torch.equal(layout.query_index.flatten()[layout.slot_of_token], torch.arange(32))
    # a response's keys are its prompt and itself: rows 0 and 3 see the most (7 + 5 and 4 + 5)
    assert layout.key_counts.max() == 7 + 5 and 4 + 5 in layout.key_counts.tolist()


def test_a_long_prompt_with_short_responses_is_cut_into_few_chunks():
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 50, (1, 200), generator=g).repeat(2, 1)
    response_ids = torch.randint(3, 50, (2, 1), generator=g)
    ones = lambda t: torch.ones_like(t)  # noqa: E731
    micro = pack_shared_prompts(prompt_ids, ones(prompt_ids), response_ids, ones(response_ids), [0, 1], PAD)
    # the masked layout: the prompt's queries in 4 chunks of <= 64 (not 200 of the 1-token responses' length), and
    # the 2 responses
    assert micro.layout.key_counts.tolist() == [64, 128, 192, 200, 201, 201]


@pytest.mark.parametrize("make, expand", [(tiny_qwen2, False), (tiny_llama, False), (tiny_qwen2, True)])
def test_log_probs_entropy_and_gradients_equal_packed_rows(make, expand, kernel):
    model = with_shared_attention(make(), expand)
    batch = grouped_batch(model.config.vocab_size)
    rows = list(range(6))
    mask = batch[3].bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * mask

    def run(fn, **kwargs):
        model.zero_grad()
        logprobs, entropy = fn(model, batch, rows, **kwargs)
        ((logprobs * weights).sum() + (entropy * weights).sum()).backward()
        return logprobs, entropy, torch.cat([p.grad.flatten() for p in model.parameters()])

    ref_lp, ref_ent, ref_grad = run(packed_logprobs)
    lp, ent, grad = run(shared_logprobs, width_multiple=8, kernel=kernel)
    torch.testing.assert_close(lp[mask], ref_lp[mask], rtol=0, atol=1e-12)
    torch.testing.assert_close(ent[mask], ref_ent[mask], rtol=0, atol=1e-12)
    assert ref_grad.abs().max() > 1e-2
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_a_response_never_sees_its_siblings(kernel):
    model = with_shared_attention(tiny_qwen2())
    batch = grouped_batch(model.config.vocab_size)
    before, _ = shared_logprobs(model, batch, list(range(6)), with_entropy=False, kernel=kernel)
    changed = tuple(t.clone() for t in batch)
    changed[2][0, 1:] = (changed[2][0, 1:] + 1) % model.config.vocab_size  # row 0's response from its 2nd token on
    after, _ = shared_logprobs(model, changed, list(range(6)), with_entropy=False, kernel=kernel)
    mask = batch[3].bool()
    assert (after[0, 2:] - before[0, 2:]).abs().max() > 1e-3  # row 0 itself changes
    siblings = [2, 5]  # same prompt as row 0
    torch.testing.assert_close(after[siblings][mask[siblings]], before[siblings][mask[siblings]], rtol=0, atol=0)


def test_values_equal_packed_rows(kernel):
    critic = ValueModel.from_causal_lm(with_shared_attention(tiny_qwen2()))
    critic.double()
    batch = grouped_batch(critic.config.vocab_size)
    rows = [0, 1, 2, 3, 4, 5]
    packed = pack_rows(*batch, rows, PAD)
    reference = response_values(critic, packed.input_ids, packed.attention_mask, packed.response_len,
                                packed.position_ids, response_start=packed.response_start)
    shared = pack_shared_prompts(*batch, rows, PAD, kernel=kernel).to("cpu")
    values = response_values(critic, None, None, shared.response_len, shared=shared)
    mask = batch[3].bool()
    torch.testing.assert_close(values[mask], reference[mask], rtol=0, atol=1e-12)


def test_sliding_window_attention_is_kept(kernel):
    torch.manual_seed(0)
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                        max_position_embeddings=256, sliding_window=4)
    model = with_shared_attention(transformers.MistralForCausalLM(config))
    batch = grouped_batch(64)
    mask = batch[3].bool()
    reference, _ = packed_logprobs(model, batch, list(range(6)), with_entropy=False)
    shared, _ = shared_logprobs(model, batch, list(range(6)), with_entropy=False, kernel=kernel)
    torch.testing.assert_close(shared[mask], reference[mask], rtol=0, atol=1e-12)
    model.config.sliding_window = None  # the window mattered: without it the log-probs differ
    unwindowed, _ = shared_logprobs(model, batch, list(range(6)), with_entropy=False, kernel=kernel)
    assert (unwindowed[mask] - reference[mask]).abs().max() > 1e-4


def test_calls_without_a_stream_run_plain_sdpa_with_masks():
    """The same model still serves left-padded batches and generation (transformers builds their masks)."""
    model = with_shared_attention(tiny_qwen2())
    plain = tiny_qwen2().double()
    ids = torch.tensor([[0, 0, 5, 6, 7], [4, 5, 6, 7, 8]])
    mask = (ids != 0).long()
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                               plain(input_ids=ids, attention_mask=mask).logits[mask.bool()])


def test_micro_batches_keep_a_prompts_rows_together():
    keys = [("a",), ("b",), ("a",), ("b",), ("b",), ("a",)]
    assert split_rows_keeping_prompts(keys, [5, 3, 1, 5, 4, 2], 3) == [[0, 2, 5], [1, 3, 4]]
    assert split_rows_keeping_prompts(keys, [5, 3, 1, 5, 4, 2], 4) == [[0, 1, 2, 5], [3, 4]]
    # token budget: a prompt costs its length once per micro-batch (keys of length 1 here), responses their own
    assert split_rows_keeping_prompts(keys, [5, 3, 1, 5, 4, 2], 10, by_tokens=True) == [[0, 2, 5], [1, 3], [4]]
    # and at most N tokens counted as packed rows (each row its prompt and response): 6 + 2 + 3 <= 12
    assert split_rows_keeping_prompts(keys, [5, 3, 1, 5, 4, 2], 10, by_tokens=True, row_tokens=12) == [
        [0, 2, 5], [1, 3], [4]]
    assert split_rows_keeping_prompts(keys, [5, 3, 1, 5, 4, 2], 10, by_tokens=True, row_tokens=8) == [
        [0, 2], [1, 5], [3], [4]]  # rows 0+2 hold 6 + 2; row 5 then 3 + row 1's 4; rows 3+4 would hold 6 + 5
    # padded (the masked kernel): each row's sequence as long as the micro-batch's longest, 2 x 6 but not 3 x 6
    assert split_rows_keeping_prompts(keys, [5, 3, 1, 5, 4, 2], 10, by_tokens=True, row_tokens=12, padded=True) == [
        [0, 2], [1, 5], [3, 4]]
    with pytest.raises(ValueError, match="positive"):
        split_rows_keeping_prompts(keys, [1] * 6, 0)
    with pytest.raises(ValueError, match="by_tokens"):
        split_rows_keeping_prompts(keys, [1] * 6, 4, row_tokens=8)


GRPO = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=grpo",
        "data.train_batch_size=16", "data.max_prompt_length=256", "data.max_response_length=256",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16"]


@pytest.mark.parametrize("card, overrides, expected", [
    ("p40", ("actor_rollout_ref.rollout.n=8",), True),  # fp32: no flash kernel, packed rows use the masked ones too
    ("t4", ("actor_rollout_ref.rollout.n=8",), True),
    ("h100", ("actor_rollout_ref.rollout.n=8", "actor_rollout_ref.model.enable_gradient_checkpointing=true"), True),
    ("h100", ("actor_rollout_ref.rollout.n=8",), True),  # bf16 flash: varlen flash for the shared stream
    (None, ("actor_rollout_ref.rollout.n=4",), True),
    ("h100", ("actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=gae"), False),  # nothing to share
    ("p40", ("actor_rollout_ref.rollout.n=8", "hardware.share_prompts=false"), False),
    ("p40", ("actor_rollout_ref.rollout.n=8", "hardware.attn_implementation=eager"), False),
    ("h100", ("actor_rollout_ref.rollout.n=8", "hardware.share_prompts=true"), True),
    ("h100", ("actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=gae", "hardware.share_prompts=true"), True),
])
def test_the_planner_shares_prompts_for_groups(card, overrides, expected):
    plan = make_plan(load_config(None, [*GRPO, *overrides]), HardwareProbe.fake(card))
    assert plan.share_prompts is expected
    assert plan.reasons["share_prompts"]
    assert "shared prompts" in plan.summary()


def test_prompts_are_not_shared_when_their_attention_would_not_fit_the_budget():
    """Long responses on a P40 with LoRA: the searched micro-batch fits as packed rows, but the shared attention's
    buffers would take the update over the budget: sharing is off and the plan's peak fits (it printed a plan at
    110% of the budget); forced on, it stays on."""
    long = [*GRPO[:4], "data.max_response_length=5120", "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.model.lora_rank=16", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    plan = make_plan(load_config(None, long), HardwareProbe.fake("p40"))
    assert not plan.share_prompts and "more than the" in plan.reasons["share_prompts"]
    assert plan.estimate["peak_bytes"] <= plan.memory_budget_bytes
    assert make_plan(load_config(None, [*long, "hardware.share_prompts=true"]), HardwareProbe.fake("p40")).share_prompts


@pytest.mark.parametrize("flash, varlen, compiled, checkpointing, expected", [
    (True, True, True, False, (True, VARLEN)),
    (True, True, False, False, (False, VARLEN)),  # eager passes: the per-layer gathers cost more (measured)
    (True, True, False, True, (True, VARLEN)),
    (True, False, True, False, (False, MASKED)),  # flash on packed rows beats the masked stream (measured)
    (True, False, True, True, (True, MASKED)),  # ... unless checkpointing recomputes the forward
    (False, True, False, False, (True, MASKED)),  # no flash for this dtype: packed rows use the masked kernels too
])
def test_the_shared_stream_attention_follows_the_flash_kernel(flash, varlen, compiled, checkpointing, expected):
    plan = Plan(gradient_checkpointing=checkpointing, compile_training=compiled)
    plan_prompt_sharing(plan, None, 8, "qwen2", flash_runs=flash, varlen=varlen)
    assert (plan.share_prompts, plan.shared_prompt_kernel) == expected
    assert plan.reasons["share_prompts"] and plan.reasons["shared_prompt_kernel"]


@pytest.mark.parametrize("flash", [True, False])
def test_the_planner_looks_for_varlen_attention_only_where_a_flash_kernel_runs(monkeypatch, flash):
    """Importing torch.nn.attention.varlen imports torch._dynamo (a second of CPU at every plan): a CPU or a card
    without flash never reads it, so it is not imported there."""
    from rlanywhere import machine

    looked = []
    monkeypatch.setattr(machine, "varlen_attention_function", lambda: looked.append(True) or reference_varlen_attn)
    plan = Plan(gradient_checkpointing=False, compile_training=True)
    plan_prompt_sharing(plan, None, 8, "qwen2", flash_runs=flash)
    assert looked == ([True] if flash else [])
    assert plan.shared_prompt_kernel == (VARLEN if flash else MASKED)


def test_asking_for_shared_prompts_where_they_cannot_run_is_refused():
    cfg = load_config(None, [*GRPO, "actor_rollout_ref.rollout.n=8", "hardware.attn_implementation=eager",
                             "hardware.share_prompts=true"])
    with pytest.raises(PlanError, match="share_prompts=true: attention is eager"):
        make_plan(cfg, HardwareProbe.fake("h100"))


@pytest.mark.parametrize("expand, name", [(False, SDPA_SHARED_PROMPTS), (True, SDPA_EXPANDED_KV_SHARED_PROMPTS)])
def test_the_loader_registers_the_attention_and_never_saves_its_name(tmp_path, expand, name):
    tiny_qwen2().save_pretrained(tmp_path / "in")
    model = load_causal_lm(ModelSource(str(tmp_path / "in")), Plan(share_prompts=True, expand_kv_heads=expand))
    assert model.config._attn_implementation == name
    model.save_pretrained(tmp_path / "out")
    assert "rlanywhere" not in (tmp_path / "out" / "config.json").read_text()
