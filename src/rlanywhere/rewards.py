"""Rule-based reward functions, a registry keyed by ``data_source``, user reward files, and the RewardManager.

* Built-in scorers return a dict ``{"score": float, "acc": 1.0/0.0, "format": 1.0/0.0}``:
  :func:`gsm8k_score` (verl's GSM8K rule: answer after ``#### ``; it adds ``strict_acc`` / ``flexible_acc``) and
  :func:`arithmetic_score`. :func:`gsm8k_format_reward` is the GSM8K rule with a small reward for a well-formed
  wrong ``#### n`` (a custom_reward_function); :func:`gsm8k_metrics` gives format rate, strict and flexible accuracy.
* ``REWARD_FUNCTIONS`` maps a parquet row's ``data_source`` to a scorer ``fn(solution_str, ground_truth)``;
  add your own with :func:`register_reward`.
* ``custom_reward_function.path/name`` (verl's config keys) load a user file with :func:`load_custom_reward`;
  the function has verl's signature ``fn(data_source, solution_str, ground_truth, extra_info=None)`` and returns
  a float or a dict with at least ``score``. When given, it scores every sample.
* :class:`RewardManager` scores a batch of decoded responses. A scorer that raises (``sys.exit`` included),
  returns something that is not a number (``"1.0"``, ``True``, NaN, a dict without ``score``) or runs longer than
  ``timeout_s`` gives that sample 0, is counted in ``num_errors`` and its first message is logged once, so one
  bad sample never stops a run.
* A user function with ``timeout_s > 0`` runs in a small pool of worker processes (Linux): each call is
  interrupted after ``timeout_s`` (SIGALRM in the worker), and when no call finishes within ``timeout_s`` plus a
  grace period (a call stuck in C code, a dead worker) the pool is terminated and replaced. Built-in scorers are
  ours, fast and cannot hang: they run in-process. The workers start from a fresh server process (multiprocessing's
  "forkserver"), never by forking the trainer: a fork of a process that runs CUDA, NCCL and gloo threads can
  inherit a lock one of them held and hang. A function loaded from a file is loaded again in each worker; any other
  picklable function is sent to them; one that cannot be pickled (a lambda, a closure) makes the pool fork, as
  before, and says so once.
"""

from __future__ import annotations

import contextlib
import decimal
import functools
import importlib.util
import inspect
import logging
import math
import multiprocessing
import numbers
import os
import pickle
import re
import signal
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# a number: optional minus, digits with optional thousands commas, optional decimals (or a bare ".5")
_NUMBER = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
# GSM8K's final-answer marker "#### 42", tolerating "#### $1,234" and extra spaces (one optional "$" between two
# whitespace runs that cannot both take the same spaces: no backtracking over a long run)
_STRICT_ANSWER = re.compile(r"####\s*(?:\$\s*)?(" + _NUMBER + r")")
_ANY_NUMBER = re.compile(_NUMBER)
# verl reads a GSM8K answer in the response's last 300 characters: an answer followed by more text than that is none
SOLUTION_CLIP_CHARS = 300


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip()


def extract_gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """Return the final numeric answer in ``text`` as a string (commas and ``$`` removed), or None.

    ``strict``: the number after the last ``#### `` marker (GSM8K's answer format).
    ``flexible``: the last number anywhere in the text.
    Only the last SOLUTION_CLIP_CHARS characters are read, as verl reads them.
    """
    text = text[-SOLUTION_CLIP_CHARS:]
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
    """Exact numeric comparison when both are decimal numbers ("18" == "18.0" == "18.00"; never a tolerance: a wrong
    digit of a large number is a wrong answer), else exact string match."""
    if answer is None:
        return False
    truth = _clean_number(str(ground_truth))
    try:
        return decimal.Decimal(answer) == decimal.Decimal(truth)
    except (decimal.InvalidOperation, ValueError):
        return answer == truth


