"""End-to-end runs of the whole loop on CPU with a tiny random Qwen2: PPO (critic, ref, KL), GRPO, RLOO, LoRA,
checkpoint + kill + resume, HF export, and the real verl P40 command line from shared/fixtures."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlanywhere.cli import main as cli_main
from rlanywhere.config import load_config
from rlanywhere.planner import make_plan
from rlanywhere.rollout.base import SamplingParams
from rlanywhere.tracking import read_metrics
from rlanywhere.trainer import RLTrainer

from .conftest import VERL_P40_ARGS

pytestmark = pytest.mark.slow


def base_overrides(model_dir, data_dir, run_dir, **extra) -> list[str]:
    items = {
        "actor_rollout_ref.model.path": str(model_dir),
        "data.train_files": f"{data_dir}/train.parquet",
        "data.val_files": f"{data_dir}/test.parquet",
        "data.train_batch_size": 4,
        "data.max_prompt_length": 64,
        "data.max_response_length": 12,
        "data.val_max_samples": 8,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.actor.optim.lr": 1e-3,
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.rollout.temperature": 1.0,
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 2,
        "trainer.save_freq": 2,
        "trainer.logger": "['console']",
        "trainer.default_local_dir": str(run_dir),
        "trainer.seed": 3,
        "hardware.device": "cpu",
    }
    items.update(extra)
    return [f"{k}={v}" for k, v in items.items()]


def run_training(overrides: list[str]) -> tuple[RLTrainer, list[dict]]:
    cfg = load_config(None, overrides)
    plan = make_plan(cfg, for_execution=True)
    trainer = RLTrainer(cfg, plan, cfg.trainer.default_local_dir)
    trainer.fit()
    return trainer, read_metrics(cfg.trainer.default_local_dir)


def killed_then_resumed(overrides: list[str], die_at_step: int, monkeypatch) -> tuple[RLTrainer, list[dict]]:
    """Run until the process is killed before step `die_at_step + 1`, then run again (resuming) to the end."""
    original_step = RLTrainer.train_step

    def dying_step(self, items):
        if self.global_step == die_at_step:
            raise KeyboardInterrupt("killed")
        return original_step(self, items)

    monkeypatch.setattr(RLTrainer, "train_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        run_training(overrides)
    monkeypatch.setattr(RLTrainer, "train_step", original_step)
    return run_training(overrides)


def train_rows(metrics: list[dict]) -> dict[int, dict]:
    return {m["step"]: m for m in metrics if "reward/mean" in m}


def test_ppo_with_critic_ref_and_kl(tiny_model_dir, gsm8k_data, tmp_path):
    overrides = base_overrides(tiny_model_dir, gsm8k_data, tmp_path / "run", **{
        "algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.kl_coef": 0.05,
        "algorithm.kl_ctrl.type": "adaptive", "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.ppo_epochs": 2, "critic.optim.lr": 1e-3, "data.max_prompt_length": 200})
    trainer, metrics = run_training(overrides)
    assert trainer.critic is not None and trainer.ref is not None
    rows = train_rows(metrics)
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        for key in ("reward/mean", "actor/pg_loss", "critic/vf_loss", "actor/pg_clipfrac", "actor/approx_kl",
                    "actor/kl", "actor/entropy", "actor/grad_norm", "critic/grad_norm", "response_length/mean",
                    "perf/tokens_per_s", "perf/peak_memory_gib", "perf/compiles", "timing/rollout",
                    "timing/update_actor"):
            assert key in row and row[key] == row[key], key  # present and not NaN
        assert row["perf/compiles"] == 0  # a CPU plan compiles nothing (plan.compile_training is for CUDA)
        assert row["perf/compile_s"] == 0.0 and row["perf/graph_capture_s"] == 0.0  # nor captures CUDA graphs
    # Two PPO epochs: the second epoch sees a moved policy, so the ratio leaves 1 and the KL to old is non-zero.
    assert rows[1]["actor/approx_kl"] != 0.0
    # The reference starts equal to the actor: KL(actor || ref) is exactly 0 at the first step, not after.
    assert rows[1]["actor/kl"] == pytest.approx(0.0, abs=1e-6)
    assert abs(rows[2]["actor/kl"]) > 0
    assert any("val/acc" in m for m in metrics)
    ckpt = tmp_path / "run" / "checkpoints" / "global_step_2"
    assert (ckpt / "critic" / "value_head.safetensors").exists()
    assert (tmp_path / "run" / "plan.json").exists() and (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_train_and_export(tiny_model_dir, arith_data, tmp_path, estimator):
    from transformers import AutoModelForCausalLM

    trainer, metrics = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "run",
                                                   **{"algorithm.adv_estimator": estimator}))
    assert trainer.critic is None and trainer.ref is None  # GRPO-style with no KL loads neither
    assert sorted(train_rows(metrics)) == [1, 2]
    export = tmp_path / "run" / "checkpoints" / "global_step_2" / "actor"
    loaded = AutoModelForCausalLM.from_pretrained(export)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trainer.actor(ids).logits)
    # The update really changed the weights (lr 1e-3), so the export is not the initial model.
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(initial.model.embed_tokens.weight, loaded.model.embed_tokens.weight)


def test_lora_grpo_with_adapter_disabled_reference(tiny_model_dir, arith_data, tmp_path):
    from transformers import AutoModelForCausalLM

    overrides = base_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "algorithm.adv_estimator": "grpo", "actor_rollout_ref.model.lora_rank": 4,
        "actor_rollout_ref.model.lora_alpha": 8, "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.kl_loss_coef": 0.1})
    trainer, metrics = run_training(overrides)
    assert trainer.ref is None  # the reference is the adapter-disabled base: no second copy of the weights
    rows = train_rows(metrics)
    assert all("actor/kl_loss" in row for row in rows.values())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoints" / "global_step_2" / "actor")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, trainer.actor(ids).logits, atol=1e-5, rtol=1e-4)


def test_kill_and_resume_matches_uninterrupted(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    extra = {"algorithm.adv_estimator": "gae", "trainer.total_training_steps": 4, "trainer.save_freq": 2,
             "trainer.test_freq": -1, "trainer.val_before_train": False, "critic.optim.lr": 1e-3,
             "actor_rollout_ref.actor.use_kl_loss": True, "algorithm.kl_ctrl.type": "adaptive",
             "algorithm.use_kl_in_reward": True}
    _, uninterrupted = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "a", **extra))
    # step 2's checkpoint is on disk; the process dies mid-run
    trainer, resumed = killed_then_resumed(base_overrides(tiny_model_dir, arith_data, tmp_path / "b", **extra),
                                           2, monkeypatch)
    assert trainer.global_step == 4
    a, b = train_rows(uninterrupted), train_rows(resumed)
    assert sorted(b) == [1, 2, 3, 4]  # no duplicated or lost lines
    for step in (3, 4):
        for key in ("reward/mean", "actor/pg_loss", "critic/vf_loss", "actor/kl", "response_length/mean",
                    "actor/grad_norm", "critic/values_mean"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)


def _sigterm_after_update_of_step(monkeypatch, trainer: RLTrainer, step: int):
    """SIGTERM right after the first optimizer step of `trainer`'s training step `step` (1-based): the step
    finishes, the run saves and stops. Returns the undo."""
    import signal

    from rlanywhere.update import Updater

    original, sent = Updater.optimizer_step, []

    def step_then_signal(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if not sent and trainer.global_step == step - 1:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Updater, "optimizer_step", step_then_signal)
    return lambda: monkeypatch.setattr(Updater, "optimizer_step", original)


@pytest.mark.parametrize("stop_in_step", [2, 4])
def test_a_validation_a_stop_signal_kept_back_runs_on_resume(tiny_model_dir, arith_data, tmp_path, monkeypatch,
                                                             stop_in_step):
    """test_freq=2 over 4 steps validates at steps 2 and 4. A SIGTERM in step 2's (or the last step's) update skips
    that validation: the checkpoint keeps the step's row, and the resumed run validates and logs it with the row,
    so metrics.jsonl has what the uninterrupted run's has, once, even when that launch dies before its next
    checkpoint (the last step's case used to end as complete, without its final validation)."""
    from rlanywhere.runguard import RunInterrupted

    extra = {"trainer.total_training_steps": 4, "trainer.save_freq": 2, "trainer.test_freq": 2,
             "trainer.val_before_train": False}
    _, straight = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "a", **extra))
    items = base_overrides(tiny_model_dir, arith_data, tmp_path / "b", **extra)
    cfg = load_config(None, items)
    trainer = RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir)
    restore = _sigterm_after_update_of_step(monkeypatch, trainer, stop_in_step)
    with pytest.raises(RunInterrupted):
        trainer.fit()
    restore()
    a = train_rows(straight)
    if stop_in_step == 2:  # the resumed launch logs step 2's row, then dies before the next checkpoint (kill -9),
        killed_then_resumed(items, 2, monkeypatch)  # and the next one logs it again, in place of that line
    else:  # the resumed launch validates the last step and ends the run with its figures
        final = RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir).fit()
        assert final["val/reward"] == pytest.approx(a[4]["val/reward"])
    b = train_rows(read_metrics(str(tmp_path / "b")))
    assert [m["step"] for m in read_metrics(str(tmp_path / "b")) if "reward/mean" in m] == [1, 2, 3, 4]
    for step in (2, 4):
        assert b[step]["val/reward"] == pytest.approx(a[step]["val/reward"]), step
        assert b[step]["reward/mean"] == pytest.approx(a[step]["reward/mean"]), step


