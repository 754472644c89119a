import random

import pytest
import torch

from rlanywhere.microbatch import (
    compact_rows,
    pack_rows,
    scatter_back,
    select_response,
    split_by_token_budget,
    split_fixed,
    split_rows_by_length,
    split_rows_by_token_budget,
)


def test_split_fixed():
    assert split_fixed(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert split_fixed(4, 4) == [[0, 1, 2, 3]]
    assert split_fixed(0, 2) == []
    with pytest.raises(ValueError, match="micro_batch_size"):
        split_fixed(4, 0)


def test_token_budget_hand_example():
    # sorted longest first: 10(2), 8(0), 5(3), 4(1), 3(4); budget 20
    # [2,0] -> 2*10=20 ok; +3 -> 3*10=30 no.  [3,1,4] -> 3*5=15 ok
    assert split_by_token_budget([8, 4, 10, 5, 3], 20) == [[0, 2], [1, 3, 4]]


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_covers_each_index_once_and_respects_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 60))]
    budget = rng.randint(100, 400)
    groups = split_by_token_budget(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        assert len(group) * max(lengths[i] for i in group) <= budget
    # packing is not silly: never more groups than one per row and fewer than rows when all fit in pairs
    if max(lengths) * 2 <= budget:
        assert len(groups) < len(lengths) or len(lengths) == 1


def test_row_longer_than_budget_gets_own_group_with_warning():
    with pytest.warns(UserWarning, match="longer than the micro-batch token budget"):
        groups = split_by_token_budget([5, 50, 6], 20)
    assert sorted(i for g in groups for i in g) == [0, 1, 2]
    assert [1] in groups
    assert [0, 2] in groups


def _rollout(prompt_lens, response_lens, pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, p, r = len(prompt_lens), max(prompt_lens), max(max(response_lens), 1)
    prompt_ids = torch.full((b, p), pad)
    prompt_mask = torch.zeros(b, p, dtype=torch.long)
    response_ids = torch.full((b, r), pad)
    response_mask = torch.zeros(b, r, dtype=torch.long)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens)):
        prompt_ids[i, p - pl :] = torch.randint(1, 50, (pl,), generator=g)
        prompt_mask[i, p - pl :] = 1
        response_ids[i, :rl] = torch.randint(1, 50, (rl,), generator=g)
        response_mask[i, :rl] = 1
    return prompt_ids, prompt_mask, response_ids, response_mask


def test_split_rows_uses_compacted_cost():
    # row 0: long prompt, short response; row 1: short prompt, long response.
    # max(p + r) = 12 per row but compacted width = 10 + 10 = 20, so two rows cost 40 > 30.
    pm = _rollout([10, 2], [2, 10])
    groups = split_rows_by_token_budget(pm[1], pm[3], 30)
    assert groups == [[0], [1]]
    assert split_by_token_budget([12, 12], 30) == [[0, 1]]  # the naive cost would have grouped them


def test_split_rows_by_length_hand_example():
    # compacted lengths (prompt + response): 4, 14, 6, 12 -> longest first 1, 3, 2, 0 -> groups {1, 3}, {0, 2}
    batch = _rollout([2, 10, 3, 6], [2, 4, 3, 6])
    assert split_rows_by_length(batch[1], batch[3], 2) == [[1, 3], [0, 2]]
    assert split_fixed(4, 2) == [[0, 1], [2, 3]]  # what consecutive groups would pad: 2 x 14 + 2 x 12


@pytest.mark.parametrize("seed", range(3))
def test_split_rows_by_length_partitions_like_split_fixed_and_pads_less(seed):
    rng = random.Random(seed)
    n, size = 37, 8
    batch = _rollout([rng.randint(1, 12) for _ in range(n)], [rng.randint(0, 15) for _ in range(n)], seed=seed)
    groups = split_rows_by_length(batch[1], batch[3], size)
    assert sorted(i for g in groups for i in g) == list(range(n))
    assert sorted(len(g) for g in groups) == sorted(len(g) for g in split_fixed(n, size))
    assert all(g == sorted(g) for g in groups)

    def padded_tokens(parts):
        return sum(compact_rows(*batch, rows=g, pad_token_id=0).input_ids.numel() for g in parts)

    assert padded_tokens(groups) <= padded_tokens(split_fixed(n, size))
    with pytest.raises(ValueError, match="micro_batch_size"):
        split_rows_by_length(batch[1], batch[3], 0)


