"""Rule-based reward functions, a registry keyed by ``data_source``, user reward files, and the RewardManager.

* Built-in scorers return a dict ``{"score": float, "acc": 1.0/0.0, "format": 1.0/0.0}``:
  :func:`gsm8k_score` (verl's GSM8K rule: answer after ``#### ``) and :func:`arithmetic_score`.
* ``REWARD_FUNCTIONS`` maps a parquet row's ``data_source`` to a scorer ``fn(solution_str, ground_truth)``;
  add your own with :func:`register_reward`.
* ``custom_reward_function.path/name`` (verl's config keys) load a user file with :func:`load_custom_reward`;
  the function has verl's signature ``fn(data_source, solution_str, ground_truth, extra_info=None)`` and returns
  a float or a dict with at least ``score``. When given, it scores every sample.
* :class:`RewardManager` scores a batch of decoded responses. A scorer that raises (or returns NaN / no score)
  gives that sample 0, is counted in ``num_errors`` and its first message is logged once, so one bad sample
  never stops a run.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

# a number: optional minus, digits with optional thousands commas, optional decimals (or a bare ".5")
_NUMBER = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
# GSM8K's final-answer marker "#### 42", tolerating "#### $1,234" and extra spaces
_STRICT_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_ANY_NUMBER = re.compile(_NUMBER)


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip()


def extract_gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """Return the final numeric answer in ``text`` as a string (commas and ``$`` removed), or None.

    ``strict``: the number after the last ``#### `` marker (GSM8K's answer format).
    ``flexible``: the last number anywhere in the text.
    """
    if method == "strict":
        matches = _STRICT_ANSWER.findall(text)
    elif method == "flexible":
        matches = _ANY_NUMBER.findall(text)
    else:
        raise ValueError(f"unknown extraction method {method!r}; valid: ['flexible', 'strict']")
    # a trailing comma in "5, 6," is punctuation, not part of the number
    matches = [m for m in (_clean_number(m).rstrip(",") for m in matches) if m not in ("", "-", ".")]
    return matches[-1] if matches else None


def _answers_match(answer: str | None, ground_truth: Any) -> bool:
    """Numeric comparison when both parse as floats ("18" == "18.0" == "18.00"), else exact string match."""
    if answer is None:
        return False
    truth = _clean_number(str(ground_truth))
    try:
        return math.isclose(float(answer), float(truth), rel_tol=1e-9, abs_tol=1e-9)
    except ValueError:
        return answer == truth


def gsm8k_score(
    solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> dict:
    """verl's GSM8K rule reward.

    ``score`` for a correct answer, ``format_score`` for an answer that was extracted but is wrong, 0 when no
    answer could be extracted (with ``method``). ``acc`` is 1.0 when correct; ``format`` is 1.0 when the
    ``#### n`` marker is present (independent of ``method``).
    """
    answer = extract_gsm8k_answer(solution_str, method)
    has_format = extract_gsm8k_answer(solution_str, "strict") is not None
    correct = _answers_match(answer, ground_truth)
    if correct:
        value = score
    elif answer is not None:
        value = format_score
    else:
        value = 0.0
    return {"score": float(value), "acc": 1.0 if correct else 0.0, "format": 1.0 if has_format else 0.0}


def arithmetic_score(solution_str: str, ground_truth: Any) -> dict:
    """Reward for the arithmetic task: 1.0 if the answer is right, else 0.0.

    The answer is the number after ``####`` when the marker is present, else the last number in the text
    (small models rarely write the marker). ``format`` is 1.0 when ``####`` is present.
    """
    strict = extract_gsm8k_answer(solution_str, "strict")
    answer = strict if strict is not None else extract_gsm8k_answer(solution_str, "flexible")
    correct = _answers_match(answer, ground_truth)
    return {"score": 1.0 if correct else 0.0, "acc": 1.0 if correct else 0.0, "format": 1.0 if "####" in solution_str else 0.0}


# data_source -> fn(solution_str, ground_truth) -> float | dict with "score"
REWARD_FUNCTIONS: dict[str, Callable[[str, Any], float | dict]] = {
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "arithmetic": arithmetic_score,
}


def register_reward(data_source: str, fn: Callable[[str, Any], float | dict]) -> None:
    """Score rows whose ``data_source`` equals ``data_source`` with ``fn(solution_str, ground_truth)``."""
    if not callable(fn):
        raise TypeError(f"register_reward({data_source!r}, ...) needs a callable, got {type(fn).__name__}")
    REWARD_FUNCTIONS[data_source] = fn


def get_reward_fn(data_source: str) -> Callable[[str, Any], float | dict]:
    """The registered scorer for ``data_source``; KeyError with the registered names and how to add one."""
    try:
        return REWARD_FUNCTIONS[data_source]
    except KeyError:
        raise KeyError(
            f"no reward function for data_source {data_source!r}; registered: {sorted(REWARD_FUNCTIONS)}. "
            "Point custom_reward_function.path=your_file.py and custom_reward_function.name=your_fn at a "
            "function fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict, or call "
            "rlanywhere.rewards.register_reward(data_source, fn)"
        ) from None


def load_custom_reward(path: str | Path, name: str = "compute_score", reward_kwargs: dict | None = None) -> Callable:
    """Import the Python file at ``path`` and return its function ``name`` (verl's custom_reward_function).

    ``reward_kwargs`` (verl's ``custom_reward_function.reward_kwargs``) are bound as extra keyword arguments.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"custom reward file {str(file)!r} not found; set custom_reward_function.path to an existing .py file"
        )
    module_name = f"rlanywhere_custom_reward_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {str(file)!r} as Python; custom_reward_function.path must be a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets pickle / dataclasses inside the user file find their module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[module_name]
        raise
    fn = getattr(module, name, None)
    if fn is None:
        available = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"custom reward file {str(file)!r} has no function {name!r}; functions found: {available}. "
            "Set custom_reward_function.name to one of them"
        )
    if not callable(fn):
        raise TypeError(f"{name!r} in {str(file)!r} is a {type(fn).__name__}, not a function")
    return functools.partial(fn, **reward_kwargs) if reward_kwargs else fn


