"""The GSM8K format recipe: one-shot prompts, the recipe config, bench/gsm8k_recipe.py's re-scoring of saved
validation responses, and a one-step CPU run of the whole recipe with the tiny random model."""

from __future__ import annotations

import json
import os
import sys

import pytest

from rlanywhere.config import load_config
from rlanywhere.data import (GSM8K_INSTRUCTION, GSM8K_ONE_SHOT_ANSWER, GSM8K_ONE_SHOT_QUESTION, prepare_gsm8k,
                             read_parquet_rows)
from rlanywhere.rewards import gsm8k_format_reward

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import gsm8k_recipe  # noqa: E402


# ---------------------------------------------------------------- one-shot prompts
def test_one_shot_prompt_shows_a_finished_exchange_before_the_question(gsm8k_subset, tmp_path):
    plain = prepare_gsm8k(gsm8k_subset, tmp_path / "plain")
    shot = prepare_gsm8k(gsm8k_subset, tmp_path / "shot", one_shot=True)
    plain_test, shot_test = read_parquet_rows(plain["test"]), read_parquet_rows(shot["test"])
    assert len(shot_test) == len(plain_test)
    for before, after in zip(plain_test, shot_test):
        assert [m["role"] for m in after["prompt"]] == ["user", "assistant", "user"]
        assert after["prompt"][0]["content"] == GSM8K_ONE_SHOT_QUESTION + " " + GSM8K_INSTRUCTION
        assert after["prompt"][1]["content"] == GSM8K_ONE_SHOT_ANSWER
        assert after["prompt"][2] == before["prompt"][0]  # the question itself is what the zero-shot prompt asks
        assert after["reward_model"] == before["reward_model"]
    # the example is a right answer in the taught format, without GSM8K's <<48/2=24>> calculator notes
    assert gsm8k_format_reward("openai/gsm8k", GSM8K_ONE_SHOT_ANSWER, "72")["score"] == 1.0
    assert "<<" not in GSM8K_ONE_SHOT_ANSWER


def test_one_shot_leaves_the_example_question_out_of_training(gsm8k_subset, tmp_path):
    first = json.loads((gsm8k_subset / "train.jsonl").read_text().splitlines()[0])
    assert first["question"] == GSM8K_ONE_SHOT_QUESTION  # the example is GSM8K's first training problem
    plain = read_parquet_rows(prepare_gsm8k(gsm8k_subset, tmp_path / "plain")["train"])
    shot = read_parquet_rows(prepare_gsm8k(gsm8k_subset, tmp_path / "shot", one_shot=True)["train"])
    assert len(shot) == len(plain) - 1
    assert all(row["extra_info"]["question"] != GSM8K_ONE_SHOT_QUESTION for row in shot)


# ---------------------------------------------------------------- the recipe config
def test_recipe_config_loads_with_the_format_reward():
    cfg = load_config(gsm8k_recipe.RECIPE, [])  # unknown or mistyped keys raise here
    assert cfg.custom_reward_function.path == "examples/gsm8k_format_reward.py"
    assert cfg.custom_reward_function.name == "compute_score"
    assert os.path.isfile(os.path.join(REPO, cfg.custom_reward_function.path))
    assert cfg.trainer.val_before_train and cfg.trainer.test_freq > 0
    assert cfg.data.val_max_samples == 200 and cfg.actor_rollout_ref.rollout.val_kwargs.do_sample is False


# ---------------------------------------------------------------- re-scoring and the curve
def _write_val(run_dir, step, responses, truth="72"):
    folder = run_dir / "val_generations"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"step_{step}.jsonl", "w") as handle:
        for index, text in enumerate(responses):
            handle.write(json.dumps({"step": step, "index": index, "prompt": "p", "response": text,
                                     "ground_truth": truth, "score": 0.0}) + "\n")


