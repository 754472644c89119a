"""The recipe variants on the whole loop, CPU, tiny random Qwen2: DAPO (clip-higher, token-mean, dynamic sampling,
overlong shaping, truncated masking), GSPO and the Dr. GRPO preset, through the real config keys."""

from __future__ import annotations

import pytest
import torch

from rlanywhere.config import load_config
from rlanywhere.planner import make_plan
from rlanywhere.stepmetrics import PhaseTimer
from rlanywhere.tracking import read_metrics
from rlanywhere.trainer import RLTrainer

from .test_e2e import base_overrides, killed_then_resumed, run_training, train_rows

pytestmark = pytest.mark.slow

# A reward whose value differs between samples of one prompt (a parity of the text), so some groups are
# informative and some are not; `acc` mirrors it.
PARITY_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    value = float(sum(map(ord, solution_str)) % 2)\n"
    "    return {'score': value, 'acc': value}\n"
)


def reward_file(tmp_path, text=PARITY_REWARD) -> str:
    path = tmp_path / "reward.py"
    path.write_text(text)
    return str(path)


def make_trainer(overrides: list[str]) -> RLTrainer:
    cfg = load_config(None, overrides)
    return RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir)


def groups_of(scores: torch.Tensor, n: int) -> list[list[float]]:
    return [scores[i:i + n].tolist() for i in range(0, len(scores), n)]


def test_dynamic_sampling_keeps_only_informative_groups(tiny_model_dir, arith_data, tmp_path):
    trainer = make_trainer(base_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "algorithm.adv_estimator": "grpo", "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.metric": "acc", "algorithm.filter_groups.max_num_gen_batches": 20,
        "data.gen_batch_size": 3, "custom_reward_function.path": reward_file(tmp_path)}))
    scored, metrics, first = trainer.rollouts.rollout_and_score(trainer.loader.next_batch(), PhaseTimer("cpu"))
    assert first == 0
    assert len(scored.items) == 4 and scored.rollout.response_ids.shape[0] == 8  # train_batch_size x n
    assert metrics["filter_groups/prompts_topped_up"] == 0
    for group in groups_of(scored.scores, 2):
        assert group[0] != group[1]  # every group kept has something to learn from
    rounds = metrics["filter_groups/num_gen_batches"]
    assert metrics["filter_groups/prompts_drawn"] == 3 * rounds  # gen_batch_size prompts a round
    assert trainer.loader.position == rounds  # every round drew a new loader batch
    assert metrics["filter_groups/prompts_informative"] >= 4 and rounds >= 2
    assert scored.info["acc_returned"] == 3 * rounds * 2  # counts: every round's samples once
    # the kept prompts' rows line up with their items: prompt ids of row 2i are item i's
    for i, item in enumerate(scored.items):
        real = scored.rollout.prompt_ids[2 * i][scored.rollout.prompt_mask[2 * i].bool()].tolist()
        assert real == item["input_ids"]


def test_dynamic_sampling_tops_up_at_the_cap(tiny_model_dir, arith_data, tmp_path):
    constant = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    trainer = make_trainer(base_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "algorithm.adv_estimator": "grpo", "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.metric": "score", "algorithm.filter_groups.max_num_gen_batches": 2,
        "custom_reward_function.path": reward_file(tmp_path, constant)}))
    scored, metrics, first = trainer.rollouts.rollout_and_score(trainer.loader.next_batch(), PhaseTimer("cpu"))
    assert first == 0
    assert metrics["filter_groups/num_gen_batches"] == 2 and trainer.loader.position == 2
    assert metrics["filter_groups/prompts_informative"] == 0
    assert metrics["filter_groups/prompts_topped_up"] == 4 and len(scored.items) == 4


def test_unknown_filter_metric_names_the_choices(tiny_model_dir, arith_data, tmp_path):
    from rlanywhere.errors import UserError

    trainer = make_trainer(base_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "algorithm.adv_estimator": "grpo", "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.metric": "accuracy"}))
    with pytest.raises(UserError, match="'acc'"):
        trainer.rollouts.rollout_and_score(trainer.loader.next_batch(), PhaseTimer("cpu"))


