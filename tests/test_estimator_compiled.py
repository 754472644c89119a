"""The activations a compiled decoder layer keeps for the backward (estimator.compiled_layer_saved_bytes_per_token)
against the tensors AOTAutograd really saves, and the plan's estimate recounted once the training kernels are known
(compiled layers, grouped k/v heads)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlanywhere import estimator as est
from rlanywhere.machine import HardwareProbe
from rlanywhere.model_shape import ModelShape

from .test_estimator import QWEN_05B, shape_of, tiny_qwen2_config

BATCH, SEQ = 3, 37  # no weight has a dimension of 37 or 111: what has one is an activation


def _compiled_saved_bytes(layers: int, autocast: bool) -> int:
    """Bytes of per-token tensors autograd keeps after a forward through decoder layers compiled with inductor's
    partitioner (the aot_eager_decomp_partition backend: the same decompositions and min-cut, no code generation)."""
    from transformers import Qwen2ForCausalLM

    from rlanywhere.models import compile_decoder_layers

    config = tiny_qwen2_config(layers, hidden=128, inter=384)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    compile_decoder_layers(model, backend="aot_eager_decomp_partition")
    seen: dict[int, int] = {}

    def pack(tensor):
        if SEQ in tensor.shape or BATCH * SEQ in tensor.shape:
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # as training runs it
    hidden.float().sum().backward()  # the compiled backward runs too: what was saved is what it needs
    return sum(seen.values())


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [True, False])
def test_compiled_layer_formula_matches_the_saved_tensors(autocast):
    # per layer per token: a 2-layer model minus a 1-layer one, so the embedding and final norm cancel (without the
    # HF cache, as training runs them, every layer runs the one compiled graph: the 1-layer model reuses it)
    measured = (_compiled_saved_bytes(2, autocast) - _compiled_saved_bytes(1, autocast)) / (BATCH * SEQ)
    shape = shape_of(tiny_qwen2_config(1, hidden=128, inter=384))
    # CPU SDPA takes the grouped k/v heads as they are; the residual stream stays fp32 under autocast
    predicted = est.compiled_layer_saved_bytes_per_token(shape, 2 if autocast else 4, 4, kv_heads_repeated=False)
    assert measured <= predicted <= 1.05 * measured, (measured, predicted)
    eager = est.layer_saved_bytes_per_token(shape, 2 if autocast else 4, 4, autocast, kv_heads_repeated=False)
    assert predicted < 0.8 * eager


def test_compiled_layer_closed_form():
    # module docstring: bf16 autocast, fp32 residual, grouped k/v, q_dim = H: 14 H + 4 kv_dim + 6 I bytes, plus the
    # fp32 log-sum-exp per head and reciprocal RMS per norm
    h, i, kv = QWEN_05B.hidden_size, QWEN_05B.intermediate_size, QWEN_05B.kv_dim
    assert QWEN_05B.q_dim == h
    assert est.compiled_layer_saved_bytes_per_token(QWEN_05B, 2, 4, kv_heads_repeated=False) == \
        14 * h + 4 * kv + 6 * i + 14 * 4 + 2 * 4  # 42304
    # repeated heads: k and v as wide as q; plain fp32: every saved tensor 4 bytes
    assert est.compiled_layer_saved_bytes_per_token(QWEN_05B, 2, 4, kv_heads_repeated=True) == \
        14 * h + 4 * h + 6 * i + 64
    assert est.compiled_layer_saved_bytes_per_token(QWEN_05B, 4, 4, kv_heads_repeated=False) == \
        4 * h + 4 * (5 * h + 2 * kv + 3 * i) + 64
    # the eager layer with grouped heads: 2 kv_dim instead of 2 q_dim for k and v
    assert est.layer_saved_bytes_per_token(QWEN_05B, 2, 4, True, kv_heads_repeated=False) == \
        36 * h + 8 * i - 2 * 2 * (h - kv)


def test_training_activations_follow_the_workload_kernels():
    """estimate_memory's update activations: the compiled layer where the workload says so, one layer recomputed at
    a time under checkpointing."""
    base = dict(param_dtype=torch.float32, compute_dtype=torch.bfloat16, rollout_dtype=torch.bfloat16,
                use_autocast=True, prompts_per_step=32, samples_per_prompt=1, prompt_length=256,
                response_length=256, actor_mini_batch=32, critic_mini_batch=32, has_critic=False, has_ref=False)
    placement = est.Placement(actor_micro_batch=8, logprob_micro_batch=8, rollout_batch=32)
    tokens, per_token_rest = 8 * 512, 2 * 896 * 4 + 2 * 4864 * 2 + 2 * 896 * 4  # final norm + backward transients
    for compiled, repeated in ((False, True), (True, False), (True, True)):
        wl = est.Workload(**base, compiled_layers=compiled, kv_heads_repeated=repeated)
        got = est.estimate_memory(QWEN_05B, wl, placement)["breakdown"]["actor_update"]["activations"]
        layer = (est.compiled_layer_saved_bytes_per_token(QWEN_05B, 2, 4, repeated) if compiled else
                 est.layer_saved_bytes_per_token(QWEN_05B, 2, 4, True, repeated))
        assert got == tokens * (24 * layer + per_token_rest)
        ckpt = est.estimate_memory(QWEN_05B, wl, dataclasses.replace(placement, gradient_checkpointing=True))
        assert ckpt["breakdown"]["actor_update"]["activations"] == tokens * (24 * 896 * 4 + layer + per_token_rest)


PPO_05B = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=gae",
           "actor_rollout_ref.actor.use_kl_loss=true", "data.train_batch_size=64", "data.max_prompt_length=256",
           "data.max_response_length=256", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
           "actor_rollout_ref.rollout.n=1"]


def _plan(card, triton, emulate=None):
    from rlanywhere.config import load_config
    from rlanywhere.planner import make_plan

    probe = HardwareProbe.fake(card, flash_attn_installed=False, triton_usable=triton)
    return make_plan(load_config(None, PPO_05B), probe, emulate=emulate)


def _update_activations(plan, compiled: bool, repeated: bool) -> int:
    shape: ModelShape = QWEN_05B
    tokens = plan.sizes.actor_micro_batch_size * 512
    return est.training_activation_bytes(shape, tokens, 512, 2 if plan.use_autocast else 4, 4, plan.use_autocast,
                                         plan.gradient_checkpointing, False, compiled, repeated)


def test_the_plan_recounts_its_estimate_for_the_training_kernels():
    compiled = _plan("h100", True)
    assert compiled.compile_training and not compiled.expand_kv_heads and compiled.precision == "bf16"
    activations = compiled.estimate["breakdown"]["actor_update"]["activations"]
    assert activations == _update_activations(compiled, True, False)
    assert activations < 0.7 * _update_activations(compiled, False, True)  # what sized the micro-batches
    assert "with compiled layers" in compiled.reasons["compile_training"]
    assert "as eager layers, which sized the micro-batches" in compiled.reasons["compile_training"]
    # the recount changes the estimate, never the settings: the same micro-batches as with triton missing
    eager = _plan("h100", False)
    assert not eager.compile_training and "with compiled layers" not in eager.reasons["compile_training"]
    assert eager.sizes.actor_micro_batch_size == compiled.sizes.actor_micro_batch_size
    assert eager.estimate["breakdown"]["actor_update"]["activations"] == _update_activations(eager, False, False)
    assert compiled.estimate["peak_bytes"] < eager.estimate["peak_bytes"]
    # a P40 (fp32: no flash kernel, k/v repeated per head; Pascal: nothing compiled): the estimate as searched
    p40 = _plan("h100", True, emulate="p40")
    assert not p40.compile_training and p40.expand_kv_heads
    assert p40.estimate["breakdown"]["actor_update"]["activations"] == _update_activations(p40, False, True)


def test_shared_prompts_keep_the_heads_repeated_in_the_recount():
    """Shared-prompt kernels may repeat k/v per query head (the masked kernel always, varlen where torch's lacks
    grouped heads): the recount keeps them repeated there."""
    from rlanywhere.config import load_config
    from rlanywhere.planner import make_plan

    grpo = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=grpo",
            "data.train_batch_size=16", "data.max_prompt_length=256", "data.max_response_length=512",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.rollout.n=8"]
    plan = make_plan(load_config(None, grpo), HardwareProbe.fake("h100", flash_attn_installed=False,
                                                                  triton_usable=True))
    assert plan.share_prompts and plan.compile_training and not plan.expand_kv_heads
    layer = est.compiled_layer_saved_bytes_per_token(QWEN_05B, 2, 4, kv_heads_repeated=True)
    grouped = est.compiled_layer_saved_bytes_per_token(QWEN_05B, 2, 4, kv_heads_repeated=False)
    rows = plan.sizes.actor_micro_batch_size
    tokens = est.shared_stream_tokens(rows, 8, 256, 512)
    activations = plan.estimate["breakdown"]["actor_update"]["activations"]
    assert activations >= tokens * 24 * layer > tokens * 24 * grouped
    # the update's micro-batch was searched again for these kernels (test_the_update_is_sized_for_the_kernels_it_runs)
    assert "micro-batches sized for compiled layers and each prompt once" in plan.reasons["compile_training"]


# Qwen2.5-1.5B's body with the SmolLM2 vocabulary (bench/sides.py "qwen2.5-1.5b"), GRPO 16 prompts x 8 samples,
# prompts and responses of up to 256 tokens (bench/vs_trl.py), bf16 on an H200's memory
QWEN_15B_CONFIG = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=49152, hidden_size=1536,
                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                       max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)
GRPO_15B = ["algorithm.adv_estimator=grpo", "data.train_batch_size=16", "data.max_prompt_length=256",
            "data.max_response_length=256", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.use_kl_loss=false",
            "algorithm.use_kl_in_reward=false", "hardware.precision=bf16", "hardware.memory_budget_gib=139.8"]


def _plan_15b(tmp_path, *overrides):
    import json

    from rlanywhere.config import load_config
    from rlanywhere.planner import make_plan

    (tmp_path / "config.json").write_text(json.dumps(QWEN_15B_CONFIG))
    probe = HardwareProbe.fake("h100", flash_attn_installed=False, triton_usable=True)
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tmp_path}", *GRPO_15B, *overrides])
    return make_plan(cfg, probe, for_execution=False)


def test_the_update_is_sized_for_the_kernels_it_runs(tmp_path):
    """The memory search counts eager layers and a prompt per row; compiled layers and shared prompts, decided after
    it, keep far less. The update's micro-batch is searched again for them: Qwen2.5-1.5B's shape gets 64 rows instead
    of 32, its estimate counted for the kernels that run, and still under the roomy limit."""
    plan = _plan_15b(tmp_path)
    assert plan.compile_training and plan.share_prompts and not plan.gradient_checkpointing
    assert plan.sizes.actor_micro_batch_size == 64
    budget = plan.memory_budget_bytes
    assert plan.estimate["phases"]["actor_update"] <= est.ROOMY_PEAK_FRACTION * budget
    assert "micro-batches sized for compiled layers and each prompt once" in plan.reasons["compile_training"]
    # the same estimate from its parts: compiled layers and the varlen stream at 64 rows
    shape = est.ModelShape("q15", 1536, 28, 12, 2, 8960, 49152, True, attention_bias=True, model_type="qwen2")
    workload = est.Workload(param_dtype=torch.float32, compute_dtype=torch.bfloat16, rollout_dtype=torch.bfloat16,
                            use_autocast=True, prompts_per_step=16, samples_per_prompt=8, prompt_length=256,
                            response_length=256, actor_mini_batch=128, critic_mini_batch=128, has_critic=False,
                            has_ref=False, share_prompts=True, compiled_layers=True,
                            shared_prompt_kernel=plan.shared_prompt_kernel)
    tokens = est.micro_batch_tokens(workload, 64)
    layers = (est.training_activation_bytes(shape, tokens, 512, 2, 4, True, False, False, True, True)
              + 28 * est.shared_attention_bytes(shape, workload, 64, 2))
    assert plan.estimate["breakdown"]["actor_update"]["activations"] == layers


def test_forced_rows_fit_without_checkpointing_with_the_kernels_that_run(tmp_path):
    """64 rows asked for: counted as eager layers with packed rows they needed checkpointing; compiled with shared
    prompts they fit without it (the forward runs once)."""
    plan = _plan_15b(tmp_path, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64")
    assert plan.sizes.actor_micro_batch_size == 64 and not plan.gradient_checkpointing


def test_eager_layers_keep_the_eager_search(tmp_path):
    """Nothing compiled, nothing shared: the search already counted what runs, and the plan is the search's."""
    plan = _plan_15b(tmp_path, "actor_rollout_ref.actor.use_torch_compile=false", "hardware.share_prompts=false")
    assert not plan.compile_training and not plan.share_prompts
    assert plan.sizes.actor_micro_batch_size == 32
    assert "micro-batches sized for" not in plan.reasons["compile_training"]


