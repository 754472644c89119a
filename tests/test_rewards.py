"""Tests for rlanywhere.rewards: answer extraction, GSM8K/arithmetic scoring, registry, custom files, manager."""

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from rlanywhere import rewards as R

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")


def _gsm8k_rows(n):
    if not GSM8K_TEST.exists():
        pytest.skip(f"{GSM8K_TEST} not available")
    with GSM8K_TEST.open() as f:
        return [json.loads(next(f)) for _ in range(n)]


# ---------------------------------------------------------------- extraction


def test_strict_vs_flexible_on_realistic_strings():
    text = "He makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
    assert R.extract_gsm8k_answer(text, "strict") == "18"
    assert R.extract_gsm8k_answer(text, "flexible") == "18"
    no_marker = "So he made a profit of 200,000-130,000=$70,000 in total."
    assert R.extract_gsm8k_answer(no_marker, "strict") is None
    assert R.extract_gsm8k_answer(no_marker, "flexible") == "70000"
    # strict takes the last marker, flexible the last number even after the marker
    two = "#### 5\nWait, let me redo it.\n#### 7\nThat took 3 minutes."
    assert R.extract_gsm8k_answer(two, "strict") == "7"
    assert R.extract_gsm8k_answer(two, "flexible") == "3"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("#### 1,234", "1234"),
        ("#### $1,234.50", "1234.50"),
        ("#### -5", "-5"),
        ("#### 0.75", "0.75"),
        ("#### 18.", "18"),
        ("####42", "42"),
        ("the answer is #### $ 12", "12"),
    ],
)
def test_strict_extraction_number_formats(text, expected):
    assert R.extract_gsm8k_answer(text, "strict") == expected


def test_flexible_extraction_number_formats():
    assert R.extract_gsm8k_answer("It drops to -3 degrees.", "flexible") == "-3"
    assert R.extract_gsm8k_answer("The total is $1,050.25.", "flexible") == "1050.25"
    assert R.extract_gsm8k_answer("Answers: 5, 6,", "flexible") == "6"
    assert R.extract_gsm8k_answer("no numbers here.", "flexible") is None
    with pytest.raises(ValueError, match="strict"):
        R.extract_gsm8k_answer("1", "loose")


# ---------------------------------------------------------------- gsm8k score


def _core(result: dict) -> dict:
    """The reward and its two classic flags (the strict/flexible accuracy keys are tested on their own)."""
    return {key: result[key] for key in ("score", "acc", "format")}


def test_gsm8k_reference_solutions_score_one_and_corrupted_zero():
    for row in _gsm8k_rows(12):
        solution = row["answer"]
        truth = solution.split("####")[-1].strip().replace(",", "")
        assert _core(R.gsm8k_score(solution, truth)) == {"score": 1.0, "acc": 1.0, "format": 1.0}
        assert R.gsm8k_score(solution, truth, method="flexible")["score"] == 1.0
        body, final = solution.rsplit("####", 1)
        corrupted = f"{body}#### {int(final.strip().replace(',', '')) + 1}"
        assert _core(R.gsm8k_score(corrupted, truth)) == {"score": 0.0, "acc": 0.0, "format": 1.0}
        # without the marker strict finds nothing: no score and no format
        assert _core(R.gsm8k_score(body, truth)) == {"score": 0.0, "acc": 0.0, "format": 0.0}


def test_gsm8k_numeric_comparison_and_format_score():
    assert R.gsm8k_score("#### 18.0", "18")["acc"] == 1.0
    assert R.gsm8k_score("#### 18", "18.00")["acc"] == 1.0
    assert R.gsm8k_score("#### 1,000", "1000")["acc"] == 1.0
    assert R.gsm8k_score("#### -4", "4")["acc"] == 0.0
    wrong = R.gsm8k_score("#### 17", "18", format_score=0.1, score=2.0)
    assert _core(wrong) == {"score": 0.1, "acc": 0.0, "format": 1.0}
    assert R.gsm8k_score("#### 18", "18", format_score=0.1, score=2.0)["score"] == 2.0
    # flexible: answer extracted without the marker -> correct but format 0
    assert _core(R.gsm8k_score("it is 18", "18", method="flexible")) == {"score": 1.0, "acc": 1.0, "format": 0.0}


@pytest.mark.parametrize("text, truth, expected", [
    # (format, strict_acc, flexible_acc)
    ("48 / 2 = 24 in May, 48 + 24 = 72 in all.\n#### 72", "72", (1.0, 1.0, 1.0)),
    ("48 + 24 = 72 clips in all.", "72", (0.0, 0.0, 1.0)),  # right number, no marker: flexible only
    ("#### 70 is wrong, it is 72", "72", (1.0, 0.0, 1.0)),  # marker wrong, a later number right
    ("It is 72.\n#### 70", "72", (1.0, 0.0, 0.0)),  # the last number is the marker's: both wrong
    ("#### 72 clips, bought for 3 dollars each", "72", (1.0, 1.0, 0.0)),  # strict right, last number not
    ("I do not know.", "72", (0.0, 0.0, 0.0)),
    ("#### $1,234.00", "1234", (1.0, 1.0, 1.0)),
    ("####", "72", (0.0, 0.0, 0.0)),  # a bare marker is no answer
])
def test_gsm8k_strict_flexible_and_format_flags(text, truth, expected):
    result = R.gsm8k_score(text, truth)
    assert (result["format"], result["strict_acc"], result["flexible_acc"]) == expected
    assert result["acc"] == result["strict_acc"]  # the default method is strict
    assert R.gsm8k_score(text, truth, method="flexible")["acc"] == result["flexible_acc"]