def test_dapo_recipe_trains(tiny_model_dir, arith_data, tmp_path):
    trainer, metrics = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.clip_ratio_low": 0.2,
        "actor_rollout_ref.actor.clip_ratio_high": 0.28, "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        "algorithm.filter_groups.enable": True, "algorithm.filter_groups.max_num_gen_batches": 4,
        "reward_model.overlong_buffer.enable": True, "reward_model.overlong_buffer.len": 6,
        "reward_model.overlong_buffer.penalty_factor": 0.5, "custom_reward_function.path": reward_file(tmp_path)}))
    rows = train_rows(metrics)
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert 1 <= row["filter_groups/num_gen_batches"] <= 4
        # length 12 = the limit: penalty -0.5; the buffer starts at 12 - 6 = 6 tokens, so every row pays 0..0.5
        assert -0.5 <= row["reward/overlong_penalty"] <= 0.0
        assert row["actor/pg_loss"] == row["actor/pg_loss"] and "actor/grad_norm" in row
    assert any(row["reward/overlong_penalty"] < 0 for row in rows.values())


def test_overlong_penalty_is_added_to_the_score(tiny_model_dir, arith_data, tmp_path):
    trainer = make_trainer(base_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "algorithm.adv_estimator": "grpo", "reward_model.overlong_buffer.enable": True,
        "reward_model.overlong_buffer.len": 4, "custom_reward_function.path": reward_file(tmp_path)}))
    scored, _, _ = trainer.rollouts.rollout_and_score(trainer.loader.next_batch(), PhaseTimer("cpu"))
    lengths = scored.rollout.response_lengths().float()
    texts = scored.rollout.decode(trainer.tokenizer)
    parity = torch.tensor([float(sum(map(ord, text)) % 2) for text in texts])
    # limit 12, buffer 4: -(length - 8) / 4 above 8 tokens
    expected = parity - ((lengths - 8) / 4).clamp(min=0)
    torch.testing.assert_close(scored.scores.float(), expected)


def test_mask_truncated_completions_keeps_cut_off_rows_out_of_the_loss(tiny_model_dir, arith_data, tmp_path):
    # 3 new tokens from a random model over a ~1k-word vocabulary: every response is cut off (checked below)
    common = {"algorithm.adv_estimator": "grpo", "data.max_response_length": 3, "trainer.total_training_steps": 1,
              "trainer.test_freq": -1, "trainer.save_freq": -1, "trainer.val_before_train": False,
              "custom_reward_function.path": reward_file(tmp_path)}
    _, masked = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "masked", **{
        **common, "algorithm.mask_truncated_completions": True}))
    _, plain = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "plain", **common))
    masked, plain = train_rows(masked)[1], train_rows(plain)[1]
    assert masked["response_length/truncated_masked"] == 1.0 and masked["response_length/clip_ratio"] == 1.0
    assert masked["actor/grad_norm"] == 0.0 and masked["actor/pg_loss"] == 0.0  # nothing left to learn from
    assert plain["actor/grad_norm"] > 0.0  # the same rollout (same seed) without masking does move the policy
    assert masked["reward/mean"] == plain["reward/mean"]


def test_gspo_trains_and_differs_from_vanilla(tiny_model_dir, arith_data, tmp_path):
    # two PPO epochs, so the second epoch's ratios leave 1 and the two losses disagree
    common = {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.ppo_epochs": 2,
              "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean", "trainer.total_training_steps": 1,
              "trainer.test_freq": -1,
              "trainer.save_freq": -1, "trainer.val_before_train": False,
              "custom_reward_function.path": reward_file(tmp_path)}
    _, gspo = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "gspo", **{
        **common, "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo",
        "actor_rollout_ref.actor.clip_ratio_low": 3e-4, "actor_rollout_ref.actor.clip_ratio_high": 4e-4}))
    _, vanilla = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "vanilla", **{
        **common, "actor_rollout_ref.actor.clip_ratio_low": 3e-4, "actor_rollout_ref.actor.clip_ratio_high": 4e-4}))
    gspo, vanilla = train_rows(gspo), train_rows(vanilla)
    assert sorted(gspo) == [1]
    # the same rollout (same seed); the updates differ (sequence vs token clipping at 3e-4/4e-4)
    assert gspo[1]["reward/mean"] == vanilla[1]["reward/mean"]
    assert gspo[1]["actor/pg_clipfrac"] != vanilla[1]["actor/pg_clipfrac"]
    assert gspo[1]["actor/pg_clipfrac_lower"] == 0.0