def test_a_kept_back_row_is_logged_when_the_step_then_stops_the_run(tiny_model_dir, arith_data, tmp_path,
                                                                     monkeypatch):
    """A SIGTERM keeps step 2's validation back, and the same step then stops the run (every reward call failed for
    trainer.max_consecutive_failed_reward_steps=2 steps): no checkpoint keeps the row, so it is logged as it is."""
    from rlanywhere.runguard import TrainingStopped

    reward = tmp_path / "failing.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    raise RuntimeError('reward service down')\n")
    items = base_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "trainer.total_training_steps": 4, "trainer.save_freq": 1, "trainer.test_freq": 2,
        "trainer.val_before_train": False, "custom_reward_function.path": str(reward),
        "trainer.max_consecutive_failed_reward_steps": 2})
    cfg = load_config(None, items)
    trainer = RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir)
    restore = _sigterm_after_update_of_step(monkeypatch, trainer, 2)
    with pytest.raises(TrainingStopped, match="2 steps in a row"):
        trainer.fit()
    restore()
    assert sorted(train_rows(read_metrics(str(tmp_path / "run")))) == [1, 2]


def test_a_resumed_run_counts_failed_reward_steps_and_the_precision_guard_on(tiny_model_dir, arith_data, tmp_path,
                                                                             monkeypatch):
    """A reward function that always fails stops the run after trainer.max_consecutive_failed_reward_steps (3)
    steps; killed after step 2's checkpoint and resumed, it stops after step 3 too (the streak was reset on each
    launch). The precision guard's window of log-prob gaps is kept the same way (hardware.max_logprob_gap below the
    CPU's fp32 gap, patience 4: the rail trips in step 4 in both runs; the window restarted on resume)."""
    from rlanywhere.precision_guard import PrecisionGuardError
    from rlanywhere.runguard import TrainingStopped

    reward = tmp_path / "failing.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    raise RuntimeError('reward service down')\n")
    failing = {"trainer.total_training_steps": 5, "trainer.save_freq": 1, "trainer.test_freq": -1,
               "trainer.val_before_train": False, "custom_reward_function.path": str(reward)}
    gap = {"trainer.total_training_steps": 5, "trainer.save_freq": 1, "trainer.test_freq": -1,
           "trainer.val_before_train": False, "hardware.max_logprob_gap": 1e-12, "hardware.logprob_gap_patience": 4}
    for extra, error in ((failing, TrainingStopped), (gap, PrecisionGuardError)):
        for run, resumed in (("a", False), ("b", True)):
            items = base_overrides(tiny_model_dir, arith_data, tmp_path / f"{error.__name__}-{run}", **extra)
            with pytest.raises(error):
                killed_then_resumed(items, 2, monkeypatch) if resumed else run_training(items)
        rows = [sorted(train_rows(read_metrics(str(tmp_path / f"{error.__name__}-{run}")))) for run in "ab"]
        assert rows[0] == rows[1] == [1, 2, 3], (error, rows)  # the gap rail trips in step 4, before its row


