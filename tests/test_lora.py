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


def test_all_linear_adapts_gpt2_conv1d_layers():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    model = apply_lora(transformers.GPT2LMHeadModel(config), 4, 8)
    assert sorted(model.peft_config["default"].target_modules) == ["c_attn", "c_fc", "c_proj"]


def test_saved_adapters_on_other_modules_are_refused_not_dropped():
    from peft import get_peft_model_state_dict

    from rlanywhere.lora import load_adapter_state

    saved = get_peft_model_state_dict(apply_lora(tiny_qwen2(), 4, 8, ["q_proj"]))
    same = apply_lora(tiny_qwen2(), 4, 8, ["q_proj"])
    load_adapter_state(same, saved, "ckpt")
    assert all(torch.equal(same.state_dict()[k.replace(".weight", ".default.weight")], v) for k, v in saved.items())
    with pytest.raises(ValueError, match="do not fit this model's.*target_modules"):
        load_adapter_state(apply_lora(tiny_qwen2(), 4, 8, ["o_proj"]), saved, "ckpt")


def test_resume_refuses_a_changed_lora_scale_or_target_only_where_lora_is_on():
    from rlanywhere.runguard import RunDirError, check_resume_config

    def model(rank, alpha, targets):
        return {"actor_rollout_ref": {"model": {"lora_rank": rank, "lora_alpha": alpha, "target_modules": targets}}}

    with pytest.raises(RunDirError, match="lora_alpha: 8 -> 32"):
        check_resume_config(model(4, 8, "all-linear"), model(4, 32, "all-linear"), "ckpt")
    with pytest.raises(RunDirError, match="target_modules"):
        check_resume_config(model(4, 8, ["q_proj"]), model(4, 8, ["o_proj"]), "ckpt")
    assert "actor_rollout_ref.model.lora_alpha" in check_resume_config(model(0, 8, "all-linear"),
                                                                        model(0, 32, "all-linear"), "ckpt")


def test_verl_lora_adapter_path_starts_from_that_adapter_and_exclude_modules_leaves_modules_out(tmp_path):
    from rlanywhere.builders import lora_model
    from rlanywhere.config import load_config

    trained = apply_lora(tiny_qwen2(), 4, 8, ["q_proj", "v_proj"])
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.add_(0.5)
    trained.save_pretrained(tmp_path / "adapter")
    notices: list[str] = []
    cfg = load_config(None, [f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}",
                             "actor_rollout_ref.model.exclude_modules=.*\\.v_proj"], notices=notices)
    model_cfg = cfg.actor_rollout_ref.model
    assert (model_cfg.lora_rank, model_cfg.lora_alpha, sorted(model_cfg.target_modules)) == (4, 8, ["q_proj", "v_proj"])
    assert any("training starts from that adapter" in line for line in notices)
    # the adapter's weights where this run has adapters; none on the excluded v_proj, so one file tensor is left over
    with pytest.raises(Exception, match="saved tensor"):
        lora_model(tiny_qwen2(), model_cfg)
    cfg.actor_rollout_ref.model.exclude_modules = None
    started = lora_model(tiny_qwen2(), cfg.actor_rollout_ref.model)
    assert all(torch.equal(started.state_dict()[k], v) for k, v in trained.state_dict().items() if "lora_" in k)
    excluded = apply_lora(tiny_qwen2(), 4, 8, ["q_proj", "v_proj"], exclude_modules=".*\\.v_proj")
    assert not any("v_proj.lora" in name for name, _ in excluded.named_parameters())
    with pytest.raises(Exception, match="no readable adapter_config.json"):
        load_config(None, [f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'nowhere'}"])