def test_dr_grpo_preset_example_runs(tiny_model_dir, arith_data, tmp_path):
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "dr_grpo.yaml"
    cfg = load_config(str(example), base_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "trainer.total_training_steps": 1, "trainer.test_freq": -1, "trainer.save_freq": -1,
        "trainer.val_before_train": False, "custom_reward_function.path": reward_file(tmp_path)}))
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    trainer = RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir)
    trainer.fit()
    assert trainer.global_step == 1


def test_dynamic_sampling_resumes_exactly(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    """The extra prompts drawn by dynamic sampling are part of the saved loader position: a run killed after
    step 1 and resumed draws (and trains on) exactly what the uninterrupted run did at step 2."""
    extra = {"algorithm.adv_estimator": "grpo", "algorithm.filter_groups.enable": True,
             "algorithm.filter_groups.max_num_gen_batches": 3, "data.gen_batch_size": 3,
             "trainer.save_freq": 1, "trainer.test_freq": -1, "trainer.val_before_train": False,
             "custom_reward_function.path": reward_file(tmp_path)}
    _, uninterrupted = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "a", **extra))
    _, resumed = killed_then_resumed(base_overrides(tiny_model_dir, arith_data, tmp_path / "b", **extra), 1,
                                     monkeypatch)
    a, b = train_rows(uninterrupted), train_rows(resumed)
    assert sorted(b) == [1, 2]
    for key in ("filter_groups/prompts_drawn", "filter_groups/num_gen_batches", "reward/mean", "actor/pg_loss",
                "actor/grad_norm", "response_length/mean"):
        assert b[2][key] == pytest.approx(a[2][key], rel=1e-5, abs=1e-7), key


FLAKY_REWARD = (  # fails on about half of the samples (scored 0 and counted), the rest scored by parity
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    value = sum(map(ord, solution_str)) % 4\n"
    "    if value < 2:\n"
    "        raise RuntimeError('flaky scorer')\n"
    "    return float(value == 2)\n")


def test_dynamic_sampling_ends_with_the_last_pass_and_counts_reward_errors_per_row_scored(tiny_model_dir,
                                                                                          arith_data, tmp_path):
    """trainer.total_epochs=1 with dynamic sampling: a step may draw several batches, so the prompts run out before
    the planned steps; the run ends there (as verl's loop), each prompt drawn once, the last step topped up. Reward
    failures are counted against every round's rows: half of them failing does not read as every call failing."""
    trainer = make_trainer(base_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "algorithm.adv_estimator": "grpo", "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.metric": "score", "algorithm.filter_groups.max_num_gen_batches": 10,
        "data.train_max_samples": 16, "trainer.total_epochs": 1, "trainer.total_training_steps": "null",
        "trainer.test_freq": -1, "trainer.save_freq": -1, "trainer.val_before_train": False,
        "trainer.max_consecutive_failed_reward_steps": 1, "custom_reward_function.timeout_s": 0,
        "custom_reward_function.path": reward_file(tmp_path, FLAKY_REWARD)}))
    assert trainer.total_steps == 4
    trainer.fit()
    rows = list(train_rows(read_metrics(str(tmp_path / "run"))).values())
    assert trainer.loader.batches_drawn() == 4 and trainer.loader.epoch == 0  # 16 prompts, each drawn once
    assert sum(row["filter_groups/num_gen_batches"] for row in rows) == 4 and len(rows) < 4
    assert any(row["reward/errors"] > trainer.loader.batch_size * 2 for row in rows)  # more than one round's rows