def test_verl_p40_command_line_runs_unchanged(tiny_model_dir, gsm8k_data, tmp_path, capsys):
    """The real user's verl overrides, paths replaced, run through `rlanywhere train` with no key edited."""
    replacements = {
        "data.train_files": f"{gsm8k_data}/train.parquet",
        "data.val_files": f"{gsm8k_data}/test.parquet",
        "actor_rollout_ref.model.path": str(tiny_model_dir),
        "critic.model.path": str(tiny_model_dir),
    }
    args = []
    for line in VERL_P40_ARGS.read_text().splitlines():
        if not line.strip():
            continue
        key = line.split("=", 1)[0]
        args.append(f"{key}={replacements[key]}" if key in replacements else line.strip())
    # Only additions: keep the test to two steps on the CPU and inside tmp_path.
    args += ["trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path / 'run'}",
             "data.val_max_samples=4", "hardware.device=cpu"]
    assert cli_main(["train", *args]) == 0
    out = capsys.readouterr().out
    assert "run dir:" in out
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["precision"] == "fp32"
    assert any("gpu_memory_utilization" in n for n in plan["notices"])
    rows = train_rows(read_metrics(tmp_path / "run"))
    assert sorted(rows) == [1, 2] and "critic/vf_loss" in rows[1]  # PPO with a critic, as verl's default gae


