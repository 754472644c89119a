"""Left padding must never hand SDPA a fully masked query row (issue 10: the GPU demo's NaN grad norms).

On CUDA some SDPA kernels give NaN gradients for a query row that may attend to nothing, and a left-padded
micro-batch has such rows at its padding positions; the NaN then reaches every weight. The CPU kernels return
zeros instead, so the NaN itself cannot be shown here: these tests check the condition (the masks SDPA receives
during a training forward and backward) and that the outputs at real positions are unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlanywhere.logprobs import response_logprobs, training_attention_mask
from rlanywhere.models import ValueModel

from .test_logprobs import tiny_qwen2 as _tiny_qwen2


def tiny_qwen2(attn: str):
    model = _tiny_qwen2()
    model.config._attn_implementation = attn
    return model


@pytest.fixture()
def sdpa_masks(monkeypatch):
    """Every attn_mask given to SDPA, as a [.., Lq, Lk] bool 'may attend' tensor (None when causal-only)."""
    seen = []
    original = F.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is None:
            seen.append(None)
        else:
            seen.append(attn_mask if attn_mask.dtype == torch.bool else attn_mask > torch.finfo(attn_mask.dtype).min)
        return original(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return seen


def _left_padded_batch(vocab: int):
    torch.manual_seed(0)
    ids = torch.randint(3, vocab, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :3] = 0  # a 3-token shorter prompt
    mask[2, :1] = 0
    mask[1, -2:] = 0  # a response that ended early (right padding is harmless)
    return ids, mask


def test_training_forward_never_fully_masks_a_query_row(sdpa_masks):
    model = tiny_qwen2(attn="sdpa")
    ids, mask = _left_padded_batch(model.config.vocab_size)
    logprob, entropy = response_logprobs(model, ids, mask, response_len=4, with_entropy=True)
    (logprob.sum() + entropy.sum()).backward()
    assert sdpa_masks and all(m is not None for m in sdpa_masks)
    for attn in sdpa_masks:
        assert bool(attn.any(dim=-1).all()), "a query row may attend to nothing"
    critic = ValueModel.from_causal_lm(tiny_qwen2(attn="sdpa"))
    sdpa_masks.clear()
    critic(ids, mask).sum().backward()
    assert sdpa_masks and all(bool(m.any(dim=-1).all()) for m in sdpa_masks)


def test_outputs_at_real_positions_are_unchanged():
    model = tiny_qwen2(attn="sdpa")
    ids, mask = _left_padded_batch(model.config.vocab_size)
    ours, _ = response_logprobs(model, ids, mask, response_len=4)
    # each row alone, without padding, is the ground truth
    for row in range(3):
        keep = mask[row].bool()
        keep[-4:] = True  # the response columns stay (row 1's last two are padding, compared below only if real)
        alone, _ = response_logprobs(model, ids[row:row + 1, keep], mask[row:row + 1, keep], response_len=4)
        real = mask[row, -4:].bool()
        torch.testing.assert_close(ours[row, real], alone[0, real], rtol=1e-5, atol=1e-5)


def test_no_left_padding_keeps_the_2d_mask():
    model = tiny_qwen2(attn="sdpa")
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, -1] = 0
    assert training_attention_mask(model, mask) is mask
    mask[1, 0] = 0
    built = training_attention_mask(model, mask)
    assert built.shape == (2, 1, 5, 5) and built.dtype == torch.bool
    assert not bool(built[1, 0, 3, 0]) and bool(built[1, 0, 0, 0])  # real queries skip padding; padding sees itself
    assert training_attention_mask(tiny_qwen2(attn="eager"), mask) is mask


def test_packed_rows_give_sdpa_no_mask_at_all(sdpa_masks):
    """The update's layout (microbatch.pack_rows): no padding before a real token, so SDPA gets no mask (causal
    only, its flash kernel where it runs) and no query row can be fully masked."""
    from rlanywhere.microbatch import pack_rows

    model = tiny_qwen2(attn="sdpa")
    ids, mask = _left_padded_batch(model.config.vocab_size)
    prompt_mask, response_mask = mask[:, :5], mask[:, 5:]
    packed = pack_rows(ids[:, :5], prompt_mask, ids[:, 5:], response_mask, [0, 1, 2], pad_token_id=0)
    logprob, entropy = response_logprobs(model, packed.input_ids, packed.attention_mask, packed.response_len,
                                         with_entropy=True, position_ids=packed.position_ids,
                                         response_start=packed.response_start)
    (logprob.sum() + entropy.sum()).backward()
    assert sdpa_masks and all(m is None for m in sdpa_masks)