def test_gsm8k_format_reward_pays_a_well_formed_wrong_answer_a_little():
    reward = R.gsm8k_format_reward
    assert reward("openai/gsm8k", "so 72.\n#### 72", "72")["score"] == 1.0
    assert reward("openai/gsm8k", "so 70.\n#### 70", "72")["score"] == pytest.approx(R.GSM8K_FORMAT_SCORE)
    assert 0.0 < R.GSM8K_FORMAT_SCORE < 1.0
    # the right number without the marker earns nothing: the recipe is teaching the marker
    assert reward("openai/gsm8k", "so the answer is 72", "72")["score"] == 0.0
    assert reward("openai/gsm8k", "no idea", "72", {"split": "train"})["score"] == 0.0
    assert reward("gsm8k", "#### 5", "7", format_score=0.25)["score"] == 0.25


def test_gsm8k_format_reward_through_the_reward_manager_keeps_the_metric_keys():
    manager = R.RewardManager(R.gsm8k_format_reward)
    scores, info = manager(["#### 72", "#### 70", "it is 72", "nothing"], ["72"] * 4, ["openai/gsm8k"] * 4)
    assert scores.tolist() == pytest.approx([1.0, 0.1, 0.0, 0.0])
    assert info["format"] == [1.0, 1.0, 0.0, 0.0]
    assert info["strict_acc"] == [1.0, 0.0, 0.0, 0.0]
    assert info["flexible_acc"] == [1.0, 0.0, 1.0, 0.0]
    assert info["num_errors"] == 0


def test_gsm8k_metrics_shares_over_hand_made_responses():
    responses = ["#### 72", "#### 70", "it is 72", "nothing", "#### 5 then 9"]
    metrics = R.gsm8k_metrics(responses, ["72", "72", "72", "72", "5"])
    assert metrics == {"format_rate": pytest.approx(3 / 5), "strict_acc": pytest.approx(2 / 5),
                       "flexible_acc": pytest.approx(2 / 5), "num_samples": 5}
    with pytest.raises(ValueError, match="one ground truth per response"):
        R.gsm8k_metrics(["#### 1"], [])
    with pytest.raises(ValueError, match="no responses"):
        R.gsm8k_metrics([], [])


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_score():
    assert R.arithmetic_score("7 + 5 = 12", "12") == {"score": 1.0, "acc": 1.0, "format": 0.0}
    assert R.arithmetic_score("7 + 5 = 13", "12") == {"score": 0.0, "acc": 0.0, "format": 0.0}
    # marker wins over a later number
    assert R.arithmetic_score("#### 12 (checked 3 times)", "12") == {"score": 1.0, "acc": 1.0, "format": 1.0}
    assert R.arithmetic_score("#### 11 then 12", "12")["score"] == 0.0
    assert R.arithmetic_score("-3 - 4 = -7", "-7")["acc"] == 1.0
    assert R.arithmetic_score("", "1")["score"] == 0.0


# ---------------------------------------------------------------- registry


def test_registry_lookup_and_register(monkeypatch):
    monkeypatch.setattr(R, "REWARD_FUNCTIONS", dict(R.REWARD_FUNCTIONS))
    assert R.get_reward_fn("openai/gsm8k") is R.gsm8k_score
    assert R.get_reward_fn("gsm8k") is R.gsm8k_score
    assert R.get_reward_fn("arithmetic") is R.arithmetic_score
    with pytest.raises(KeyError, match="custom_reward_function.path"):
        R.get_reward_fn("my/data")
    R.register_reward("my/data", lambda s, gt: float(s == gt))
    assert R.get_reward_fn("my/data")("a", "a") == 1.0
    with pytest.raises(TypeError):
        R.register_reward("bad", 3)


# ---------------------------------------------------------------- custom reward file


def test_load_custom_reward_from_file(tmp_path):
    file = tmp_path / "my_reward.py"
    file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    return {'score': float(solution_str.strip() == ground_truth) + bonus, 'length': len(solution_str)}\n"
        "def other(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 0.5\n"
    )
    fn = R.load_custom_reward(file, "compute_score")
    assert fn("x", " 4 ", "4")["score"] == 1.0
    assert R.load_custom_reward(str(file), "compute_score", {"bonus": 0.5})("x", "4", "4")["score"] == 1.5
    assert R.load_custom_reward(file, "other")("x", "", "") == 0.5
    with pytest.raises(AttributeError, match="other"):  # lists the functions that do exist
        R.load_custom_reward(file, "missing")
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path"):
        R.load_custom_reward(tmp_path / "nope.py", "compute_score")