def gsm8k_score(
    solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> dict:
    """verl's GSM8K rule reward.

    ``score`` for a correct answer, ``format_score`` for an answer that was extracted but is wrong, 0 when no
    answer could be extracted (with ``method``). ``acc`` is 1.0 when correct; ``format`` is 1.0 when the
    ``#### n`` marker is present (independent of ``method``); ``strict_acc`` / ``flexible_acc`` say whether the
    ``#### n`` number / the last number anywhere in the text equals the answer, whatever ``method`` scores.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"unknown extraction method {method!r}; valid: ['flexible', 'strict']")
    strict_answer = extract_gsm8k_answer(solution_str, "strict")
    flexible_answer = extract_gsm8k_answer(solution_str, "flexible")
    strict_correct = _answers_match(strict_answer, ground_truth)
    flexible_correct = _answers_match(flexible_answer, ground_truth)
    answer, correct = (strict_answer, strict_correct) if method == "strict" else (flexible_answer, flexible_correct)
    if correct:
        value = score
    elif answer is not None:
        value = format_score
    else:
        value = 0.0
    return {"score": float(value), "acc": 1.0 if correct else 0.0, "format": 1.0 if strict_answer is not None else 0.0,
            "strict_acc": 1.0 if strict_correct else 0.0, "flexible_acc": 1.0 if flexible_correct else 0.0}


# verl's gsm8k format_score for a well-formed but wrong "#### n": small against the 1.0 for a right answer, so the
# policy is never paid more for a tidy wrong answer than for a right one, but a model at 0 % accuracy that starts
# writing the marker gets a signal GRPO can rank.
GSM8K_FORMAT_SCORE = 0.1


def gsm8k_format_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                        format_score: float = GSM8K_FORMAT_SCORE) -> dict:
    """GSM8K reward with a format bonus, in verl's custom_reward_function signature (the gsm8k_format recipe).

    1.0 when the number after the last ``####`` equals the answer, ``format_score`` when a ``#### <number>`` line
    is there but wrong, 0 otherwise. The dict also carries ``format``, ``strict_acc`` and ``flexible_acc`` (the
    last number anywhere in the response equals the answer) for metrics; ``data_source`` is not consulted."""
    return gsm8k_score(solution_str, ground_truth, method="strict", format_score=format_score)


def gsm8k_metrics(responses: list[str], ground_truths: list[Any]) -> dict:
    """The three honest GSM8K numbers over a set of responses, each a share in [0, 1].

    ``format_rate``: a ``#### <number>`` is there; ``strict_acc``: that number equals the answer;
    ``flexible_acc``: the last number anywhere in the response equals the answer (no marker needed)."""
    if len(responses) != len(ground_truths):
        raise ValueError(f"gsm8k_metrics got {len(responses)} responses and {len(ground_truths)} ground truths; "
                         "pass one ground truth per response")
    if not responses:
        raise ValueError("gsm8k_metrics got no responses; there is nothing to measure")
    rows = [gsm8k_score(text, truth) for text, truth in zip(responses, ground_truths)]
    return {"format_rate": float(np.mean([r["format"] for r in rows])),
            "strict_acc": float(np.mean([r["strict_acc"] for r in rows])),
            "flexible_acc": float(np.mean([r["flexible_acc"] for r in rows])), "num_samples": len(rows)}


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


def custom_reward_from_config(section: Any) -> Callable | None:
    """The function `custom_reward_function` (path, name, reward_kwargs) names, loaded; None without a path."""
    if not section.path:
        return None
    return load_custom_reward(section.path, section.name, dict(section.reward_kwargs or {}))


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
    loaded = functools.partial(fn, **reward_kwargs) if reward_kwargs else fn
    with contextlib.suppress(AttributeError, TypeError):  # how a worker process loads it again (RewardManager)
        loaded.reward_source = (str(file), name, dict(reward_kwargs or {}))
    return loaded


class _CallTimedOut(Exception):
    pass


def _raise_timeout(signum, frame):
    raise _CallTimedOut()


_worker_fn: Callable | None = None  # the user's function inside a pool worker (handed over by fork, never pickled)


def _torch_on_one_thread() -> None:
    """As DataLoader workers do: torch's ops in a worker on one thread (no oversubscription, no OpenMP pool
    inherited mid-use). A worker started by the server has no torch (it starts in a fraction of a second without
    it): if the user's function imports torch, it gets one thread from OMP_NUM_THREADS."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    else:
        os.environ["OMP_NUM_THREADS"] = "1"