class RewardManager:
    """Score decoded responses: a user function (``custom_fn``, verl signature) or the registry by data_source.

    ``__call__`` returns ``(scores, info)``: ``scores`` is a float tensor ``[batch]`` on CPU, ``info`` holds
    per-sample lists ``acc`` and ``format`` (missing -> 0.0), any other numeric keys the scorers return
    (missing -> 0.0), and ``num_errors`` (int). Errors are scored 0 and counted; the first one is logged once.
    """

    def __init__(self, custom_fn: Callable | None = None):
        self.custom_fn = custom_fn
        self._logged_error = False

    def _score_one(self, data_source: str, response: str, ground_truth: Any, extra_info: dict | None):
        if self.custom_fn is not None:
            return self.custom_fn(data_source, response, ground_truth, extra_info)
        return get_reward_fn(data_source)(response, ground_truth)

    @staticmethod
    def _as_result_dict(result: Any) -> dict:
        """Normalise a scorer's return value to a dict with a finite float ``score``; raise if impossible."""
        if isinstance(result, dict):
            if "score" not in result:
                raise ValueError(f"reward function returned a dict without 'score' (keys: {sorted(result)})")
            out = dict(result)
        else:
            out = {"score": result}
        try:
            out["score"] = float(out["score"])
        except (TypeError, ValueError):
            raise TypeError(f"reward score must be a number, got {type(out['score']).__name__}") from None
        if not math.isfinite(out["score"]):
            raise ValueError(f"reward function returned a non-finite score {out['score']}")
        return out

    def __call__(
        self,
        responses: list[str],
        ground_truths: list[Any],
        data_sources: list[str],
        extra_infos: list[dict] | None = None,
    ) -> tuple[torch.Tensor, dict]:
        batch = len(responses)
        if extra_infos is None:
            extra_infos = [None] * batch
        lengths = {"ground_truths": len(ground_truths), "data_sources": len(data_sources), "extra_infos": len(extra_infos)}
        mismatched = {k: n for k, n in lengths.items() if n != batch}
        if mismatched:
            raise ValueError(f"RewardManager got {batch} responses but {mismatched}; pass one entry per response")
        if self.custom_fn is None:
            for source in set(data_sources):
                get_reward_fn(source)  # an unknown data source is a setup error: fail before scoring anything

        results: list[dict | None] = []
        num_errors = 0
        for response, truth, source, extra in zip(responses, ground_truths, data_sources, extra_infos):
            try:
                results.append(self._as_result_dict(self._score_one(source, response, truth, extra)))
            except Exception as err:  # noqa: BLE001 - a user scorer may raise anything; score 0 and count it
                num_errors += 1
                results.append(None)
                if not self._logged_error:
                    self._logged_error = True
                    logger.warning(
                        "reward function failed on a %r sample (scored 0; further failures are only counted in "
                        "num_errors): %s: %s\n%s",
                        source, type(err).__name__, err, traceback.format_exc(),
                    )

        extra_keys = sorted(
            {k for r in results if r for k, v in r.items() if k != "score" and _is_number(v)} | {"acc", "format"}
        )
        info: dict[str, Any] = {key: [_finite_or_zero(r.get(key)) if r else 0.0 for r in results] for key in extra_keys}
        info["num_errors"] = num_errors
        scores = torch.tensor([r["score"] if r else 0.0 for r in results], dtype=torch.get_default_dtype())
        return scores, info


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)


def _finite_or_zero(value: Any) -> float:
    if value is None or not _is_number(value):
        return 0.0
    value = float(value)
    return value if math.isfinite(value) else 0.0


__all__ = [
    "extract_gsm8k_answer",
    "gsm8k_score",
    "arithmetic_score",
    "REWARD_FUNCTIONS",
    "register_reward",
    "get_reward_fn",
    "load_custom_reward",
    "RewardManager",
]