def test_unknown_key_is_rejected_before_loading(tmp_path, capsys):
    code = cli_main(["train", "data.train_batch_sise=4", f"trainer.default_local_dir={tmp_path}"])
    assert code == 2
    assert "did you mean 'data.train_batch_size'" in capsys.readouterr().err
    assert not os.listdir(tmp_path)  # nothing was written, nothing loaded


def test_rollout_in_chunks_equals_one_call_and_survives_oom(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    """The run's rollout_batch_size splits generation; a simulated OOM in rollout halves it and the step goes on."""
    cfg = load_config(None, base_overrides(tiny_model_dir, arith_data, tmp_path / "run",
                                           **{"algorithm.adv_estimator": "grpo"}))
    plan = make_plan(cfg, for_execution=True)
    trainer = RLTrainer(cfg, plan, cfg.trainer.default_local_dir)
    items = trainer.loader.next_batch()
    params = trainer.rollouts.sampling_params()
    trainer.run.sizes.rollout_batch_size = 8
    whole = trainer.rollouts.generate(items, params, trainer.rollouts.step_generator(0))
    calls = []
    original = trainer.engine.generate

    def flaky_generate(prompts, p, generator=None, rows_per_wave=None):
        calls.append(rows_per_wave)
        if min(rows_per_wave or len(prompts) * p.n, len(prompts) * p.n) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(prompts, p, generator=generator, rows_per_wave=rows_per_wave)

    monkeypatch.setattr(trainer.engine, "generate", flaky_generate)
    params = SamplingParams(max_new_tokens=params.max_new_tokens, temperature=0.0, n=params.n)
    greedy_whole = original([it["input_ids"] for it in items], params)
    chunked = trainer.rollouts.generate(items, params, None)
    assert trainer.run.sizes.rollout_batch_size == 2 and len(trainer.run.oom_events) == 2  # 8 -> 4 -> 2
    assert plan.sizes.rollout_batch_size == make_plan(cfg, for_execution=True).sizes.rollout_batch_size  # unchanged
    trainer.write_plan_record()  # (the loop rewrites it after the step)
    record = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert record["run_state"]["sizes"]["rollout_batch_size"] == 2 and len(record["oom_events"]) == 2
    assert record["run_state"]["oom_ceilings"] == {"rollout_batch_size": 2}
    assert calls == [8, 4, 2]  # the engine waves the request itself, 2 sequences (1 prompt x n) at a time
    # Greedy: the same tokens whether generated at once or one prompt at a time.
    for row in range(whole.response_ids.shape[0]):
        length = int(greedy_whole.response_mask[row].sum())
        assert int(chunked.response_mask[row].sum()) == length
        assert torch.equal(chunked.response_ids[row, :length], greedy_whole.response_ids[row, :length])


def test_ppo_with_lora_actor_and_lora_critic_resumes(tiny_model_dir, arith_data, tmp_path):
    extra = {"algorithm.adv_estimator": "gae", "actor_rollout_ref.model.lora_rank": 4,
             "critic.model.lora_rank": 4, "critic.optim.lr": 1e-3, "trainer.val_before_train": False,
             "trainer.test_freq": -1}
    trainer, metrics = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "run", **extra))
    assert trainer.critic.is_lora
    trainable = [n for n, p in trainer.critic.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in trainable) and any(n.startswith("value_head") for n in trainable)
    assert not any("lora_" not in n and not n.startswith("value_head") for n in trainable)  # base frozen
    rows = train_rows(metrics)
    assert all("critic/vf_loss" in r for r in rows.values())
    # A new trainer on the same run dir resumes from step 2 with the LoRA critic's weights.
    before = {k: v.clone() for k, v in trainer.critic.state_dict().items()}
    resumed, _ = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "run", **extra))
    assert resumed.global_step == 2
    for key, value in resumed.critic.state_dict().items():
        assert torch.equal(value.cpu(), before[key].cpu()), key