def _init_worker(fn: Callable | None, source: tuple | None = None, started=None) -> None:
    global _worker_fn
    _torch_on_one_thread()
    _worker_fn = load_custom_reward(*source) if source is not None else fn
    if started is not None:  # the pool's count of workers ready (the stall clock waits for them)
        with started.get_lock():
            started.value += 1
    # A process group of its own: a signal to the trainer's group (torchrun stops a rank with killpg(SIGTERM), a
    # terminal's Ctrl-C) is the trainer's to handle; a worker killed by it would leave the pool waiting forever
    # for its result, and the trainer could never save. Pool.terminate() still ends the worker by its pid.
    os.setpgid(0, 0)
    from .reward_forkserver import end_with_the_server

    end_with_the_server()  # out of the trainer's group, but not outliving it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal reaches the whole group: the parent handles it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the trainer's save-and-stop handler, inherited by fork
    signal.signal(signal.SIGALRM, _raise_timeout)


def _worker_started(pid: int) -> bool:
    """Whether the pool worker `pid` ran `_init_worker` (it leads a process group of its own from there on)."""
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return True  # gone already: nothing to kill


VERL_REWARD_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")
_CALL_BY_KEYWORD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # function -> takes verl's names


def call_custom_reward(fn: Callable, data_source: str, response: str, ground_truth: Any, extra_info: Any) -> Any:
    """One call of a custom reward function: by keyword where it takes verl's parameter names (or **kwargs), as verl's
    reward managers call it, so their order and further parameters are the function's own; positionally, in verl's
    order, where it names them otherwise."""
    try:
        by_keyword = _CALL_BY_KEYWORD.get(fn)
    except TypeError:  # not weakly referable: looked at each call
        by_keyword = None
    if by_keyword is None:
        by_keyword = _takes_verl_names(fn)
        with contextlib.suppress(TypeError):
            _CALL_BY_KEYWORD[fn] = by_keyword
    if by_keyword:
        return fn(data_source=data_source, solution_str=response, ground_truth=ground_truth, extra_info=extra_info)
    return fn(data_source, response, ground_truth, extra_info)


def _takes_verl_names(fn: Callable) -> bool:
    """Whether `fn` takes data_source, solution_str, ground_truth and extra_info by name (**kwargs counts)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or a C function: no signature to read
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return set(VERL_REWARD_PARAMETERS[:3]) <= set(parameters) or len(parameters) == 1
    return set(VERL_REWARD_PARAMETERS) <= set(parameters)


def _score_in_worker(call: tuple, timeout_s: float) -> tuple:
    """("ok", result dict) or ("error", message, traceback) for one call, cut off after timeout_s by SIGALRM."""
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return "ok", _as_result_dict(call_custom_reward(_worker_fn, *call))
    except _CallTimedOut:
        return "error", f"timed out after {timeout_s:g} s (custom_reward_function.timeout_s)", ""
    except (Exception, SystemExit) as err:  # noqa: BLE001 - user code may raise anything, sys.exit included
        return "error", f"{type(err).__name__}: {err}", traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _as_score(value: Any) -> float:
    """A finite float from a Python/numpy number or a one-element tensor; strings and booleans are errors."""
    if _is_tensor(value) or isinstance(value, np.ndarray):
        count = value.numel() if _is_tensor(value) else value.size
        if count != 1 or value.dtype in (np.bool_, getattr(sys.modules.get("torch"), "bool", np.bool_)):
            raise TypeError(f"reward score must be a number, got a {value.dtype} array of {count} element(s)")
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"reward score must be a number, got {type(value).__name__} {value!r}")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score {score}")
    return score


def _as_result_dict(result: Any) -> dict:
    """Normalise a scorer's return value to a dict with a finite float ``score``; raise if impossible."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward function returned a dict without 'score' (keys: {sorted(result)})")
        out = dict(result)
    else:
        out = {"score": result}
    out["score"] = _as_score(out["score"])
    return out


WORKER_START_GRACE_S = 120.0  # a new reward worker's start (imports of the user's file) before its first answer