@pytest.mark.parametrize("seed", range(3))
def test_split_rows_budget_holds_for_compacted_batches(seed):
    rng = random.Random(seed)
    n = 20
    batch = _rollout([rng.randint(1, 12) for _ in range(n)], [rng.randint(0, 15) for _ in range(n)], seed=seed)
    budget = 60
    for packed, layout in ((False, compact_rows), (True, pack_rows)):
        groups = split_rows_by_token_budget(batch[1], batch[3], budget, packed=packed)
        assert sorted(i for g in groups for i in g) == list(range(n))
        for group in groups:
            mb = layout(*batch, rows=group, pad_token_id=0)
            assert mb.input_ids.numel() <= budget or len(group) == 1


def test_packed_budget_groups_hold_more_rows_when_long_prompts_meet_long_responses():
    # prompts 8, 1, 8, 1 and responses 1, 8, 1, 8: left-padded, any two rows mixing both cost 2 x 16; packed 2 x 9
    batch = _rollout([8, 1, 8, 1], [1, 8, 1, 8])
    assert len(split_rows_by_token_budget(batch[1], batch[3], 18)) == 4
    packed = split_rows_by_token_budget(batch[1], batch[3], 18, packed=True)
    assert len(packed) == 2 and all(pack_rows(*batch, rows=g, pad_token_id=0).input_ids.numel() == 18 for g in packed)


def test_compact_rows_removes_shared_padding_and_keeps_alignment():
    pad = 7
    prompt_ids, prompt_mask, response_ids, response_mask = _rollout([2, 5, 3, 1], [3, 6, 2, 1], pad=pad)
    # garbage in a padded response slot must come out as the pad id
    response_ids[2, 4] = 99
    rows = [0, 2]
    mb = compact_rows(prompt_ids, prompt_mask, response_ids, response_mask, rows, pad_token_id=pad)
    # prompts of rows 0 and 2 are 2 and 3 long -> 3 prompt columns; responses 3 and 2 long -> R' = 3
    assert mb.response_len == 3
    assert mb.input_ids.shape == (2, 6)
    expected_ids = torch.cat([prompt_ids[rows][:, -3:], response_ids[rows][:, :3]], dim=1)
    expected_mask = torch.cat([prompt_mask[rows][:, -3:], response_mask[rows][:, :3]], dim=1)
    assert torch.equal(mb.attention_mask, expected_mask)
    assert torch.equal(mb.input_ids, expected_ids.masked_fill(expected_mask == 0, pad))
    assert mb.position_ids.tolist() == [[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 4]]
    # response part of the compacted batch lines up with select_response(response_mask)
    assert torch.equal(mb.attention_mask[:, -mb.response_len :], select_response(response_mask, rows, mb.response_len))


def test_compact_rows_keeps_one_response_column_and_rejects_empty_prompts():
    batch = _rollout([2, 3], [0, 0])
    mb = compact_rows(*batch, rows=[0, 1], pad_token_id=0)
    assert mb.response_len == 1 and mb.attention_mask[:, -1].sum() == 0
    batch = _rollout([2, 3], [1, 1])
    batch[1][0] = 0
    with pytest.raises(ValueError, match="no prompt tokens"):
        compact_rows(*batch, rows=[0], pad_token_id=0)


def test_scatter_back_round_trip():
    full = torch.zeros(4, 5)
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    scatter_back(full, [3, 1], values)
    assert full.tolist() == [[0] * 5, [3, 4, 0, 0, 0], [0] * 5, [1, 2, 0, 0, 0]]
    assert torch.equal(select_response(full, [3, 1], 2), values)
    with pytest.raises(ValueError, match="values must be"):
        scatter_back(full, [0], values)


def test_compacted_micro_batches_give_the_full_batch_logprobs():
    import transformers

    from rlanywhere.logprobs import response_logprobs

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=64, max_position_embeddings=128,
        )
    ).eval()
    prompt_ids, prompt_mask, response_ids, response_mask = _rollout([6, 2, 4, 3, 1], [5, 1, 7, 2, 3], pad=0)
    full_ids = torch.cat([prompt_ids, response_ids], 1)
    full_mask = torch.cat([prompt_mask, response_mask], 1)
    with torch.no_grad():
        expected, _ = response_logprobs(model, full_ids, full_mask, response_ids.shape[1])
        got = torch.zeros_like(expected)
        for rows in split_rows_by_token_budget(prompt_mask, response_mask, 24):
            mb = compact_rows(prompt_ids, prompt_mask, response_ids, response_mask, rows, pad_token_id=0)
            lp, _ = response_logprobs(model, mb.input_ids, mb.attention_mask, mb.response_len,
                                      position_ids=mb.position_ids)
            scatter_back(got, rows, lp)
    valid = response_mask.bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-5)