def test_token_budget_micro_batches_give_the_same_training(tiny_model_dir, arith_data, tmp_path):
    """use_dynamic_bsz splits by tokens instead of rows; the loss weighting is exact, so training is unchanged."""
    extra = {"algorithm.adv_estimator": "grpo", "trainer.val_before_train": False, "trainer.test_freq": -1,
             "trainer.save_freq": -1, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8}
    fixed_trainer, fixed = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "fixed", **extra))
    dynamic_trainer, dynamic = run_training(base_overrides(
        tiny_model_dir, arith_data, tmp_path / "dyn", **extra,
        **{"actor_rollout_ref.actor.use_dynamic_bsz": True, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 80}))
    assert dynamic_trainer.run.sizes.max_token_len_per_micro_batch is not None
    assert fixed_trainer.run.sizes.max_token_len_per_micro_batch is None
    a, b = train_rows(fixed), train_rows(dynamic)
    for step in (1, 2):
        for key in ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-6), (step, key)


def test_adaptive_kl_controller_is_fed_like_verl(tiny_model_dir, arith_data, tmp_path):
    """The controller sees the batch mean of per-sequence KL (the configured kind) and n_steps = rows."""
    extra = {"algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": "k2",
             "algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.kl_coef": 0.2,
             "algorithm.kl_ctrl.target_kl": 1e-9, "algorithm.kl_ctrl.horizon": 40,
             "trainer.val_before_train": False, "trainer.test_freq": -1, "trainer.save_freq": -1}
    trainer, metrics = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path, **extra))
    rows = train_rows(metrics)
    beta = 0.2
    for step in (1, 2):  # step 2's beta: step 1's after the controller's update
        assert rows[step]["actor/reward_kl_penalty_coeff"] == pytest.approx(beta), step
        kl = rows[step]["actor/reward_kl_penalty"]
        error = max(-0.2, min(0.2, kl / 1e-9 - 1))
        beta *= 1 + error * 8 / 40  # 4 prompts x n = 2 rows
    assert "actor/kl_coef" not in rows[1]  # verl's name for the KL loss's coefficient (no KL loss here)
    assert rows[2]["actor/reward_kl_penalty"] > 0  # the policy moved: the controller saw a real KL


def test_plan_record_shows_an_engine_fallback(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    from rlanywhere.rollout import FastEngine, HFEngine

    monkeypatch.setattr(FastEngine, "supports", staticmethod(lambda model: (False, "no kernel for this model")))
    cfg = load_config(None, base_overrides(tiny_model_dir, arith_data, tmp_path, **{"algorithm.adv_estimator": "grpo"}))
    plan = make_plan(cfg, for_execution=True)
    assert plan.rollout.engine == "fast"
    trainer = RLTrainer(cfg, plan, cfg.trainer.default_local_dir)
    assert isinstance(trainer.engine, HFEngine)
    record = json.loads((tmp_path / "plan.json").read_text())
    assert record["rollout"]["engine"] == "fast" and plan.rollout.engine == "fast"  # what was decided, unchanged
    assert record["run_state"]["engine"] == "hf"  # what runs, and why
    assert "no kernel for this model" in record["run_state"]["fallbacks"]["rollout_engine"]


def test_resume_keeps_only_sizes_an_oom_lowered_and_only_as_ceilings(tiny_model_dir, arith_data, tmp_path):
    """A checkpoint carries the sizes out-of-memory events lowered, not the whole plan's: a resumed run keeps its
    new plan's other sizes (another card, world size or sharding), and a lowered one never rises above the new
    plan's own choice."""
    from rlanywhere.plans import SizeKind

    cfg = load_config(None, base_overrides(tiny_model_dir, arith_data, tmp_path, **{"algorithm.adv_estimator": "grpo"}))
    trainer = RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir)
    planned = trainer.plan.sizes.to_dict()
    trainer.run.sizes.logprob_micro_batch_size = 1  # changed without an OOM event: not carried over
    event = {"phase": "actor_update", "attribute": "actor_micro_batch_size", "old_size": 2, "new_size": 1}
    trainer.run.record_oom(SizeKind.ACTOR_MICRO_BATCH, 1, event)
    trainer.global_step = 1
    trainer.save()
    assert trainer.plan.sizes.to_dict() == planned  # the plan is never changed

    bigger = make_plan(cfg, for_execution=True)
    bigger.sizes.logprob_micro_batch_size, bigger.sizes.actor_micro_batch_size = 16, 8  # e.g. a bigger card
    resumed = RLTrainer(cfg, bigger, cfg.trainer.default_local_dir)
    resumed.maybe_resume()
    assert resumed.run.sizes.logprob_micro_batch_size == 16  # the new plan's: no OOM lowered it
    assert resumed.run.sizes.actor_micro_batch_size == 1  # lowered by an OOM: a ceiling on the new plan's 8
    assert resumed.oom_guard.sizes is resumed.run.sizes  # OOM recovery goes on lowering the run's sizes
    record = json.loads((tmp_path / "plan.json").read_text())
    assert record["sizes"]["actor_micro_batch_size"] == 8  # what was decided
    assert record["run_state"]["sizes"]["actor_micro_batch_size"] == 1  # what runs
    resumed.global_step = 2
    resumed.save()  # the ceiling is carried on by later checkpoints of the resumed run

    smaller = make_plan(cfg, for_execution=True)
    smaller.sizes.actor_micro_batch_size = 1
    smaller.sizes.logprob_micro_batch_size = 2
    again = RLTrainer(cfg, smaller, cfg.trainer.default_local_dir)
    again.maybe_resume()
    assert again.global_step == 2 and again.run.sizes.actor_micro_batch_size == 1  # never raised by a ceiling
    assert again.run.sizes.logprob_micro_batch_size == 2