def test_rescored_validations_and_curve_points(tmp_path):
    _write_val(tmp_path, 0, ["it is 72", "no idea", "#### 70", "so 72 apples"])
    _write_val(tmp_path, 10, ["#### 72", "#### 72", "#### 71", "72 #### 72"])
    _write_val(tmp_path, 5, ["#### 72", "nope", "#### 70", "72"])
    rescored = gsm8k_recipe.rescore_validations(str(tmp_path))
    assert list(rescored) == [0, 5, 10]
    assert rescored[0] == {"format_rate": 0.25, "strict_acc": 0.0, "flexible_acc": 0.5, "num_samples": 4}
    assert rescored[10] == {"format_rate": 1.0, "strict_acc": 0.75, "flexible_acc": 0.75, "num_samples": 4}
    records = [{"step": 0, "val/acc": 0.0}] + [{"step": s, "perf/step_time_s": 6.0} for s in range(1, 11)] + \
              [{"step": 5, "val/acc": 0.25}, {"step": 10, "val/acc": 0.75}]
    points = gsm8k_recipe.curve_points(records, rescored)
    assert [(p["step"], p["minutes"]) for p in points] == [(0, 0.0), (5, 0.5), (10, 1.0)]
    assert [p["acc"] for p in points] == [0.0, 0.25, 0.75]  # the strict accuracy is the curve's accuracy
    assert [p["acc"] for p in points] == [p["trainer_val_acc"] for p in points]
    assert [p["format"] for p in points] == [0.25, 0.5, 1.0]
    lines = gsm8k_recipe.summary_lines(points)
    assert "0.250 -> 1.000 (+75.0 points)" in lines[1] and "target >= 0.90: met" in lines[-1]
    points[-1]["format"] = 0.85
    assert "NOT met" in gsm8k_recipe.summary_lines(points)[-1]


def test_missing_gsm8k_dir_names_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="--gsm8k-dir"):
        gsm8k_recipe.find_gsm8k_dir(str(tmp_path))


# ---------------------------------------------------------------- the whole recipe, one CPU step
@pytest.mark.slow
@pytest.mark.parametrize("zero_shot", [False, True])
def test_recipe_runs_one_step_on_cpu(tiny_model_dir, gsm8k_subset, tmp_path, zero_shot):
    out = tmp_path / "curve.json"
    code = gsm8k_recipe.main(["--smoke", "--model", str(tiny_model_dir), "--gsm8k-dir", str(gsm8k_subset),
                              "--work-dir", str(tmp_path / "work"), "--out", str(out)]
                             + (["--zero-shot"] if zero_shot else []))
    assert code == 0
    result = json.loads(out.read_text())
    assert [p["step"] for p in result["points"]] == [0, 1]
    for point in result["points"]:
        assert point["num_samples"] == 4
        assert point["acc"] == point["trainer_val_acc"]  # our re-scoring agrees with the trainer's val/acc
        assert 0.0 <= point["flexible_acc"] <= 1.0 and 0.0 <= point["format"] <= 1.0
    assert result["points"][1]["minutes"] > 0
    # the trainer logs the reward's other numbers too: its val/flexible_acc is the bench's re-scored one
    from rlanywhere.tracking import read_metrics

    logged = {r["step"]: r for r in read_metrics(str(tmp_path / "work" / "run")) if "val/flexible_acc" in r}
    assert [logged[p["step"]]["val/flexible_acc"] for p in result["points"]] == \
        [p["flexible_acc"] for p in result["points"]]
    saved = (tmp_path / "work" / "run" / "val_generations" / "step_0.jsonl").read_text().splitlines()
    # one-shot: example question, example answer, question, the generation's turn; zero-shot: question, turn
    assert json.loads(saved[0])["prompt"].count("<|im_start|>") == (2 if zero_shot else 4)
    assert ("zero-shot" in result["label"]) == zero_shot
    assert (tmp_path / "curve.csv").exists()


@pytest.mark.slow
def test_probe_compares_zero_and_one_shot_prompts(tiny_model_dir, gsm8k_subset, tmp_path):
    out = tmp_path / "probe.json"
    assert gsm8k_recipe.main(["--probe", "2", "--model", str(tiny_model_dir), "--device", "cpu",
                              "--gsm8k-dir", str(gsm8k_subset), "--out", str(out)]) == 0
    zero, one = json.loads(out.read_text())
    assert (zero["prompt"], one["prompt"]) == ("zero-shot", "one-shot")
    assert zero["num_samples"] == one["num_samples"] == 2
    assert one["prompt_tokens_mean"] > zero["prompt_tokens_mean"]  # the worked example is in the prompt
    for row in (zero, one):
        assert 0 < row["response_tokens_mean"] <= 256 and 0 <= row["at_cap"] <= 2
        assert {"format_rate", "strict_acc", "flexible_acc"} <= set(row)
