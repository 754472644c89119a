"""Compiled decoder layers (plan.compile_training): the same log-probs, entropies and gradients as eager ones.

The planner turns compilation on for CUDA runs where Triton runs (tests/test_hardware.py); here the CPU checks the
part that can go wrong without a GPU: that Dynamo and AOT autograd trace transformers' layers as our training
passes call them (left padding and its 4D mask, new widths, gradient checkpointing's recompute, no-grad passes),
with the "aot_eager" backend (no code generation, so seconds instead of minutes).
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlanywhere.logprobs import response_logprobs
from rlanywhere.models import ValueModel, compile_decoder_layers, decoder_layers, enable_gradient_checkpointing


def tiny_qwen2(seed: int = 0, family: str = "qwen2"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig,
                                                                                          LlamaForCausalLM)
    torch.manual_seed(seed)
    config = config_class(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          attn_implementation="sdpa")
    model = model_class(config)
    model.config.use_cache = False
    return model


def micro_batch(width: int, left_padding: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (3, width), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :left_padding] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def loss_and_grads(model, ids, mask, pos, response_len=4):
    model.zero_grad(set_to_none=True)
    logprobs, entropy = response_logprobs(model, ids, mask, response_len, with_entropy=True, position_ids=pos)
    weights = torch.linspace(-1.0, 1.0, response_len)
    loss = (logprobs * weights).sum() - 0.1 * entropy.sum()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing,family,lora", [(False, "qwen2", False), (True, "qwen2", False),
                                                      (False, "llama", False), (True, "llama", True)])
def test_compiled_layers_give_eager_gradients(checkpointing, family, lora):
    """Qwen2 (the benchmarks' body) and Llama (the demo's SmolLM2), with and without gradient checkpointing, and
    under LoRA adapters (checkpointed, as small cards run it)."""
    eager = tiny_qwen2(family=family)
    if lora:
        from rlanywhere.lora import apply_lora

        eager = apply_lora(eager, 4, 8, "all-linear")
        for name, param in eager.named_parameters():  # peft starts B at zero: make the adapters matter
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
    compiled = copy.deepcopy(eager)
    if checkpointing:
        enable_gradient_checkpointing(eager)
        enable_gradient_checkpointing(compiled)
    torch._dynamo.reset()
    assert compile_decoder_layers(compiled, backend="aot_eager") == 2
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints keep their keys
    # new widths, with and without left padding (the 4D mask or none)
    for width, left_padding, seed in ((10, 3, 1), (13, 0, 2), (9, 2, 3)):
        batch = micro_batch(width, left_padding, seed)
        loss, grads = loss_and_grads(eager, *batch)
        compiled_loss, compiled_grads = loss_and_grads(compiled, *batch)
        torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-5)
        assert grads.keys() == compiled_grads.keys() and len(grads) > 0
        for name, grad in grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # the log-prob passes: a no-grad variant of the same graph
        batch = micro_batch(11, 1, 4)
        torch.testing.assert_close(response_logprobs(compiled, batch[0], batch[1], 5)[0],
                                   response_logprobs(eager, batch[0], batch[1], 5)[0], rtol=1e-5, atol=1e-5)
    from torch._dynamo.utils import counters
    assert counters["stats"]["unique_graphs"] >= 2  # the layers did run compiled (with and without gradients)


def test_new_micro_batch_shapes_do_not_recompile(monkeypatch):
    """Rows and lengths change with every micro-batch. Sizes that happen to equal one of the model's own sizes
    (rows == hidden size, length == head size, rows == length) used to be "duck sized" into one symbol, and the
    next micro-batch compiled again: seconds per compile on a GPU, eager after 8. Now the decoder layer and the
    log-prob head's two chunk functions compile once each, whatever the shapes (one row is its own graph)."""
    from rlanywhere import logprobs
    from rlanywhere.compiling import compiles_so_far

    monkeypatch.setattr(logprobs, "COMPILE_BACKEND", "eager")
    model = tiny_qwen2()  # hidden 32, 4 heads of 8, 2 KV heads, MLP 64
    torch._dynamo.reset()
    compile_decoder_layers(model, backend="eager")
    before = compiles_so_far()
    generator = torch.Generator().manual_seed(0)
    # (rows, columns): rows == hidden, columns == head size, rows == columns, columns == MLP width, rows == heads...
    for rows, width in ((32, 20), (5, 8), (12, 12), (3, 64), (4, 17), (2, 32), (9, 2), (32, 32), (7, 40), (8, 8)):
        ids = torch.randint(0, 96, (rows, width), generator=generator)
        response_len = max(1, width // 3)
        logprobs_, entropy = response_logprobs(
            model, ids, torch.ones_like(ids), response_len, with_entropy=True,
            position_ids=torch.arange(width).expand(rows, width),
            response_start=torch.full((rows,), width - response_len), compiled_head=True)
        (logprobs_.sum() + entropy.sum()).backward()
    assert compiles_so_far() - before == 3  # the layer, the chunk statistics, the chunk gradient


def test_decoder_layers_are_found_under_a_critic_and_an_adapter():
    from rlanywhere.lora import apply_lora

    model = tiny_qwen2()
    critic = ValueModel.from_causal_lm(model)
    assert len(decoder_layers(critic)) == 2 and decoder_layers(critic)[0] is critic.backbone.layers[0]
    adapted = apply_lora(tiny_qwen2(), 4, 8, "all-linear")
    layers = decoder_layers(adapted)
    assert len(layers) == 2 and layers[0] is adapted.get_base_model().model.layers[0]
    assert decoder_layers(torch.nn.Linear(2, 2)) == []
    assert compile_decoder_layers(critic, backend="eager") == 2 and critic.backbone.layers[1]._compiled_call_impl


def test_hf_generate_runs_compiled_layers_eagerly():
    """The HF engine's generate (KV cache, one token a step) would recompile compiled layers at every new length:
    it runs them eager, and gives what the uncompiled model gives."""
    from torch._dynamo.utils import counters

    from rlanywhere.rollout import SamplingParams
    from rlanywhere.rollout.hf import HFEngine

    model = tiny_qwen2().eval()
    prompts, params = [[5, 6, 7], [11, 12, 13, 14]], SamplingParams(max_new_tokens=5, temperature=0)
    expected = HFEngine(model, None, pad_token_id=0).generate(prompts, params).response_ids
    torch._dynamo.reset()
    counters.clear()
    compile_decoder_layers(model, backend="eager")
    got = HFEngine(model, None, pad_token_id=0).generate(prompts, params).response_ids
    assert torch.equal(got, expected)
    assert counters["stats"]["unique_graphs"] == 0  # nothing traced, nothing compiled


def test_a_compile_failure_names_its_fix_and_eager_plans_pass_errors_through():
    from rlanywhere.errors import UserError
    from rlanywhere.plans import Plan
    from rlanywhere.update import training_passes

    failure = torch._dynamo.exc.TorchDynamoException("inductor could not build a kernel\nmore lines")
    with pytest.raises(UserError, match="use_torch_compile=false") as caught:
        with training_passes(Plan(compile_training=True)):
            raise failure
    assert "inductor could not build a kernel" in str(caught.value) and "more lines" not in str(caught.value)
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        with training_passes(Plan(compile_training=False)):
            raise failure


def test_inductor_caches_go_to_rlanywheres_cache_unless_the_user_chose(monkeypatch, tmp_path):
    from torch._inductor.runtime.runtime_utils import cache_dir

    from rlanywhere.compiling import persistent_compile_cache

    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("RLANYWHERE_CACHE", str(tmp_path / "cache"))
    assert persistent_compile_cache() == str(tmp_path / "cache" / "compile")
    assert cache_dir() == str(tmp_path / "cache" / "compile")  # what inductor itself will use
    # Triton's kernels beside inductor's, for inductor and for the decode step's own Triton kernels
    assert triton_cache_dir(0) == str(tmp_path / "cache" / "compile" / "triton")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "my-triton"))
    assert persistent_compile_cache() == str(tmp_path / "mine")
    assert triton_cache_dir(0) == str(tmp_path / "my-triton")
