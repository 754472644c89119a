"""verl's data rows and config semantics where they used to differ: ground truths as stored, any extra_info.index,
rows without answers when a reward model scores, overlong prompts cut as data.truncation says, `~` in
paths, total_epochs with total_training_steps, lr_scheduler_type, loss_scale_factor, val_only, train_max_samples,
and the values checked when the configuration is read."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlanywhere import preflight
from rlanywhere.config import ConfigError, load_config
from rlanywhere.data import RLDataset
from rlanywhere.trainer import planned_steps

from .test_data import make_tokenizer

LONG = "what is 1 + 2 ? " * 30


def write_rows(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def row(prompt="what is 1 + 2 ?", truth=3, source="arithmetic", index=None):
    extra = {"split": "train"} if index is None else {"split": "train", "index": index}
    return {"prompt": [{"role": "user", "content": prompt}], "data_source": source,
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": extra}


def test_ground_truths_and_indices_arrive_as_stored(tmp_path):
    """verl hands reward_model.ground_truth to the reward function unchanged (Search-R1 stores {"target": [...]})
    and passes extra_info.index along; rows without an index take their position."""
    files = [write_rows(tmp_path / "a.parquet", [row(truth={"target": ["a", "b"]}, index="gsm8k-0")]),
             write_rows(tmp_path / "b.parquet", [row(truth=3), row(truth=4, index=7)]),  # a null index
             write_rows(tmp_path / "c.parquet", [row(truth=[1, 2])])]
    dataset = RLDataset(files, make_tokenizer(), 64)
    assert [item["ground_truth"] for item in dataset.items] == [{"target": ["a", "b"]}, 3, 4, [1, 2]]
    assert [item["index"] for item in dataset.items] == ["gsm8k-0", 1, 7, 3]  # none: the row's position


def test_overlong_prompts_are_cut_as_data_truncation_says_and_dropped_where_verl_would_stop(tmp_path):
    """data.truncation=left|right cuts overlong prompts, as in verl (they were dropped); with verl's default
    truncation=error, where verl stops the run at the first one, they are dropped (counted in the log)."""
    path = write_rows(tmp_path / "t.parquet", [row(), row(prompt=LONG)])
    kept = RLDataset(path, make_tokenizer(), 16, truncation="left")
    assert len(kept) == 2 and len(kept[1]["input_ids"]) == 16
    assert len(RLDataset(path, make_tokenizer(), 16)) == 1 and load_config(None, []).data.truncation == "error"
    assert len(RLDataset(path, make_tokenizer(), 16, truncation="left", filter_overlong_prompts=True)) == 1
    with pytest.raises(ValueError, match="filter_overlong_prompts"):
        RLDataset(path, make_tokenizer(), 16, filter_overlong_prompts=False)  # as asked: verl's stop


def test_a_reward_model_needs_no_ground_truth_and_home_paths_expand(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    rows = [{"prompt": [{"role": "user", "content": "what is 1 + 2 ?"}], "data_source": "chat"}]
    write_rows(tmp_path / "rm.parquet", rows)
    dataset = RLDataset("~/rm.parquet", make_tokenizer(), 64, answers=False)
    assert dataset[0]["ground_truth"] is None
    with pytest.raises(Exception, match="reward_model"):
        RLDataset("~/rm.parquet", make_tokenizer(), 64)
    assert preflight.data_file_problems("~/rm.parquet", "data.train_files", "prompt", "data_source",
                                        answers=False) == []


def test_rows_whose_data_source_no_reward_scores_are_named_before_loading(tmp_path):
    path = str(write_rows(tmp_path / "math.parquet", [row(source="DigitalLearningGmbH/MATH-lighteval")]))
    lines = preflight.data_file_problems(path, "data.train_files", "prompt", "data_source",
                                         scorers={"gsm8k", "arithmetic"})
    assert len(lines) == 1 and "MATH-lighteval" in lines[0] and "custom_reward_function.path" in lines[0]
    assert preflight.data_file_problems(path, "data.train_files", "prompt", "data_source", scorers=None) == []


def test_steps_stop_at_whichever_of_epochs_and_steps_ends_first():
    assert planned_steps(None, None, 10) == 10  # one pass
    assert planned_steps(None, 3, 10) == 30
    assert planned_steps(25, None, 10) == 25  # as many passes as the steps need
    assert planned_steps(1000, 1, 100) == 100  # verl: the epochs end first
    assert planned_steps(50, 1, 100) == 50


def test_lr_scheduler_type_and_verls_null_warmup_style_pick_the_schedule():
    from rlanywhere.builders import make_scheduler

    def lr_after(overrides, steps=9):
        optim = load_config(None, overrides).actor_rollout_ref.actor.optim
        parameter = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([parameter], lr=1.0)
        scheduler = make_scheduler(optimizer, optim, total_steps=10)
        for _ in range(steps):
            optimizer.step()
            scheduler.step()
        return scheduler.get_last_lr()[0]

    key = "actor_rollout_ref.actor.optim"
    assert lr_after([]) == 1.0  # constant
    assert lr_after([f"{key}.lr_scheduler_type=cosine"]) < 0.1
    assert lr_after([f"{key}.lr_scheduler_type=cosine", f"{key}.warmup_style=null"]) < 0.1
    assert lr_after([f"{key}.lr_scheduler_type=cosine", f"{key}.warmup_style=constant"]) == 1.0  # the older key wins
    with pytest.raises(ConfigError, match="lr_scheduler_type='linear'"):
        load_config(None, [f"{key}.lr_scheduler_type=linear"])


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.actor.kl_loss_type=low_var"], "kl_loss_type='low_var'"),
    (["algorithm.kl_penalty=full"], "kl_penalty='full'"),
    (["actor_rollout_ref.actor.clip_ratio_c=1.0"], "clip_ratio_c=1.0"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[q_proj,embed_tokens]"],
     "embeddings or the LM head"),  # the log-prob passes read the head's weight: an adapter there trains nothing
])
def test_values_the_update_would_refuse_are_named_when_the_configuration_is_read(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    assert load_config(None, ["actor_rollout_ref.actor.kl_loss_type=k3+"])  # verl's straight-through names


@pytest.mark.slow
def test_val_only_validates_and_stops_and_train_max_samples_caps_the_prompts(tiny_model_dir, arith_data, tmp_path):
    from .test_e2e import base_overrides, run_training

    trainer, metrics = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "val", **{
        "trainer.val_only": True, "data.train_max_samples": 8}))
    assert len(trainer.train_set) == 8 and trainer.global_step == 0  # validated, nothing trained
    assert [row["step"] for row in metrics] == [0] and "val/acc" in metrics[0]
    checkpoints = tmp_path / "val" / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.glob("global_step_*"))


@pytest.mark.slow
def test_loss_scale_factor_is_the_constant_of_seq_mean_token_sum_norm(tiny_model_dir, arith_data, tmp_path):
    """Dr. GRPO's T: the first step's entropy, aggregated like the loss (one mini-batch, the initial weights), scales
    as 1 / T (its policy loss is 0 at the first step: on-policy, zero-mean group advantages, equal lengths)."""
    from .test_async import (
        _overrides,  # a reward that differs within a group: GRPO advantages are not zero
    )
    from .test_e2e import run_training, train_rows

    entropies = {}
    for factor in (10, 20):
        _, metrics = run_training(_overrides(tiny_model_dir, arith_data, tmp_path / str(factor), **{
            "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm",
            "actor_rollout_ref.actor.loss_scale_factor": factor, "trainer.total_training_steps": 1}))
        entropies[factor] = train_rows(metrics)[1]["actor/entropy"]
    assert entropies[10] > 0 and entropies[10] == pytest.approx(2 * entropies[20], rel=1e-4)


def test_a_run_saved_with_the_old_filter_default_resumes_where_it_drops_the_same_prompts():
    """Runs saved when data.filter_overlong_prompts defaulted to true resume under the unset default where it acts
    the same (truncation=error); with truncation=left it would now cut what that run dropped: refused by name."""
    from rlanywhere.runguard import RunDirError, check_resume_config

    def data(filtered, truncation):
        return {"data": {"filter_overlong_prompts": filtered, "truncation": truncation}}

    assert check_resume_config(data(True, "error"), data(None, "error"), "ckpt") == {}
    # a run saved before data.train_max_samples existed reads every prompt, as -1 (or 0) does
    capped = {"data": {**data(None, "error")["data"], "train_max_samples": -1}}
    assert check_resume_config(data(True, "error"), capped, "ckpt") == {}
    with pytest.raises(RunDirError, match="train_max_samples"):
        check_resume_config(capped, {"data": {**capped["data"], "train_max_samples": 8}}, "ckpt")
    with pytest.raises(RunDirError, match="filter_overlong_prompts: True -> False"):
        check_resume_config(data(True, "left"), data(None, "left"), "ckpt")


def test_without_a_chat_template_every_message_is_in_the_prompt():
    """A one-shot prompt (system instruction, a worked example as a user and an assistant turn, the question): all
    four texts, in order (the system and assistant turns vanished)."""
    from rlanywhere.data import render_prompt

    messages = [{"role": "system", "content": "answer after ####"}, {"role": "user", "content": "1 + 1 ?"},
                {"role": "assistant", "content": "#### 2"}, {"role": "user", "content": "2 + 2 ?"}]
    assert render_prompt(make_tokenizer(chat_template=None), messages) == \
        "answer after ####\n\n1 + 1 ?\n\n#### 2\n\n2 + 2 ?"


def test_response_lengths_count_a_multi_turn_rows_tool_tokens():
    """verl's lengths come from the attention mask: a row's tool-result tokens (mask 0 between its turns) count, as
    they count against the response length; single-turn rows (no holes) are their mask's sum."""
    from rlanywhere.rollout.base import response_extents

    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert response_extents(mask).tolist() == [5, 3, 0]


def test_verl_0_6_rollout_correction_keys_move_onto_rollout_correction():
    """verl 0.6 spelled the correction `algorithm.rollout_is` (+ level, threshold): honoured; its options without a
    counterpart are refused when set (they were noticed as having no effect, with a reason that no longer held)."""
    notices: list[str] = []
    cfg = load_config(None, ["algorithm.rollout_is=true", "algorithm.rollout_is_level=sequence",
                             "algorithm.rollout_is_threshold=3.0", "algorithm.bypass_mode=true"], notices=notices)
    correction = cfg.algorithm.rollout_correction
    assert (correction.rollout_is, correction.rollout_is_threshold, correction.bypass_mode) == ("sequence", 3.0, True)
    assert any("honoured as algorithm.rollout_correction.rollout_is=sequence" in n for n in notices)
    assert load_config(None, ["algorithm.rollout_is=false"]).algorithm.rollout_correction.rollout_is is None
    with pytest.raises(ConfigError, match="rollout_is_veto_threshold"):
        load_config(None, ["algorithm.rollout_is_veto_threshold=1e-4"])