# ---------------------------------------------------------------- manager


def test_reward_manager_registry_scoring():
    manager = R.RewardManager()
    scores, info = manager(
        ["so #### 18", "it is 12", "#### 5"],
        ["18", "12", "6"],
        ["openai/gsm8k", "arithmetic", "gsm8k"],
    )
    assert scores.dtype.is_floating_point and scores.shape == (3,)
    assert scores.tolist() == [1.0, 1.0, 0.0]
    assert info["acc"] == [1.0, 1.0, 0.0]
    assert info["format"] == [1.0, 0.0, 1.0]
    assert info["num_errors"] == 0


def test_reward_manager_unknown_source_fails_fast():
    with pytest.raises(KeyError, match="registered"):
        R.RewardManager()(["1"], ["1"], ["nowhere"])


def test_reward_manager_lengths_must_match():
    with pytest.raises(ValueError, match="one entry per response"):
        R.RewardManager()(["1", "2"], ["1"], ["gsm8k", "gsm8k"])


def test_reward_manager_counts_and_logs_errors_once(caplog):
    seen_extra = []

    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        seen_extra.append(extra_info)
        if solution_str == "boom":
            raise RuntimeError("scorer exploded")
        if solution_str == "nan":
            return math.nan
        if solution_str == "plain":
            return 0.25
        return {"score": 1.0, "acc": 1.0, "custom": 3}

    manager = R.RewardManager(custom_fn=flaky)
    responses = ["ok", "boom", "nan", "plain", "boom"]
    extras = [{"i": i} for i in range(5)]
    with caplog.at_level(logging.WARNING, logger="rlanywhere.rewards"):
        scores, info = manager(responses, ["1"] * 5, ["anything"] * 5, extras)
        manager(["boom"], ["1"], ["anything"])
    assert scores.tolist() == [1.0, 0.0, 0.0, 0.25, 0.0]
    assert info["num_errors"] == 3  # two raises and one NaN
    assert info["acc"] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert info["format"] == [0.0] * 5
    assert info["custom"] == [3.0, 0.0, 0.0, 0.0, 0.0]
    assert seen_extra[:5] == extras
    messages = [r.getMessage() for r in caplog.records if "scorer exploded" in r.getMessage()]
    assert len(messages) == 1
    assert isinstance(scores, torch.Tensor)


def test_answers_compare_exactly_not_within_a_tolerance():
    """A wrong last digit of a large number is a wrong answer (a float tolerance paid it); 18 == 18.0 still."""
    assert R.arithmetic_score("123456789000", "123456789012")["acc"] == 0.0
    assert R.gsm8k_score("#### 1000000001", "1000000000")["acc"] == 0.0
    assert R.gsm8k_score("#### 0.000000001", "0")["acc"] == 0.0
    assert R.gsm8k_score("#### 18.0", "18")["acc"] == 1.0 and R.gsm8k_score("#### $1,000", "1000")["acc"] == 1.0


def test_gsm8k_reads_the_last_300_characters_as_verl_does_and_stays_fast():
    """An answer followed by more than 300 characters is none (verl's window); a long whitespace run after the
    marker costs no backtracking (it took seconds)."""
    import time

    assert R.gsm8k_score("#### 72" + " and so on." * 20, "72")["acc"] == 1.0
    assert R.gsm8k_score("#### 72" + " and so on." * 40, "72")["acc"] == 0.0
    start = time.perf_counter()
    R.extract_gsm8k_answer("####" + " " * 50_000 + "x")
    R.extract_gsm8k_answer(" " * 50_000 + "####" + " " * 290 + "x")
    assert time.perf_counter() - start < 0.5


def test_custom_functions_are_called_by_keyword_with_their_kwargs_and_numpy_extras_count(tmp_path):
    """verl calls the function by keyword: parameters in another order, or extras as **kwargs, get their values;
    reward_kwargs reach every call; numpy numbers in the returned dict are kept (they were logged as 0)."""
    source = tmp_path / "reward.py"
    source.write_text(
        "import numpy as np\n"
        "def reordered(solution_str, ground_truth, data_source=None, extra_info=None, bonus=0.0):\n"
        "    return {'score': float(solution_str == ground_truth) + bonus, 'acc': np.float32(1.0),\n"
        "            'format': np.bool_(True)}\n"
        "def catch_all(data_source, solution_str, ground_truth, **kwargs):\n"
        "    return float(solution_str == ground_truth)\n")
    for timeout in (0.0, 10.0):  # in this process, and in the worker pool
        manager = R.RewardManager(R.load_custom_reward(source, "reordered", {"bonus": 0.5}), timeout_s=timeout)
        try:
            scores, info = manager(["7", "8"], ["7", "7"], ["x", "x"])
        finally:
            manager.close()
        assert scores.tolist() == [1.5, 0.5] and info["acc"] == [1.0, 1.0] and info["format"] == [1.0, 1.0]
        assert info["num_errors"] == 0
    manager = R.RewardManager(R.load_custom_reward(source, "catch_all"))
    assert manager(["7"], ["7"], ["x"])[0].tolist() == [1.0]