def test_pack_rows_puts_every_row_from_column_zero_hand_example():
    pad = 7
    prompt_ids, prompt_mask, response_ids, response_mask = _rollout([2, 5, 3, 1], [3, 6, 2, 1], pad=pad)
    response_ids[2, 4] = 99  # garbage in a padded response slot never reaches the batch
    rows = [1, 2, 3]
    mb = pack_rows(prompt_ids, prompt_mask, response_ids, response_mask, rows, pad_token_id=pad)
    # rows 1, 2, 3: 5 + 6, 3 + 2, 1 + 1 tokens -> 11 columns (compact_rows: 5 prompt + 6 response columns as well;
    # rows 2 and 3 alone: 4 packed columns against 3 + 2 compacted)
    assert mb.input_ids.shape == (3, 11) and mb.response_len == 6 and mb.response_start.tolist() == [5, 3, 1]
    for i, row in enumerate(rows):
        p, r = int(prompt_mask[row].sum()), int(response_mask[row].sum())
        real = torch.cat([prompt_ids[row, -p:], response_ids[row, :r]])
        assert mb.input_ids[i, :p + r].tolist() == real.tolist()
        assert (mb.input_ids[i, p + r:] == pad).all()
        assert mb.attention_mask[i].tolist() == [1] * (p + r) + [0] * (11 - p - r)
        assert mb.position_ids[i].tolist() == list(range(11))
    narrow = pack_rows(prompt_ids, prompt_mask, response_ids, response_mask, [2, 3], pad_token_id=pad)
    assert narrow.input_ids.shape == (2, 5)  # max(3 + 2, 1 + 1)
    assert compact_rows(prompt_ids, prompt_mask, response_ids, response_mask, [1, 3], pad).input_ids.shape == (2, 11)
    assert pack_rows(prompt_ids, prompt_mask, response_ids, response_mask, [1, 3], pad).input_ids.shape == (2, 11)
    # compiled passes: the width rounded up to a multiple of 8, the extra columns padding like the rest
    wide = pack_rows(prompt_ids, prompt_mask, response_ids, response_mask, rows, pad_token_id=pad, width_multiple=8)
    assert wide.input_ids.shape == (3, 16) and wide.response_len == mb.response_len
    assert torch.equal(wide.input_ids[:, :11], mb.input_ids) and (wide.input_ids[:, 11:] == pad).all()
    assert torch.equal(wide.attention_mask[:, :11], mb.attention_mask) and wide.attention_mask[:, 11:].sum() == 0
    assert wide.position_ids[0].tolist() == list(range(16)) and torch.equal(wide.response_start, mb.response_start)
    assert pack_rows(prompt_ids, prompt_mask, response_ids, response_mask, [1], pad, 11).input_ids.shape == (1, 11)
    batch = _rollout([2, 3], [1, 1])
    batch[1][0] = 0
    with pytest.raises(ValueError, match="no prompt tokens"):
        pack_rows(*batch, rows=[0, 1], pad_token_id=0)


@pytest.mark.parametrize("with_critic", [False, True])
def test_packed_micro_batches_give_the_left_padded_logprobs_values_and_gradients(with_critic):
    """Packed rows (no attention mask, causal only) against the left-padded layout with its mask, for a mix of prompt
    and response lengths: the same log-probs, entropies (or values) and gradients at every real response token."""
    import transformers

    from rlanywhere.logprobs import response_logprobs
    from rlanywhere.models import ValueModel, response_values

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=128, attn_implementation="sdpa"))
    if with_critic:
        model = ValueModel.from_causal_lm(model)
        with torch.no_grad():
            model.value_head.weight.normal_()
    batch = _rollout([6, 2, 4, 3, 1], [5, 1, 7, 2, 3], pad=0, seed=1)
    rows = [0, 1, 2, 3, 4]
    weights = torch.randn(5, 7, generator=torch.Generator().manual_seed(2))

    def run(layout):
        mb = layout(*batch, rows=rows, pad_token_id=0)
        start = mb.response_start if layout is not compact_rows else None
        model.zero_grad(set_to_none=True)
        if with_critic:
            out = response_values(model, mb.input_ids, mb.attention_mask, mb.response_len, mb.position_ids,
                                  response_start=start)
            extra = out
        else:
            out, extra = response_logprobs(model, mb.input_ids, mb.attention_mask, mb.response_len,
                                           with_entropy=True, position_ids=mb.position_ids, response_start=start)
        valid = batch[3][:, :mb.response_len].float()
        ((out * weights * valid).sum() + (extra * valid).sum()).backward()
        return out.detach() * valid, extra.detach() * valid, {n: p.grad.clone() for n, p in model.named_parameters()}

    padded = run(compact_rows)
    # packed, and packed to a width that is a multiple of 8 (compiled plans): the same numbers either way
    for packed in (run(pack_rows), run(lambda *a, **k: pack_rows(*a, **k, width_multiple=8))):
        torch.testing.assert_close(packed[0], padded[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed[1], padded[1], atol=1e-5, rtol=1e-5)
        for name, grad in padded[2].items():
            torch.testing.assert_close(packed[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)
