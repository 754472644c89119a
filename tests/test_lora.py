import copy

import pytest
import torch
import transformers
from torch import nn

from rlanywhere.logprobs import default_position_ids, response_logprobs
from rlanywhere.lora import adapter_disabled, apply_lora, merged_state_for_export, trainable_parameter_summary

from .test_logprobs import tiny_qwen2


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def randomise_lora_b(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)


def test_disabled_adapter_gives_base_logprobs_and_enabled_differs_after_training():
    base = tiny_qwen2()
    reference = copy.deepcopy(base)
    model = apply_lora(base, r=4, alpha=8)
    ids, mask = batch()
    r = 4
    with torch.no_grad():
        expected, _ = response_logprobs(reference, ids, mask, r)
        fresh, _ = response_logprobs(model, ids, mask, r)
        torch.testing.assert_close(fresh, expected)  # LoRA B starts at zero: a no-op
        randomise_lora_b(model)
        enabled, _ = response_logprobs(model, ids, mask, r)
        with adapter_disabled(model):
            disabled, _ = response_logprobs(model, ids, mask, r)
        enabled_again, _ = response_logprobs(model, ids, mask, r)
    torch.testing.assert_close(disabled, expected)
    assert (enabled - expected).abs().max() > 1e-3
    torch.testing.assert_close(enabled_again, enabled)  # the context manager re-enabled the adapters


def test_response_logprobs_through_peft_matches_peft_forward_and_trains_only_lora():
    model = apply_lora(tiny_qwen2(), r=4, alpha=8)
    randomise_lora_b(model)
    ids, mask = batch(seed=2)
    r = 5
    logits = model(input_ids=ids, attention_mask=mask, position_ids=default_position_ids(mask)).logits
    ref = torch.log_softmax(logits[:, -r - 1 : -1], -1).gather(-1, ids[:, -r:, None]).squeeze(-1)
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    got, _ = response_logprobs(model, ids, mask, r, chunk_size=3)
    torch.testing.assert_close(got, ref.detach(), atol=1e-5, rtol=1e-5)
    got.sum().backward()
    assert ref_grads and all("lora_" in n for n in ref_grads)
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
        else:
            assert param.grad is None, name


def test_merged_export_loads_as_plain_model_with_same_logits(tmp_path):
    model = apply_lora(tiny_qwen2(), r=4, alpha=16)
    randomise_lora_b(model)
    ids, mask = batch(seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits

    merged = merged_state_for_export(model)
    assert isinstance(merged, transformers.Qwen2ForCausalLM)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    merged.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        got = loaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    # the training model is untouched: still adapted, same weights, same outputs
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, expected)
    assert trainable_parameter_summary(model)["is_lora"]


def test_all_linear_skips_lm_head_and_modules_to_save():
    model = apply_lora(tiny_qwen2(), r=2, alpha=2)
    targeted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if "lora_A" in n}
    assert len(targeted) == 2 * 7  # q,k,v,o,gate,up,down per layer
    assert not any("lm_head" in n for n in targeted)

    class Critic(nn.Module):  # a value-model-like wrapper: backbone + value head trained in full
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
            self.value_head = nn.Linear(8, 1)

        def forward(self, x):
            return self.value_head(self.backbone(x))

    critic = apply_lora(Critic(), r=2, alpha=4, modules_to_save=["value_head"])
    names = [n for n, p in critic.named_parameters() if p.requires_grad]
    assert any("backbone.0.lora_A" in n for n in names) and any("backbone.2.lora_A" in n for n in names)
    assert not any("value_head" in n and "lora" in n for n in names)
    assert any("value_head" in n and n.endswith("weight") for n in names)


def test_trainable_parameter_summary_counts_tied_weights_once():
    plain = tiny_qwen2()
    summary = trainable_parameter_summary(plain)
    expected_total = sum(p.numel() for p in set(plain.parameters()))
    assert summary["total_params"] == expected_total == summary["trainable_params"]
    assert summary["trainable_percent"] == 100.0 and not summary["is_lora"]
    lora = apply_lora(plain, r=4, alpha=8)
    summary = trainable_parameter_summary(lora)
    # A: r x in, B: out x r for each of the 7 projections in each layer (hidden 64, kv 32, mlp 128)
    shapes = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]
    per_layer = sum(4 * fan_in + fan_out * 4 for fan_in, fan_out in shapes)
    assert summary["trainable_params"] == 2 * per_layer
    assert summary["total_params"] == expected_total + 2 * per_layer


def test_errors_are_clear():
    with pytest.raises(TypeError, match="PeftModel"):
        with adapter_disabled(tiny_qwen2()):
            pass
    with pytest.raises(ValueError, match="rank"):
        apply_lora(tiny_qwen2(), r=0, alpha=8)
    with pytest.raises(ValueError, match="target_modules"):
        apply_lora(tiny_qwen2(), r=4, alpha=8, target_modules="q_proj")
    plain = tiny_qwen2()
    assert merged_state_for_export(plain) is plain


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_lora_gets_gradients_with_gradient_checkpointing(use_reentrant):
    base = tiny_qwen2()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model = apply_lora(base, r=4, alpha=8)
    model.train()
    ids, mask = batch()
    logprobs, _ = response_logprobs(model, ids, mask, 4)
    logprobs.sum().backward()
    lora_a = [p for n, p in model.named_parameters() if "lora_A" in n]
    assert lora_a and all(p.grad is not None for p in lora_a)