class RewardManager:
    """Score decoded responses: a user function (``custom_fn``, verl signature) or the registry by data_source.

    ``__call__`` returns ``(scores, info)``: ``scores`` is a float tensor ``[batch]`` on CPU, ``info`` holds
    per-sample lists ``acc`` and ``format`` (missing -> 0.0), any other numeric keys the scorers return
    (missing -> 0.0), and ``num_errors`` (int). Errors are scored 0 and counted; the first one is logged once and
    the latest is kept in ``last_error``. ``timeout_s > 0`` runs ``custom_fn`` in worker processes with that
    per-call limit (see the module docstring); call ``close()`` to stop them.
    """

    def __init__(self, custom_fn: Callable | None = None, timeout_s: float = 0.0, num_workers: int | None = None,
                 start_method: str | None = None):
        self.custom_fn = custom_fn
        self.start_method = start_method  # the pool's; None: forkserver when the function can be sent, else fork
        self.timeout_s = float(timeout_s or 0.0)
        self.num_workers = num_workers or min(4, os.cpu_count() or 1)
        self.use_pool = custom_fn is not None and self.timeout_s > 0 and sys.platform.startswith("linux")
        if custom_fn is not None and self.timeout_s > 0 and not self.use_pool:
            logger.warning("custom_reward_function.timeout_s is enforced on Linux only: here the reward function "
                           "runs in-process without a time limit")
        self._pool = None
        self._workers: list = []  # the pool's worker processes (close() kills any that never started)
        self._logged_error = False
        self.last_error: str | None = None
        self.pools_replaced = 0

    def _score_one(self, data_source: str, response: str, ground_truth: Any, extra_info: dict | None):
        if self.custom_fn is not None:
            return call_custom_reward(self.custom_fn, data_source, response, ground_truth, extra_info)
        return get_reward_fn(data_source)(response, ground_truth)

    _as_result_dict = staticmethod(_as_result_dict)

    # -------------------------------------------------------------------------------- worker pool
    def _get_pool(self):
        if self._pool is None:
            method, initargs = self._pool_start()
            context = multiprocessing.get_context(method)
            if method == "forkserver":  # one server imports this module (no torch: up in ~0.1 s)
                from .reward_forkserver import start_server

                start_server(context)  # in a process group of its own: a signal to the trainer's leaves it running
            before = set(multiprocessing.active_children())
            started = context.Value("i", 0)  # workers past their start (the user's file imported)
            self._pool = context.Pool(self.num_workers, initializer=_init_worker, initargs=(*initargs, started))
            self._workers = [p for p in multiprocessing.active_children() if p not in before]
            self._workers_started = started
        return self._pool

    def _pool_start(self) -> tuple[str, tuple]:
        """How the workers start and get the function: from a fresh server (forkserver) with the function's file
        to load again, or the function pickled; fork only for a function that cannot be pickled."""
        source = getattr(self.custom_fn, "reward_source", None)
        method = self.start_method
        if source is not None:
            return method or "forkserver", (None, source)
        try:
            pickle.dumps(self.custom_fn)
        except Exception:  # noqa: BLE001 - a lambda, a closure, a local function: only fork can hand it over
            if method not in (None, "fork"):
                raise
            logger.info("the reward function cannot be pickled (a lambda or a closure?): its worker processes are "
                        "forked from the trainer; define it at the top level of a module to avoid that")
            return "fork", (self.custom_fn, None)
        return method or "forkserver", (self.custom_fn, None)

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones).

        A worker forked while another of the trainer's threads held an interpreter lock can hang inside fork,
        before `_init_worker` runs (seen under torchrun: CPython's after-fork thread cleanup waiting on a lock).
        It still has the trainer's Python SIGTERM handler, which it can never run, so Pool.terminate() would wait
        for it forever. Such a worker never took a call: it is killed first."""
        if self._pool is not None:
            for worker in self._workers:
                if worker.is_alive() and not _worker_started(worker.pid):
                    worker.kill()
            self._pool.terminate()
            self._pool.join()
            self._pool = None
            self._workers = []

    def _outcomes_in_pool(self, calls: list[tuple]) -> list[tuple]:
        """One ("ok", dict) / ("error", message, traceback) per call, in order, from the worker pool."""
        pool = self._get_pool()
        finished = threading.Event()
        handles = [pool.apply_async(_score_in_worker, (call, self.timeout_s), callback=lambda _: finished.set(),
                                    error_callback=lambda _: finished.set()) for call in calls]
        outcomes: list[tuple | None] = [None] * len(calls)
        pending = set(range(len(calls)))
        # Every healthy call ends within timeout_s (SIGALRM): a longer silence means a worker is stuck. A new pool's
        # workers first import the user's file (its own imports: seconds): the silence counts from when they all
        # have started (at most WORKER_START_GRACE_S after the pool did)
        stall_limit = self.timeout_s + max(2.0, 0.5 * self.timeout_s)
        last_progress = submitted = time.monotonic()
        starting = getattr(self, "_workers_started", None)
        while pending:
            finished.clear()
            for index in [i for i in pending if handles[i].ready()]:
                pending.discard(index)
                last_progress = time.monotonic()
                try:
                    outcomes[index] = handles[index].get(0)
                except Exception as err:  # noqa: BLE001 - an unpicklable result, a timeout raised late
                    outcomes[index] = ("error", f"{type(err).__name__}: {err}", "")
            if not pending:
                break
            # the callback may fire just before its result reads ready (and before the clear above): the wait is
            # short and the silence is measured from the last result, so a result in that window is never lost
            finished.wait(0.2)
            if starting is not None:
                if starting.value < (self.num_workers or 1) and time.monotonic() - submitted < WORKER_START_GRACE_S:
                    last_progress = time.monotonic()  # still importing: not silent yet
                    continue
                starting = None
            if time.monotonic() - last_progress > stall_limit:
                for index in pending:
                    outcomes[index] = ("error", f"timed out after {self.timeout_s:g} s and did not stop (stuck in C "
                                                "code or the worker died); the reward worker pool was replaced", "")
                self.close()
                self.pools_replaced += 1
                break
        return outcomes

    def _outcomes_in_process(self, calls: list[tuple]) -> list[tuple]:
        outcomes = []
        for call in calls:
            try:
                outcomes.append(("ok", _as_result_dict(self._score_one(*call))))
            except (Exception, SystemExit) as err:  # noqa: BLE001 - user scorers may raise anything, sys.exit too
                outcomes.append(("error", f"{type(err).__name__}: {err}", traceback.format_exc()))
        return outcomes

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

        calls = list(zip(data_sources, responses, ground_truths, extra_infos))
        outcomes = self._outcomes_in_pool(calls) if self.use_pool else self._outcomes_in_process(calls)
        results: list[dict | None] = []
        num_errors = 0
        for (source, *_), outcome in zip(calls, outcomes):
            if outcome[0] == "ok":
                results.append(outcome[1])
                continue
            num_errors += 1
            results.append(None)
            self.last_error = outcome[1]
            if not self._logged_error:
                self._logged_error = True
                logger.warning("reward function failed on a %r sample (scored 0; further failures are only counted "
                               "in num_errors): %s\n%s", source, outcome[1], outcome[2])

        extra_keys = sorted(
            {k for r in results if r for k, v in r.items() if k != "score" and _is_number(v)} | {"acc", "format"}
        )
        info: dict[str, Any] = {key: [_finite_or_zero(r.get(key)) if r else 0.0 for r in results] for key in extra_keys}
        info["num_errors"] = num_errors
        info["acc_returned"] = sum(1 for r in results if r and "acc" in r)  # none: `acc` means nothing (all 0)
        import torch  # here, not at the top: the reward workers' server imports this module and needs no torch

        scores = torch.tensor([r["score"] if r else 0.0 for r in results], dtype=torch.get_default_dtype())
        return scores, info


def _is_tensor(value: Any) -> bool:
    """A torch tensor, without importing torch (a value can only be one if its code imported torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_number(value: Any) -> bool:
    """A Python or numpy number (a bool too: an extra key such as acc may be one) or a one-element tensor."""
    return isinstance(value, (numbers.Real, np.bool_)) or (_is_tensor(value) and value.numel() == 1)


def _finite_or_zero(value: Any) -> float:
    if value is None or not _is_number(value):
        return 0.0
    value = float(value)
    return value if math.isfinite(value) else 0.0


__all__ = [
    "extract_gsm8k_answer",
    "gsm8k_score",
    "gsm8k_format_reward",
    "gsm8k_metrics",
    "GSM8K_FORMAT_SCORE",
    "arithmetic_score",
    "REWARD_FUNCTIONS",
    "register_reward",
    "get_reward_fn",
    "load_custom_reward",
    "custom_reward_from_config",
    "RewardManager",
]