def test_eager_passes_keep_the_first_search_with_shared_prompts(tmp_path):
    """Where nothing compiles (a P40: fp32, Pascal), shared prompts alone do not resize the update: its micro-batch
    is the search's, as with packed rows."""
    import json

    from rlanywhere.config import load_config
    from rlanywhere.planner import make_plan

    smollm2 = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                   num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                   max_position_embeddings=4096, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(smollm2))
    job = [f"actor_rollout_ref.model.path={tmp_path}", "algorithm.adv_estimator=grpo", "data.train_batch_size=64",
           "data.max_prompt_length=128", "data.max_response_length=96", "actor_rollout_ref.rollout.n=8",
           "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.use_kl_loss=false"]
    probe = HardwareProbe.fake("h100", flash_attn_installed=False, triton_usable=True)
    shared = make_plan(load_config(None, job), probe, for_execution=False, emulate="p40")
    packed = make_plan(load_config(None, [*job, "hardware.share_prompts=false"]), probe, for_execution=False,
                       emulate="p40")
    assert shared.share_prompts and not shared.compile_training and not packed.share_prompts
    assert shared.sizes.actor_micro_batch_size == packed.sizes.actor_micro_batch_size
    assert "micro-batches sized for" not in shared.reasons["share_prompts"]


def test_the_refit_keeps_the_reference_and_its_reason(tmp_path):
    """A KL term: the refit resizes the update and keeps the reference where the first search put it, with the
    reference's own reason (what needs it)."""
    plan = _plan_15b(tmp_path, "actor_rollout_ref.actor.use_kl_loss=true", "data.max_prompt_length=128")
    assert "micro-batches sized for" in plan.reasons["compile_training"]
    assert plan.ref_device.startswith("cuda") and plan.reasons["ref_device"].startswith("use_kl_loss needs a reference")