def test_profile_steps_writes_a_trace_and_a_table_of_the_listed_step(tiny_model_dir, arith_data, tmp_path):
    run_dir = tmp_path / "run"
    _, rows = run_training(base_overrides(tiny_model_dir, arith_data, run_dir, **{
        "trainer.profile_steps": "[2]", "trainer.save_freq": -1, "trainer.test_freq": -1,
        "trainer.val_before_train": False}))
    assert len(rows) == 2
    written = sorted(os.listdir(run_dir / "profile"))
    assert written == ["step_2.trace.json", "step_2.txt"]  # step 1 was not profiled
    trace = json.loads((run_dir / "profile" / "step_2.trace.json").read_text())
    phases = {event["name"] for event in trace["traceEvents"] if str(event.get("name", "")).startswith("phase/")}
    assert {"phase/rollout", "phase/update_actor"} <= phases
    table = (run_dir / "profile" / "step_2.txt").read_text()
    assert "aten::" in table and "device busy ms" in table and "no device activity recorded" in table
    assert any(line.split()[:1] == ["update_actor"] for line in table.splitlines())


def test_profile_steps_must_be_step_numbers(tmp_path, capsys):
    from rlanywhere.config import ConfigError
    with pytest.raises(ConfigError, match="profile_steps"):
        load_config(None, ["trainer.profile_steps=[0]"])


def test_phase_table_counts_overlapping_kernels_once_inside_each_phase():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from rlanywhere.profiling import covered_time, phase_table

    assert covered_time([(0, 10), (5, 15), (20, 30), (40, 50)], 2, 45) == 13 + 10 + 5
    assert covered_time([], 0, 10) == 0

    def event(name, start, end, device=DeviceType.CPU, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [event("phase/rollout", 0, 10_000), event("phase/update_actor", 10_000, 30_000),
              event("phase/update_actor", 10_000, 30_000, DeviceType.CUDA, annotation=True),  # not a kernel
              event("gemm", 1_000, 9_000, DeviceType.CUDA), event("gemm", 12_000, 16_000, DeviceType.CUDA),
              event("add", 14_000, 17_000, DeviceType.CUDA)]
    lines = phase_table(events).splitlines()
    assert lines[1].split() == ["rollout", "10.0", "8.0", "80%"]
    assert lines[2].split() == ["update_actor", "20.0", "5.0", "25%"]
    assert "CPU run" in phase_table([event("phase/rollout", 0, 5)])


def test_critic_warmup_counts_as_verl_and_the_critic_schedule_runs_through_it(tiny_model_dir, arith_data, tmp_path):
    """trainer.critic_warmup=2: verl counts steps from 1, so step 1 trains the critic alone and the actor starts at
    step 2; the critic's LR warm-up advances with the critic's own updates meanwhile."""
    extra = {"algorithm.adv_estimator": "gae", "trainer.critic_warmup": 2, "critic.optim.lr": 1e-3,
             "critic.optim.lr_warmup_steps": 2, "trainer.val_before_train": False, "trainer.test_freq": -1,
             "trainer.save_freq": -1}
    _, metrics = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path, **extra))
    rows = train_rows(metrics)
    assert "actor/pg_loss" not in rows[1] and "actor/pg_loss" in rows[2]
    assert rows[1]["critic/lr"] < rows[2]["critic/lr"] == pytest.approx(1e-3)


