"""The planner on fake probes (P40, T4, A100, H100, CPU): no GPU needed. Plus the real probe of this machine,
model shapes from config.json / PretrainedConfig / GGUF, runtime helpers and the `plan` command."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from rlanywhere import estimator as est
from rlanywhere import cli, machine, model_shape, planner, plans, vocabulary
from rlanywhere.config import load_config
from rlanywhere.machine import HardwareProbe
from rlanywhere.planner import make_plan
from rlanywhere.vocabulary import NoFitError, PlanError

from .conftest import VERL_P40_ARGS


# The PPO workload of the brief: Qwen2.5-0.5B actor + critic + reference, 64 prompts, 256 + 256 tokens, n=1.
PPO_05B = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=gae",
           "actor_rollout_ref.actor.use_kl_loss=true", "data.train_batch_size=64", "data.max_prompt_length=256",
           "data.max_response_length=256", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
           "actor_rollout_ref.rollout.n=1"]
SMALL = ["data.train_batch_size=8", "data.max_prompt_length=64", "data.max_response_length=64",
         "actor_rollout_ref.actor.ppo_mini_batch_size=8"]


def cfg_of(*overrides: str):
    return load_config(None, list(overrides))


def fake(card=None, flash=False, triton_usable=None) -> HardwareProbe:
    return HardwareProbe.fake(card, flash_attn_installed=flash, triton_usable=triton_usable)


# -------------------------------------------------------------------------------------------- helpers
def test_dtype_names_round_trip():
    for name, dtype in (("fp32", torch.float32), ("float32", torch.float32), ("bf16", torch.bfloat16),
                        ("bfloat16", torch.bfloat16), ("fp16", torch.float16), ("half", torch.float16)):
        assert vocabulary.dtype_from_name(name) is dtype
        assert vocabulary.dtype_from_name(vocabulary.dtype_name(dtype)) is dtype
    assert vocabulary.dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        vocabulary.dtype_from_name("int8")


def test_card_table():
    p40 = machine.card_spec("P40")
    assert p40.compute_capability == (6, 1) and p40.smem_per_block_kib == 48
    assert not (p40.bf16 or p40.tf32 or p40.flash_attn_capable or p40.fp16_tensor_cores)
    t4 = machine.card_spec("tesla-t4")
    assert t4.fp16_tensor_cores and not t4.bf16 and 14 < t4.memory_gib <= 16
    for key in ("a10", "rtx3090", "a100-40g", "a100-80g", "h100"):
        card = machine.CARDS[key]
        assert card.bf16 and card.tf32 and card.flash_attn_capable and card.compute_capability >= (8, 0)
    assert machine.CARDS["h100"].compute_capability == (9, 0) and machine.CARDS["v100-32g"].memory_gib > 31
    with pytest.raises(PlanError) as err:
        machine.card_spec("p4")
    assert "p40" in str(err.value) and "h100" in str(err.value)


# ------------------------------------------------------------------------------------ precision/attention
@pytest.mark.parametrize("card", ["p40", "p100"])
def test_pascal_plans_fp32_without_flash(card):
    plan = make_plan(cfg_of(*SMALL), fake(card, flash=True))  # flash_attn installed, but the card can't run it
    assert plan.precision == "fp32" and plan.param_dtype == plan.compute_dtype == plan.rollout.dtype == torch.float32
    assert not plan.use_autocast and not plan.use_grad_scaler and not plan.allow_tf32
    assert plan.attn_implementation in ("sdpa", "eager")
    assert "no bf16 and no fp16 tensor cores" in plan.reasons["precision"] and machine.card_spec(card).name in plan.card
    assert plan.device == "cuda:0" and plan.alloc_conf == "expandable_segments:True"


@pytest.mark.parametrize("card, precision, compute, scaler", [
    ("t4", "fp16", torch.float16, True), ("v100-16g", "fp16", torch.float16, True),
    ("v100-32g", "fp16", torch.float16, True), ("p40", "fp32", torch.float32, False),
    ("a100-40g", "bf16", torch.bfloat16, False), ("h100", "bf16", torch.bfloat16, False),
    (None, "fp32", torch.float32, False)])
def test_planner_precision_per_card(card, precision, compute, scaler):
    plan = make_plan(cfg_of(*SMALL), fake(card))
    assert (plan.precision, plan.compute_dtype, plan.use_grad_scaler) == (precision, compute, scaler)
    assert plan.param_dtype == torch.float32  # master weights (and the optimizer) stay fp32 on every card
    assert plan.rollout.dtype == compute and plan.use_autocast == (compute != torch.float32)
    if precision == "fp16":  # fp16 tensor cores, no bf16; SDPA's memory-efficient kernel runs fp16 on cc 7.x
        assert "fp16 tensor cores and no bf16" in plan.reasons["precision"]
        assert "not run" in plan.reasons["precision"]  # a hand-made probe: nothing was run
        assert plan.attn_implementation == "sdpa" and "efficient_attention" in plan.reasons["attn_implementation"]


def test_fp16_chosen_when_the_checks_passed_and_fp32_when_they_failed(caplog):
    probe = fake("t4")
    probe.devices[0].fp16_problems = []
    plan = make_plan(cfg_of(*SMALL), probe)
    assert plan.precision == "fp16" and "fp16 checks passed on cuda:0 (Tesla T4)" in plan.reasons["precision"]
    probe.devices[0].fp16_problems = ["fp16 SDPA: no SDPA backend runs forward and backward in float16"]
    plan = make_plan(cfg_of(*SMALL), probe)
    assert plan.precision == "fp32" and not plan.use_grad_scaler and plan.rollout.dtype == torch.float32
    assert "fp16 checks failed on cuda:0 (Tesla T4): fp16 SDPA" in plan.reasons["precision"]
    assert "fp32 instead of fp16" in caplog.text
    with pytest.raises(PlanError, match="fp16 checks failed.*hardware.precision=fp32"):
        make_plan(cfg_of(*SMALL, "hardware.precision=fp16"), probe)


def test_precision_fp32_forces_fp32_on_volta_and_turing():
    for card in ("t4", "v100-16g"):
        plan = make_plan(cfg_of(*SMALL, "hardware.precision=fp32"), fake(card))
        assert plan.precision == "fp32" and not plan.use_grad_scaler and not plan.use_autocast
        assert plan.reasons["precision"] == "fp32: hardware.precision=fp32"


def test_emulated_t4_runs_the_fp16_checks_of_the_real_gpu():
    probe = fake("h100")
    probe.devices[0].fp16_problems = []
    plan = make_plan(cfg_of(*SMALL), probe, emulate="t4")
    assert plan.precision == "fp16" and plan.card == "Tesla T4" and not plan.allow_tf32
    assert "passed on cuda:0 (H100 80GB, standing in for the Tesla T4)" in plan.reasons["precision"]
    probe.devices[0].fp16_problems = ["loss scaling: an overflowed step was not skipped"]
    assert make_plan(cfg_of(*SMALL), probe, emulate="t4").precision == "fp32"
    plan = make_plan(cfg_of(*SMALL), fake(None), for_execution=False, emulate="v100-16g")
    assert plan.precision == "fp16" and "planning without a GPU" in plan.reasons["precision"]


def test_fp16_checks_run_for_real_and_catch_a_scaler_that_does_not_skip(monkeypatch):
    assert machine.fp16_problems("cpu") == []  # CPU autocast has fp16 matmuls: the same checks run here

    class NeverSkips(torch.amp.GradScaler):  # finds the overflow, steps anyway
        def step(self, optimizer, *args, **kwargs):
            self.unscale_(optimizer)
            return optimizer.step()

    monkeypatch.setattr(torch.amp, "GradScaler", NeverSkips)
    assert "was not skipped" in machine._loss_scaling_problem("cpu")


def test_grad_scaler_of_an_fp16_plan():
    plan = make_plan(cfg_of(*SMALL), fake("t4"))
    assert plan.use_grad_scaler
    scaler = planner.make_grad_scaler(dataclasses.replace(plan, device="cpu"))  # no CUDA here: a CPU scaler
    assert scaler.get_scale() == vocabulary.LOSS_SCALE_INIT and scaler.get_growth_interval() == vocabulary.LOSS_SCALE_GROWTH_INTERVAL
    assert planner.make_grad_scaler(make_plan(cfg_of(*SMALL), fake("a100-40g"))) is None


@pytest.mark.parametrize("card", ["a100-80g", "h100"])
@pytest.mark.parametrize("flash", [True, False])
def test_ampere_and_hopper_plan_bf16_autocast_and_tf32(card, flash):
    plan = make_plan(cfg_of(*SMALL), fake(card, flash=flash))
    assert plan.precision == "bf16" and plan.param_dtype == torch.float32 and plan.compute_dtype == torch.bfloat16
    assert plan.use_autocast and not plan.use_grad_scaler and plan.allow_tf32
    assert plan.rollout.dtype == torch.bfloat16
    assert plan.attn_implementation == ("flash_attention_2" if flash else "sdpa")


def test_cpu_plan():
    plan = make_plan(cfg_of(*SMALL), fake(None))
    assert plan.device == "cpu" and plan.precision == "fp32" and plan.attn_implementation == "sdpa"
    assert plan.alloc_conf is None and plan.memory_fraction is None and not plan.allow_tf32
    assert not plan.optimizer_offload and not plan.param_offload


def test_bf16_on_p40_is_an_error_naming_cc_and_fix():
    with pytest.raises(PlanError) as err:
        make_plan(cfg_of(*SMALL, "hardware.precision=bf16"), fake("p40"))
    message = str(err.value)
    assert "6.1" in message and "Tesla P40" in message and "hardware.precision=fp32" in message


def test_flash_attention_errors():
    with pytest.raises(PlanError) as err:
        make_plan(cfg_of(*SMALL, "hardware.attn_implementation=flash_attention_2"), fake("t4", flash=True))
    assert "7.5" in str(err.value) and "hardware.attn_implementation=sdpa" in str(err.value)
    with pytest.raises(PlanError, match="not installed"):
        make_plan(cfg_of(*SMALL, "hardware.attn_implementation=flash_attention_2"), fake("a100-80g"))
    with pytest.raises(PlanError, match="bf16/fp16"):
        make_plan(cfg_of(*SMALL, "hardware.attn_implementation=flash_attention_2", "hardware.precision=fp32"),
                  fake("a100-80g", flash=True))
    plan = make_plan(cfg_of(*SMALL, "hardware.attn_implementation=flash_attention_2"), fake("h100", flash=True))
    assert plan.attn_implementation == "flash_attention_2"


def test_fp16_on_cpu_is_an_error():
    with pytest.raises(PlanError, match="not supported on CPU"):
        make_plan(cfg_of(*SMALL, "hardware.precision=fp16"), fake(None))


def test_verl_rollout_dtype_bfloat16_is_adapted_not_an_error():
    plan = make_plan(cfg_of(*SMALL, "actor_rollout_ref.rollout.dtype=bfloat16"), fake("p40"))
    assert plan.rollout.dtype == torch.float32 and "overridden" in plan.reasons["rollout_dtype"]
    plan = make_plan(cfg_of(*SMALL, "actor_rollout_ref.rollout.dtype=bfloat16"), fake("a100-80g"))
    assert plan.rollout.dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------- device
def test_emulation_without_cuda_plans_only():
    with pytest.raises(PlanError, match="no CUDA device"):
        make_plan(cfg_of(*SMALL), fake(None), emulate="p40")
    plan = make_plan(cfg_of(*SMALL), fake(None), for_execution=False, emulate="p40")
    assert plan.device == "cpu" and plan.emulated == "p40" and plan.card == "Tesla P40"
    assert plan.compute_capability == (6, 1) and plan.alloc_conf == "expandable_segments:True"
    assert "planning only" in plan.reasons["device"]


def test_emulation_on_a_real_gpu_caps_memory_and_drops_tf32():
    plan = make_plan(cfg_of(*SMALL, "hardware.emulate=p40"), fake("h100"))
    assert plan.device == "cuda:0" and plan.card == "Tesla P40" and plan.precision == "fp32"
    assert not plan.allow_tf32  # the H100 has TF32, the P40 does not
    assert plan.memory_fraction == pytest.approx(22.38 / 79.11)


def test_emulating_a_bigger_card_is_an_error():
    with pytest.raises(PlanError, match="more memory than this GPU"):
        make_plan(cfg_of(*SMALL), fake("t4"), emulate="a100-80g")


def test_cuda_requested_without_cuda():
    with pytest.raises(PlanError, match="hardware.device=cpu"):
        make_plan(cfg_of(*SMALL, "hardware.device=cuda"), fake(None))
    with pytest.raises(PlanError, match="cuda:0..cuda:0"):
        make_plan(cfg_of(*SMALL, "hardware.device=cuda:1"), fake("t4"))


# ------------------------------------------------------------------------------------- models and memory
def test_which_models_exist():
    grpo = make_plan(cfg_of(*SMALL, "algorithm.adv_estimator=grpo"), fake("t4"))
    assert not grpo.use_critic and grpo.sizes.critic_micro_batch_size is None and grpo.ref_device == "none"
    ppo_kl = make_plan(cfg_of(*SMALL, "actor_rollout_ref.actor.use_kl_loss=true"), fake("t4"))
    assert ppo_kl.use_critic and ppo_kl.use_ref and ppo_kl.ref_device in ("cuda:0", "cpu")
    zero_coef = make_plan(cfg_of(*SMALL, "actor_rollout_ref.actor.use_kl_loss=true",
                                 "actor_rollout_ref.actor.kl_loss_coef=0"), fake("t4"))
    assert not zero_coef.use_ref
    lora = make_plan(cfg_of(*SMALL, "actor_rollout_ref.actor.use_kl_loss=true",
                            "actor_rollout_ref.model.lora_rank=8"), fake("t4"))
    assert lora.use_lora and lora.use_ref and lora.ref_device == "none"
    assert "adapter disabled" in lora.reasons["ref_device"]


def test_p40_fits_the_05b_ppo_workload_and_says_how():
    plan = make_plan(cfg_of(*PPO_05B), fake(None), for_execution=False, emulate="p40")
    budget = plan.memory_budget_bytes
    assert budget < 24 * est.GIB
    assert plan.estimate["peak_bytes"] <= budget
    assert set(plan.estimate["phases"]) == set(est.PHASES)  # critic and reference both present
    assert plan.use_critic and plan.use_ref and plan.ref_device in ("cuda:0", "cpu")
    for key in ("gradient_checkpointing", "actor_micro_batch_size", "critic_micro_batch_size",
                "logprob_micro_batch_size", "optimizer_offload", "param_offload", "ref_device", "memory_budget"):
        assert plan.reasons[key], key
    assert str(plan.sizes.actor_micro_batch_size) in plan.reasons["actor_micro_batch_size"]
    assert plan.sizes.actor_micro_batch_size >= 1 and plan.sizes.rollout_batch_size >= 1


def test_explicit_micro_batches_and_offload_are_honoured():
    plan = make_plan(cfg_of(*PPO_05B, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                            "critic.ppo_micro_batch_size_per_gpu=2",
                            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=5",
                            "hardware.optimizer_offload=true"), fake("p40"))
    assert (plan.sizes.actor_micro_batch_size, plan.sizes.critic_micro_batch_size, plan.sizes.logprob_micro_batch_size) == (4, 2, 5)
    assert plan.optimizer_offload and "hardware.optimizer_offload=True" in plan.reasons["optimizer_offload"]
    assert "ppo_micro_batch_size_per_gpu=4" in plan.reasons["actor_micro_batch_size"]


def test_offload_on_cpu_is_ignored_with_a_reason():
    plan = make_plan(cfg_of(*SMALL, "hardware.optimizer_offload=true"), fake(None))
    assert not plan.optimizer_offload and "ignored" in plan.reasons["optimizer_offload"]


def test_dynamic_bsz_gives_a_token_budget():
    plan = make_plan(cfg_of(*PPO_05B, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"), fake("p40"))
    assert 512 <= plan.sizes.max_token_len_per_micro_batch <= 4096


def test_seven_b_on_p40_does_not_fit_and_says_what_would():
    with pytest.raises(NoFitError) as err:
        make_plan(cfg_of(*PPO_05B, "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct"), fake("p40"))
    message = str(err.value)
    assert "nothing fits" in message and "Tesla P40" in message
    assert "LoRA r=16" in message and "response length" in message and "GiB" in message


def test_memory_budget_override():
    plan = make_plan(cfg_of(*SMALL, "hardware.memory_budget_gib=8"), fake("a100-80g"))
    assert plan.memory_budget_bytes == est.memory_budget_bytes(8 * est.GIB, True)


def test_verl_p40_command_line_plans_on_p40():
    overrides = [line.strip() for line in VERL_P40_ARGS.read_text().splitlines() if line.strip()]
    plan = make_plan(load_config(None, overrides), fake("p40"))
    assert plan.precision == "fp32" and plan.attn_implementation == "sdpa" and plan.rollout.engine == "fast"
    assert plan.param_offload  # verl's fsdp_config.offload_params=true, translated by config.py
    assert plan.sizes.actor_micro_batch_size == 1 and plan.sizes.critic_micro_batch_size == 1
    assert plan.use_critic and not plan.use_ref  # kl_coef is set but neither KL switch is on


def test_plan_to_dict_and_summary():
    plan = make_plan(cfg_of(*PPO_05B), fake("p40"))
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["param_dtype"] == "float32" and data["compute_capability"] == [6, 1]
    assert data["estimate"]["peak_bytes"] == plan.estimate["peak_bytes"]
    assert data["rollout"]["dtype"] == "float32" and data["rollout"]["decode_attention"] == "matmul"
    assert data["rollout"]["reasons"]["fuse_weights"] == plan.rollout.reasons["fuse_weights"]
    text = plan.summary()
    assert text.splitlines()[0].split("|")[0].strip() == "decision"
    assert "grad checkpointing" in text and "no bf16" in text


# ------------------------------------------------------------------------------------------ rollout plan
ROLLOUT_FIELDS = ("engine", "fallback_allowed", "dtype", "decode_attention", "fuse_weights", "transpose_gate_up",
                  "fp32_logits", "match_hf_numerics", "cuda_graphs", "rows_per_wave", "max_seq_len",
                  "prefill_tokens_per_chunk", "check_every", "release_kv_between_phases", "span_granularity",
                  "compile_elementwise", "fused_sampling", "fused_kv_write", "qkv_bias_apart", "decode_halves",
                  "attention_tf32x3", "fp32_gemm_layouts")


def test_every_rollout_decision_has_its_reason():
    for card in (None, "p40", "t4", "a100-80g"):
        plan = make_plan(cfg_of(*PPO_05B), fake(card))
        missing = [name for name in ROLLOUT_FIELDS if not plan.rollout.reasons.get(name)]
        assert not missing, (card, missing)
    assert set(ROLLOUT_FIELDS) | {"reasons"} == {f.name for f in dataclasses.fields(plans.RolloutPlan)}


def test_training_kernels_leave_cudnn_attention_out_and_fuse_adamw_on_cuda():
    hopper = make_plan(cfg_of(*PPO_05B), fake("h100"))
    assert hopper.precision == "bf16" and hopper.attn_implementation == "sdpa"
    # cuDNN would run here (PyTorch would pick it), but training shapes change every micro-batch
    assert "cudnn_attention" in machine.predicted_sdpa_backends((9, 0), torch.bfloat16, 64)
    assert hopper.training_sdpa_backends and "cudnn_attention" not in hopper.training_sdpa_backends
    assert "execution plan per new shape" in hopper.reasons["training_sdpa_backends"]
    assert hopper.fused_optimizer and "fused" in hopper.reasons["fused_optimizer"]
    assert hopper.rollout.span_granularity == planner.DECODE_SPAN_GRANULARITY
    for card in (None, "p40"):  # CPU; fp32 on Pascal: no cuDNN attention to leave out
        plan = make_plan(cfg_of(*PPO_05B), fake(card))
        assert plan.training_sdpa_backends == ()
        assert plan.fused_optimizer == (card is not None)
    assert "training attention" in hopper.summary() and "AdamW fused" in hopper.summary()


def test_decoder_layers_compiled_where_triton_runs_and_use_torch_compile_allows():
    hopper = make_plan(cfg_of(*PPO_05B), fake("h100", triton_usable=True))
    assert hopper.compile_training and "torch.compile per decoder layer" in hopper.reasons["compile_training"]
    assert hopper.micro_batch_width_multiple == 8 and "multiple of 8" in hopper.reasons["compile_training"]
    assert "training passes" in hopper.summary() and "compiled" in hopper.summary()
    assert make_plan(cfg_of(*PPO_05B, "hardware.precision=fp32"), fake("a100-80g", triton_usable=True)).compile_training
    refusals = {  # (card, triton, extra overrides, emulate) -> the reason names the cause
        ("h100", True, ("actor_rollout_ref.actor.use_torch_compile=false",), None): "use_torch_compile=false",
        ("h100", False, (), None): "triton is not installed",
        ("t4", True, (), None): "compute capability 7.5 < 8.0",
        ("h100", True, (), "p40"): "compute capability 6.1 < 8.0",
        (None, None, (), None): "CPU",
        ("h100", True, ("hardware.compile_training=false",), None): "hardware.compile_training=false",
        ("h100", True, ("trainer.total_training_steps=20",), None): "a run of 20 steps",
    }
    for (card, triton, extra, emulate), why in refusals.items():
        plan = make_plan(cfg_of(*PPO_05B, *extra), fake(card, triton_usable=triton), emulate=emulate)
        assert not plan.compile_training and why in plan.reasons["compile_training"], (card, emulate, plan.reasons)
        assert plan.micro_batch_width_multiple == 1  # eager passes: no padding beyond the longest row
        assert "not compiled" in plan.summary()


def test_a_short_run_trains_eager_unless_compiling_is_asked_for():
    """auto compiles runs of compile_min_steps(the model's parameters) steps or more (or of unknown length): fewer
    for a larger model; a shorter run finishes sooner eager; hardware.compile_training=true compiles any run where
    the card can, and refuses where it cannot."""
    assert planner.compile_min_steps(135_000_000) == 223 and planner.compile_min_steps(494_000_000) == 61
    assert planner.compile_min_steps(1_540_000_000) == 20 and planner.compile_min_steps(70_000_000_000) == 1
    h100 = fake("h100", triton_usable=True)
    fewest = planner.compile_min_steps(model_shape.read_model_shape("Qwen/Qwen2.5-0.5B-Instruct").num_params())
    assert 40 < fewest < 100  # a 0.5B model
    short = f"trainer.total_training_steps={fewest - 1}"
    assert make_plan(cfg_of(*PPO_05B, f"trainer.total_training_steps={fewest}"), h100).compile_training
    eager = make_plan(cfg_of(*PPO_05B, short), h100)
    assert not eager.compile_training and "finishes sooner eager" in eager.reasons["compile_training"]
    assert f"compile from {fewest} steps" in eager.reasons["compile_training"]
    forced = make_plan(cfg_of(*PPO_05B, short, "hardware.compile_training=true"), h100)
    assert forced.compile_training and forced.micro_batch_width_multiple == 8
    with pytest.raises(PlanError, match="hardware.compile_training=true: compute capability 7.5 < 8.0"):
        make_plan(cfg_of(*PPO_05B, "hardware.compile_training=true"), fake("t4", triton_usable=True))


def test_training_attention_context_restricts_sdpa_to_the_planned_backends():
    from torch.nn.attention import SDPBackend

    from rlanywhere.planner import training_attention_context
    query = torch.randn(1, 2, 8, 16)
    with training_attention_context(plans.Plan(training_sdpa_backends=("math",))):
        out = torch.nn.functional.scaled_dot_product_attention(query, query, query, is_causal=True)
    with torch.nn.attention.sdpa_kernel([SDPBackend.MATH]):
        assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(query, query, query, is_causal=True))
    with training_attention_context(plans.Plan(training_sdpa_backends=("efficient_attention",))):
        with pytest.raises(RuntimeError):  # no efficient-attention kernel on a CPU: the context did restrict
            torch.nn.functional.scaled_dot_product_attention(query, query, query, is_causal=True)


def test_bf16_rollout_plan_on_ampere():
    plan = make_plan(cfg_of(*PPO_05B), fake("a100-80g"))
    rollout = plan.rollout
    assert rollout.dtype == torch.bfloat16 and rollout.decode_attention == "triton"
    assert "split-K" in rollout.reasons["decode_attention"]
    assert rollout.compile_elementwise and "nothing to compile" in rollout.reasons["compile_elementwise"]
    assert rollout.fused_sampling and "one Triton pass" in rollout.reasons["fused_sampling"]
    assert rollout.fused_kv_write and "inside the attention kernel" in rollout.reasons["fused_kv_write"]
    assert rollout.fuse_weights and "cast copy" in rollout.reasons["fuse_weights"]  # fp32 master weights
    assert rollout.fp32_logits and rollout.match_hf_numerics and rollout.cuda_graphs
    assert rollout.rows_per_wave == plan.sizes.rollout_batch_size and rollout.max_seq_len == 256 + 256
    assert not rollout.fallback_allowed or rollout.engine == "fast"


def test_triton_usable_needs_the_package_and_a_c_compiler(monkeypatch):
    import importlib.util
    import shutil

    from rlanywhere import machine

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "triton" else None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert not machine.triton_usable()  # no compiler for the launcher Triton builds
    monkeypatch.setenv("CC", "/opt/bin/my-cc")
    assert machine.triton_usable()
    monkeypatch.delenv("CC")
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/gcc" if name == "gcc" else None)
    assert machine.triton_usable()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert not machine.triton_usable()


def test_triton_decode_attention_needs_triton_and_a_measured_card():
    no_triton = make_plan(cfg_of(*PPO_05B), fake("a100-80g", triton_usable=False)).rollout
    assert no_triton.decode_attention == "sdpa" and "triton is not installed" in no_triton.reasons["decode_attention"]
    assert not no_triton.compile_elementwise and "triton is not installed" in no_triton.reasons["compile_elementwise"]
    assert not no_triton.fused_sampling and "triton is not installed" in no_triton.reasons["fused_sampling"]
    assert not no_triton.fused_kv_write and "triton is not installed" in no_triton.reasons["fused_kv_write"]
    turing = make_plan(cfg_of(*SMALL), fake("t4")).rollout  # fp16 there: half precision, but cc 7.5
    assert turing.dtype == torch.float16 and turing.decode_attention == "sdpa" and not turing.compile_elementwise
    assert "7.5 < 8.0" in turing.reasons["decode_attention"]
    emulated = make_plan(cfg_of(*PPO_05B), fake("h100", triton_usable=True), emulate="p40").rollout
    assert emulated.decode_attention == "matmul"  # fp32 on the P40 it emulates: never the Triton kernels
    assert not emulated.compile_elementwise and "6.1 < 8.0" in emulated.reasons["compile_elementwise"]
    assert not emulated.fused_sampling and "6.1 < 8.0" in emulated.reasons["fused_sampling"]  # Triton: no Pascal
    assert not turing.fused_sampling and not turing.fused_kv_write and not emulated.fused_kv_write
    cpu = make_plan(cfg_of(*SMALL), fake(None)).rollout
    assert not cpu.compile_elementwise and "CPU" in cpu.reasons["compile_elementwise"]
    assert not cpu.fused_sampling and "CPU" in cpu.reasons["fused_sampling"]
    hf = make_plan(cfg_of(*PPO_05B, "actor_rollout_ref.rollout.name=hf"), fake("a100-80g")).rollout
    assert hf.decode_attention == "sdpa" and not hf.compile_elementwise  # transformers generate: none of ours
    assert not hf.fused_sampling and "the hf engine" in hf.reasons["fused_sampling"]
    assert "the hf engine" in hf.reasons["decode_attention"] and "the hf engine" in hf.reasons["compile_elementwise"]
    assert not cpu.fused_kv_write and not hf.fused_kv_write


def test_fp32_rollouts_where_triton_runs_get_the_measured_fp32_decode_kernels():
    """fp32 on an H200-class card (measured there): the Triton attention with 3xTF32 products, compiled
    elementwise kernels and the fused K/V write, q/k/v biases added after the GEMM, steps of >= 128 rows as two
    halves on two streams, and the faster GEMM layouts (o_proj and LM head copies, counted in the estimate).
    bf16 keeps the bias in the GEMM and one stream; an emulated P40 gets only the bias change (no Triton there)."""
    plan = make_plan(cfg_of(*PPO_05B, "hardware.precision=fp32"), fake("h100", triton_usable=True))
    fp32 = plan.rollout
    assert fp32.dtype == torch.float32 and fp32.decode_attention == "triton"
    assert fp32.attention_tf32x3 and "three TF32 tensor-core products" in fp32.reasons["attention_tf32x3"]
    assert "torch.compile" in fp32.reasons["compile_elementwise"]  # fp32 keeps the compiled kernels
    assert "inside the attention kernel" not in fp32.reasons["fused_kv_write"]
    assert "3xTF32 attention" in fp32.kernels_text() and "fp32 GEMM layouts" in fp32.kernels_text()
    assert fp32.fp32_gemm_layouts and fp32.reasons["fp32_gemm_layouts"].startswith("on:")
    copies = est.layout_copy_bytes(model_shape.NAMED_SHAPES["qwen2.5-0.5b"], torch.float32)
    assert all(parts["rollout_engine_weights"] >= copies for parts in plan.estimate["breakdown"].values())
    no_triton = make_plan(cfg_of(*PPO_05B, "hardware.precision=fp32"), fake("h100", triton_usable=False)).rollout
    assert no_triton.decode_attention == "matmul" and not no_triton.attention_tf32x3
    assert no_triton.fp32_gemm_layouts  # cuBLAS layouts: no Triton needed
    assert fp32.compile_elementwise and fp32.fused_kv_write
    assert fp32.qkv_bias_apart and "about twice as slow" in fp32.reasons["qkv_bias_apart"]
    assert fp32.decode_halves and ">= 128 rows as two halves" in fp32.reasons["decode_halves"]
    assert "QKV bias apart" in fp32.kernels_text() and "two-stream halves" in fp32.kernels_text()
    bf16 = make_plan(cfg_of(*PPO_05B), fake("h100", triton_usable=True)).rollout
    assert bf16.dtype == torch.bfloat16 and not bf16.qkv_bias_apart and not bf16.decode_halves
    assert not bf16.attention_tf32x3 and not bf16.fp32_gemm_layouts and "fp32 only" in bf16.reasons["fp32_gemm_layouts"]
    assert "round twice" in bf16.reasons["qkv_bias_apart"] and "slower in half" in bf16.reasons["decode_halves"]
    emulated = make_plan(cfg_of(*PPO_05B), fake("h100", triton_usable=True), emulate="p40").rollout
    assert emulated.qkv_bias_apart and not emulated.decode_halves and "6.1 < 8.0" in emulated.reasons["decode_halves"]
    assert not emulated.compile_elementwise and not emulated.fused_kv_write
    assert emulated.decode_attention == "matmul" and not emulated.attention_tf32x3
    assert not emulated.fp32_gemm_layouts and "6.1 < 8.0" in emulated.reasons["fp32_gemm_layouts"]
    cpu = make_plan(cfg_of(*SMALL), fake(None)).rollout
    assert not cpu.qkv_bias_apart and not cpu.decode_halves and cpu.reasons["decode_halves"] == "off: CPU"
    assert not cpu.fp32_gemm_layouts and cpu.reasons["fp32_gemm_layouts"] == "off: CPU"
    # the copies are planned only within the fused copies' share of the budget (5 %)
    small, why = planner.fp32_gemm_layouts(torch.float32, True, (9, 0), "fast",
                                           model_shape.NAMED_SHAPES["qwen2.5-0.5b"], 2 * 2**30)
    assert not small and why.startswith("off:") and "over 5%" in why


def test_fp32_rollout_plan_on_cpu_and_pascal():
    cpu = make_plan(cfg_of(*SMALL), fake(None)).rollout
    assert cpu.decode_attention == "matmul" and not cpu.fuse_weights and not cpu.cuda_graphs
    assert cpu.fp32_logits and not cpu.release_kv_between_phases and cpu.max_seq_len == 128
    p40 = make_plan(cfg_of(*PPO_05B), fake("p40"))
    copy = est.fused_copy_bytes(model_shape.NAMED_SHAPES["qwen2.5-0.5b"], torch.float32)
    assert p40.rollout.decode_attention == "matmul" and p40.rollout.cuda_graphs
    assert p40.rollout.fuse_weights == (copy <= est.FUSED_COPY_BUDGET_FRACTION * p40.memory_budget_bytes)


def test_fp32_logits_need_torch_2_8_on_cuda_in_half_precision():
    old = fake("t4")
    old.torch_version = "2.7.1"
    plan = make_plan(cfg_of(*SMALL), old)
    assert plan.rollout.dtype == torch.float16 and not plan.rollout.fp32_logits
    assert "2.8" in plan.rollout.reasons["fp32_logits"]
    new = fake("t4")
    new.torch_version = "2.8.0"
    assert make_plan(cfg_of(*SMALL), new).rollout.fp32_logits


def test_kv_cache_kept_between_phases_where_it_fits_beside_the_training_peak():
    def fits_beside(plan) -> bool:
        phases = plan.estimate["phases"]
        training = max(v for k, v in phases.items() if k != "rollout")
        return training + plan.estimate["breakdown"]["rollout"]["kv_cache"] <= plan.memory_budget_bytes

    for overrides in (SMALL, PPO_05B, PPO_05B + ["data.train_batch_size=512", "actor_rollout_ref.rollout.n=8"],
                      SMALL + ["hardware.emulate=p40"]):
        plan = make_plan(cfg_of(*overrides), fake("a100-80g"))
        assert plan.rollout.release_kv_between_phases == (not fits_beside(plan)), overrides
    # bench/vs_trl.py --p40-path: a Qwen2.5-0.5B body with SmolLM2's vocabulary, 16 x 8 x (256 + 256) on a P40. As
    # packed rows the update's 8-row micro-batches leave no room for the 1.5 GiB cache; with each prompt once they do
    shape = dataclasses.replace(model_shape.read_model_shape("Qwen/Qwen2.5-0.5B-Instruct"), vocab_size=49152)
    job = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=grpo",
           "data.train_batch_size=16", "data.max_prompt_length=256", "data.max_response_length=256",
           "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.rollout.n=8", "hardware.emulate=p40"]
    shared = make_plan(cfg_of(*job), fake("h100"), model_shape=shape)
    packed = make_plan(cfg_of(*job, "hardware.share_prompts=false"), fake("h100"), model_shape=shape)
    assert shared.share_prompts and not packed.share_prompts
    assert shared.sizes.actor_micro_batch_size == packed.sizes.actor_micro_batch_size == 8
    assert shared.estimate["phases"]["actor_update"] < packed.estimate["phases"]["actor_update"]
    assert not shared.rollout.release_kv_between_phases and packed.rollout.release_kv_between_phases
    assert fits_beside(shared) and not fits_beside(packed)
    assert shared.rollout.reasons["release_kv_between_phases"].startswith("kept")
    assert "of the Tesla P40" in packed.rollout.reasons["release_kv_between_phases"]
    assert "as packed rows" in shared.reasons["share_prompts"]
    # verl's key decides when given
    forced = make_plan(cfg_of(*job, "actor_rollout_ref.rollout.free_cache_engine=true"), fake("h100"),
                       model_shape=shape)
    kept = make_plan(cfg_of(*job, "hardware.share_prompts=false", "actor_rollout_ref.rollout.free_cache_engine=false"),
                     fake("h100"), model_shape=shape)
    assert forced.rollout.release_kv_between_phases and not kept.rollout.release_kv_between_phases
    assert "free_cache_engine" in forced.rollout.reasons["release_kv_between_phases"]
    assert "auto would keep it" in forced.rollout.reasons["release_kv_between_phases"]  # said, since it costs time
    assert "exceed" in kept.rollout.reasons["release_kv_between_phases"]  # and the risk of the other choice
    assert not make_plan(cfg_of(*SMALL, "actor_rollout_ref.rollout.free_cache_engine=true"),
                         fake(None)).rollout.release_kv_between_phases  # CPU: nothing to free for


def test_hf_engine_keeps_no_weight_copies():
    plan = make_plan(cfg_of(*PPO_05B, "actor_rollout_ref.rollout.name=hf"), fake("a100-80g"))
    assert plan.rollout.engine == "hf" and not plan.rollout.fallback_allowed and not plan.rollout.fuse_weights
    assert not plan.rollout.cuda_graphs and "transformers generate" in plan.summary()


def test_plan_rollout_for_a_bench():
    shape = model_shape.NAMED_SHAPES["qwen2.5-0.5b"]
    copy = est.fused_copy_bytes(shape, torch.bfloat16)
    roomy = planner.plan_rollout_for(shape, "cuda:0", torch.bfloat16, budget_bytes=int(copy * 100))
    assert roomy.fuse_weights and roomy.cuda_graphs and roomy.decode_attention == "sdpa" and roomy.fp32_logits
    assert roomy.engine == "fast" and not roomy.fallback_allowed and roomy.rows_per_wave is None
    tight = planner.plan_rollout_for(shape, "cuda:0", torch.bfloat16, budget_bytes=int(copy * 10))
    assert not tight.fuse_weights and "over 5%" in tight.reasons["fuse_weights"]
    cpu = planner.plan_rollout_for("smollm2-135m", "cpu", rows_per_wave=8, max_seq_len=96)
    assert cpu.dtype == torch.float32 and cpu.decode_attention == "matmul" and not cpu.cuda_graphs
    assert (cpu.rows_per_wave, cpu.max_seq_len) == (8, 96) and not cpu.fuse_weights


def test_plan_rollout_for_a_loaded_model_counts_its_cast_copy():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    same = planner.plan_rollout_for(model, "cpu")
    assert same.dtype == torch.float32 and not same.fuse_weights
    cast = planner.plan_rollout_for(model, "cpu", torch.bfloat16)
    assert cast.fuse_weights and cast.decode_attention == "sdpa" and cast.fp32_logits


def test_summary_shows_the_rollout_rows():
    text = make_plan(cfg_of(*PPO_05B), fake("a100-80g")).summary()
    assert "rollout kernels" in text and "decode triton, fused QKV/gate-up, fp32 logits, HF rounding, compiled elementwise" in text
    assert "rollout KV cache" in text and "512 tokens" in text


# -------------------------------------------------------------------------------------- probe and shapes
def test_probe_this_machine():
    probe = machine.probe_machine()
    assert probe.cpu_cores >= 1 and probe.ram_total_bytes > 0
    assert len(probe.devices) == torch.cuda.device_count()
    assert "math" in probe.cpu_sdpa_backends[f"float32/{machine.PROBE_HEAD_DIM}"]
    json.dumps(probe.to_dict())
    assert "CPU:" in probe.summary()


def test_sdpa_backend_probe_runs_math_everywhere():
    backends = machine.sdpa_backends_that_run(torch.float32, 64, "cpu")
    assert "math" in backends and set(backends) <= set(machine.SDPA_BACKEND_NAMES)



def test_a_cards_kernel_probe_is_kept_on_disk_per_card_driver_and_build(tmp_path, monkeypatch):
    """The GPU probe's result is reused from the cache file by a later process on the same card, driver and torch
    build; another fingerprint, a fresh probe (the doctor) or a damaged file runs the kernels again."""
    monkeypatch.setenv("RLANYWHERE_CACHE", str(tmp_path))
    assert machine.cuda_fingerprint("cpu") is None  # the CPU's probe is cheap: never cached
    fingerprint = {"now": "H200 | sm_90 | driver 1 | torch 2.11"}
    monkeypatch.setattr(machine, "cuda_fingerprint", lambda device: fingerprint["now"])
    runs = []

    def probe():
        runs.append(1)
        return ("flash_attention", "math")

    assert machine._remembered("cuda:0", "sdpa/bfloat16/64", probe) == ("flash_attention", "math")
    assert machine._remembered("cuda:0", "sdpa/bfloat16/64", probe) == ("flash_attention", "math")
    assert len(runs) == 1  # the second process found it on disk
    assert machine._remembered("cuda:0", "sdpa/float16/64", probe) and len(runs) == 2  # another dtype: its own
    fingerprint["now"] = "H200 | sm_90 | driver 2 | torch 2.11"  # a driver update
    machine._remembered("cuda:0", "sdpa/bfloat16/64", probe)
    assert len(runs) == 3
    monkeypatch.setattr(machine, "_fresh_probes", True)  # `rlanywhere doctor`
    machine._remembered("cuda:0", "sdpa/bfloat16/64", probe)
    assert len(runs) == 4
    monkeypatch.setattr(machine, "_fresh_probes", False)
    machine.kernel_probe_cache_path().write_text("{not json")
    assert machine._remembered("cuda:0", "sdpa/bfloat16/64", probe) == ("flash_attention", "math")
    assert len(runs) == 5 and json.loads(machine.kernel_probe_cache_path().read_text())  # rewritten whole

def test_named_shape_from_hub_style_name():
    shape = model_shape.read_model_shape("Qwen/Qwen2.5-0.5B-Instruct")
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads) == (896, 24, 14, 2)
    assert shape.num_params() == 494_032_768
    assert model_shape.read_model_shape("smollm2-135m-instruct").hidden_size == 576


@pytest.mark.parametrize("tied", [True, False])
def test_shape_from_config_json_and_pretrained_config(tmp_path, tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=tied)
    config.save_pretrained(tmp_path)
    model = Qwen2ForCausalLM(config)
    real = sum({id(p): p.numel() for p in model.parameters()}.values())
    for source in (tmp_path, str(tmp_path / "config.json"), config):
        shape = model_shape.read_model_shape(source)
        assert shape.num_params() == real and shape.tie_word_embeddings == tied and shape.head_dim == 16


def test_shape_from_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "tiny-q.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(3)
    writer.add_feed_forward_length(160)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_vocab_size(100)
    writer.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))
    writer.add_tensor("output.weight", np.zeros((100, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shape = model_shape.read_model_shape(path)
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads) == (64, 3, 4, 2)
    assert (shape.intermediate_size, shape.vocab_size, shape.head_dim) == (160, 100, 16)
    assert not shape.tie_word_embeddings  # it has an output.weight
    assert model_shape.read_model_shape(tmp_path).hidden_size == 64  # a directory holding the .gguf


def test_unknown_model_error_lists_named_shapes():
    with pytest.raises(PlanError) as err:
        model_shape.read_model_shape("./no/such/model")
    assert "qwen2.5-0.5b" in str(err.value)


# ------------------------------------------------------------------------------------------------ runtime
def test_autocast_context():
    a = torch.randn(4, 4)
    with planner.autocast_context(plans.Plan()):
        assert (a @ a).dtype == torch.float32
    bf16 = plans.Plan(precision="bf16", compute_dtype=torch.bfloat16, use_autocast=True)
    with planner.autocast_context(bf16):
        assert (a @ a).dtype == torch.bfloat16
    with planner.autocast_context(bf16, enabled=False):
        assert (a @ a).dtype == torch.float32
    assert planner.make_grad_scaler(plans.Plan()) is None


def test_apply_runtime_on_cpu():
    torch.set_float32_matmul_precision("high")
    planner.apply_runtime(plans.Plan())
    assert torch.get_float32_matmul_precision() == "highest"


def test_prepare_environment(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    planner.prepare_environment(cfg_of("hardware.device=cpu"))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    planner.prepare_environment(cfg_of())
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")  # the user's own setting wins
    planner.prepare_environment(cfg_of())
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


def test_plan_main(capsys):
    assert cli.plan_main(None, PPO_05B, emulate="p40", machine=fake(None)) == 0
    out = capsys.readouterr().out
    assert "Tesla P40" in out and "predicted peak" in out and "actor_update" in out and "micro-batches:" in out
    assert cli.plan_main(None, PPO_05B + ["actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct"], emulate="p40",
                        machine=fake(None)) == 2
    assert "nothing fits" in capsys.readouterr().out
    assert cli.plan_main(cfg_of(*SMALL), json_out="-", machine=fake("t4")) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["card"] == "Tesla T4" and data["plan"]["precision"] == "fp16"


def test_update_micro_batches_grow_past_the_cap_only_with_room_to_spare():
    job = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=grpo",
           "data.train_batch_size=16", "data.max_prompt_length=256", "data.max_response_length=256",
           "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.rollout.n=8"]
    capped = est.MAX_TOKENS_PER_MICRO_BATCH // 512  # 32 rows of 256 + 256 tokens
    big = make_plan(cfg_of(*job, "hardware.memory_budget_gib=139"), fake("h100"))  # an H200's memory
    eighty = make_plan(cfg_of(*job), fake("h100"))
    for plan in (big, eighty):
        update = plan.estimate["phases"]["actor_update"]
        assert update <= est.ROOMY_PEAK_FRACTION * plan.memory_budget_bytes or \
            plan.sizes.actor_micro_batch_size == capped
        assert not plan.rollout.release_kv_between_phases  # growing never costs the rollout its cache
    # sized for the compiled layers and shared prompts that run (the whole mini-batch of 128 rows on an H200)
    assert big.compile_training and big.share_prompts
    assert not big.gradient_checkpointing and big.sizes.actor_micro_batch_size == 4 * capped
    assert "past the 16384-token cap" in big.reasons["actor_micro_batch_size"]
    assert eighty.sizes.actor_micro_batch_size == 2 * capped  # 4x would take > 60% of 80 GB
    eager = make_plan(cfg_of(*job, "actor_rollout_ref.actor.use_torch_compile=false"), fake("h100"))
    assert eager.sizes.actor_micro_batch_size == capped  # eager layers with packed rows: 2x would take > 60%
    checkpointed = make_plan(cfg_of(*job, "actor_rollout_ref.model.enable_gradient_checkpointing=true"), fake("h100"))
    assert checkpointed.sizes.actor_micro_batch_size == 128  # the whole mini-batch: recompute keeps it small


# ------------------------------------------------------------------------------------ host RAM, several ranks
def test_offloaded_state_must_fit_this_machines_ram_once_per_rank():
    """What a GPU plan offloads (here the 1.5B shape's Adam states, 11.50 GiB a rank) lives in host RAM, once per
    rank on the machine: refused before loading when the RAM cannot hold it, with the numbers and the fixes."""
    big = ["actor_rollout_ref.model.path=qwen2.5-1.5b", "algorithm.adv_estimator=grpo", "data.train_batch_size=16",
           "actor_rollout_ref.rollout.n=8", "data.max_prompt_length=256", "data.max_response_length=512",
           "actor_rollout_ref.actor.ppo_mini_batch_size=16"]

    def plan(ram_gib, *extra):
        return make_plan(cfg_of(*big, *extra), HardwareProbe.fake("p40", ram_gib=ram_gib), for_execution=False)

    roomy = plan(64)
    assert roomy.optimizer_offload and "11.50 GiB per rank in host RAM (actor adam 11.50 GiB)" in \
        roomy.reasons["host_memory"]
    assert "host memory" in roomy.summary()
    with pytest.raises(NoFitError, match=r"(?s)11.50 GiB per rank in host RAM.*of 9.60 GiB.*several GPUs"):
        plan(12)
    replicas = ("trainer.n_gpus_per_node=2", "hardware.data_parallel=replicate")
    assert "x 2 ranks on this machine = 23.00 GiB" in plan(64, *replicas).reasons["host_memory"]
    with pytest.raises(NoFitError, match="(?s)x 2 ranks on this machine = 23.00 GiB, of 19.20 GiB.*fewer ranks"):
        plan(24, *replicas)
    for ram in (24, 64):  # sharded: nothing offloaded, and no word left from the replicated attempt
        sharded = plan(ram, "trainer.n_gpus_per_node=2")
        assert sharded.data_parallel == "shard" and "host_memory" not in sharded.reasons
    assert "host_memory" not in make_plan(cfg_of(*PPO_05B), fake("h100"), for_execution=False).reasons


def test_cpu_processes_on_one_machine_share_its_ram():
    def plan(*extra):
        return make_plan(cfg_of("actor_rollout_ref.model.path=qwen2.5-0.5b", *SMALL, *extra),
                         HardwareProbe.fake(None, ram_gib=32), for_execution=False)

    one, two = plan(), plan("trainer.n_gpus_per_node=2")
    assert two.memory_budget_bytes == one.memory_budget_bytes // 2
    assert "shared by 2 processes: 16.00 GiB each" in two.reasons["memory_budget"]


def test_planned_micro_batch_sizes_are_bounds_that_short_rows_merge_under():
    job = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=grpo",
           "data.train_batch_size=16", "data.max_prompt_length=256", "data.max_response_length=256",
           "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.rollout.n=8"]
    planned = make_plan(cfg_of(*job), fake("h100"))
    assert planned.merge_micro_batches and "512-token rows" in planned.reasons["merge_micro_batches"]
    fixed = make_plan(cfg_of(*job, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"), fake("h100"))
    assert not fixed.merge_micro_batches and fixed.sizes.actor_micro_batch_size == 4
    assert "actor_micro_batch" in fixed.reasons["merge_micro_batches"]
    logprob = make_plan(cfg_of(*job, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"), fake("h100"))
    assert not logprob.merge_micro_batches
    dynamic = make_plan(cfg_of(*job, "actor_rollout_ref.actor.use_dynamic_bsz=true"), fake("h100"))
    assert not dynamic.merge_micro_batches and "use_dynamic_bsz" in dynamic.reasons["merge_micro_batches"]


def test_an_emulated_newer_card_is_refused_where_the_real_card_cannot_run_its_plan():
    """A plan for an emulated card runs on the real one: emulating an A10 (cc 8.6) on a P40 (cc 6.1) would plan bf16,
    compiled training and the rollout's Triton kernels, none of which a Pascal card runs; each is refused before
    anything loads. Emulating the older card on the newer one is what emulation is for."""
    from rlanywhere.machine import HardwareProbe

    p40 = HardwareProbe.fake("p40", triton_usable=True)
    with pytest.raises(PlanError, match="bf16"):
        make_plan(load_config(None, PPO_05B), p40, emulate="a10")
    with pytest.raises(PlanError, match="Triton kernels") as refused:
        make_plan(load_config(None, PPO_05B + ["hardware.precision=fp32"]), p40, emulate="a10")
    assert "compiled training" in str(refused.value) and "cc 6.1" in str(refused.value)
    plan = make_plan(load_config(None, PPO_05B), HardwareProbe.fake("h200", triton_usable=True), emulate="p40")
    assert plan.emulated and plan.rollout.decode_attention != "triton" and not plan.compile_training


def test_an_emulated_plan_with_varlen_flash_for_shared_prompts_is_refused_on_a_card_without_flash():
    """Emulating an A10 on a V100 (cc 7.0) without Triton plans fp16 and, with shared prompts, the varlen flash
    kernel (FlashAttention-2: cc >= 8.0), which the V100 cannot run: refused before anything loads. With the masked
    shared-prompt kernel (no flash) the same emulation plans."""
    from rlanywhere.machine import HardwareProbe

    v100 = HardwareProbe.fake("v100-32g", triton_usable=False)
    job = PPO_05B + ["hardware.precision=fp16", "hardware.share_prompts=true"]
    with pytest.raises(PlanError, match="varlen flash attention for shared prompts") as refused:
        make_plan(load_config(None, job), v100, emulate="a10", for_execution=True)
    assert "cc 7.0" in str(refused.value)
    plan = make_plan(load_config(None, job), v100, emulate="t4", for_execution=True)
    assert plan.share_prompts and plan.shared_prompt_kernel != "flash_varlen"