PARTIAL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # a number for half of the prompts (their index is even), a dict with a `bonus` for the others
    if extra_info["index"] % 2 == 0:
        return 1.0
    return {"score": 0.5, "bonus": 1.0}
'''


def test_validation_metrics_of_a_reward_that_returns_numbers(tiny_model_dir, arith_data, tmp_path):
    """A reward that returns a number has no accuracy: no val/acc (it would read 0), and the summary follows the
    reward. A key some samples return counts 0 for the others over the whole set, in chunks of any size; verl's
    per-source names hold the same means."""
    from rlanywhere.api import TrainResult

    reward = tmp_path / "partial.py"
    reward.write_text(PARTIAL_REWARD)
    found = []
    for chunk in (8, 3):
        cfg = load_config(None, base_overrides(tiny_model_dir, arith_data, tmp_path / f"run{chunk}", **{
            "custom_reward_function.path": str(reward), "custom_reward_function.timeout_s": 0,
            "data.val_batch_size": chunk}))
        trainer = RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir)
        found.append(trainer.validate())
    metrics = found[0]
    assert "val/acc" not in metrics and metrics["val/reward"] == pytest.approx(0.75)
    assert metrics["val/bonus"] == pytest.approx(0.5) and all(other == metrics for other in found[1:])
    assert metrics["val-core/arithmetic/reward/mean@1"] == metrics["val/reward"]
    assert metrics["val-aux/arithmetic/bonus/mean@1"] == metrics["val/bonus"]
    lines = TrainResult(run_dir=str(tmp_path), steps=0, minutes=0.0, final_model=None, val_before=metrics,
                        val_after=metrics, trainer=trainer).summary_lines()
    assert "held-out reward (8 prompts, greedy): 0.750" in lines  # one validation: no before -> after


def test_validation_settings_that_cannot_run_are_refused_before_loading(tiny_model_dir, arith_data, tmp_path):
    from rlanywhere.config import ConfigError

    items = base_overrides(tiny_model_dir, arith_data, tmp_path)
    for bad, message in (("actor_rollout_ref.rollout.val_kwargs.n=0", "val_kwargs.n must be positive"),
                         ("data.val_batch_size=-1", "data.val_batch_size must be positive")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, items + [bad])
    with pytest.raises(ConfigError, match="trainer.val_only=true validates on data.val_files"):
        load_config(None, items + ["data.val_files=null", "trainer.val_only=true"])


def test_validating_an_earlier_checkpoint_leaves_the_run_as_it_is(tiny_model_dir, arith_data, tmp_path, capsys):
    """verl's way to evaluate a checkpoint, trainer.val_only=true with resume_from_path, on a finished run: its
    metrics, later checkpoints and latest marker stay; the figures go to val_only_step_N.json, and the summary gives
    the one validation, not a comparison with itself."""
    run = tmp_path / "run"
    items = base_overrides(tiny_model_dir, arith_data, run, **{"trainer.total_training_steps": 4,
                                                               "trainer.logger": "console,tensorboard"})
    assert cli_main(["train", *items]) == 0
    steps = [row["step"] for row in read_metrics(str(run))]
    assert cli_main(["train", *items, "trainer.val_only=true", "trainer.resume_mode=resume_path",
                     f"trainer.resume_from_path={run / 'checkpoints' / 'global_step_2'}"]) == 0
    assert [row["step"] for row in read_metrics(str(run))] == steps
    assert (run / "checkpoints" / "global_step_4").is_dir()
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert json.loads((run / "val_only_step_2.json").read_text())["val/num_samples"] == 8
    assert "held-out accuracy at step 2 (8 prompts, greedy): " in capsys.readouterr().out
