"""Runs the tool calls of many rollout rows at once, each in its own daemon thread, with a time limit per call.

A call that raises, returns something that is not (text, reward, metrics), or runs over `timeout_s` gives the model
an error text instead and is counted as an error; a hung call's thread is left behind (daemon: it cannot keep the
process alive) and the rollout goes on. Tools' own isolation (the Python sandbox's subprocess) is what bounds memory.

The threads are kept for the next calls (`_Workers`): starting 128 threads costs tens of milliseconds, which a
multi-turn rollout would pay at every turn end while the GPU waits.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

from .base import BaseTool, ToolResponse, call_tool_method
from .parsing import ToolCall
from .sandbox import truncate_text


@dataclass
class CallResult:
    text: str
    reward: float
    error: bool
    latency_s: float


def _as_response(value: Any) -> tuple[str, float]:
    """(text, reward) of what execute returned; ValueError for garbage."""
    if isinstance(value, tuple) and len(value) >= 1:
        response, reward = value[0], (value[1] if len(value) > 1 else 0.0)
    else:
        response, reward = value, 0.0
    if isinstance(response, ToolResponse):
        text = response.text or ""
    elif isinstance(response, str):
        text = response
    elif hasattr(response, "text") and isinstance(getattr(response, "text"), (str, type(None))):
        text = response.text or ""
    else:
        raise ValueError(f"the tool returned {type(response).__name__}, not text")
    reward = float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else 0.0
    return text, reward


class _Workers:
    """Daemon threads that run one job at a time, reused: every submitted job gets a thread of its own at once (an
    idle one, else a new one), so calls still run all in parallel; a thread stuck in a hung call stays busy and is
    never counted idle again."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, jobs: list) -> None:
        with self._lock:
            start = max(len(jobs) - self._idle, 0)
            self._idle -= len(jobs) - start
        for _ in range(start):
            threading.Thread(target=self._loop, daemon=True, name="tool-worker").start()
        for job in jobs:
            self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            finally:
                with self._lock:
                    self._idle += 1


_WORKERS = [_Workers()]
if hasattr(os, "register_at_fork"):  # a forked child has none of its parent's threads
    os.register_at_fork(after_in_child=lambda: _WORKERS.__setitem__(0, _Workers()))


def run_calls(jobs: Sequence[tuple[BaseTool | None, str, ToolCall]], timeout_s: float = 30.0,
              max_chars: int = 256, truncate_side: str = "middle") -> list[CallResult]:
    """Execute (tool, instance_id, call) jobs in parallel; one CallResult per job, in order."""
    results: list[CallResult | None] = [None] * len(jobs)
    done = [threading.Event() for _ in jobs]

    def work(i: int, tool: BaseTool, instance_id: str, call: ToolCall) -> None:
        start = time.perf_counter()
        try:
            text, reward = _as_response(call_tool_method(tool.execute, instance_id, call.arguments))
            results[i] = CallResult(truncate_text(text, max_chars, truncate_side), reward, False,
                                    time.perf_counter() - start)
        except BaseException as err:  # noqa: BLE001 - whatever a tool does, the model gets a message
            message = truncate_text(f"Error: {type(err).__name__}: {err}", max_chars, truncate_side)
            results[i] = CallResult(message, 0.0, True, time.perf_counter() - start)
        finally:
            done[i].set()

    started = time.perf_counter()
    runs = []
    for i, (tool, instance_id, call) in enumerate(jobs):
        if call.error is not None or tool is None:  # the error text repeats the model's own words: cut it too
            results[i] = CallResult(truncate_text(call.error or f"Error: unknown tool {call.name!r}", max_chars,
                                                  truncate_side), 0.0, True, 0.0)
            done[i].set()
            continue
        runs.append(lambda i=i, tool=tool, instance_id=instance_id, call=call: work(i, tool, instance_id, call))
    _WORKERS[0].submit(runs)
    for i, event in enumerate(done):
        if not event.wait(max(timeout_s - (time.perf_counter() - started), 0.0)):
            results[i] = CallResult(f"Error: the tool did not answer within {timeout_s:g} s", 0.0, True, timeout_s)
    return [replace(r, text=_encodable(r.text)) for r in results]  # type: ignore[union-attr]


def _encodable(text: str) -> str:
    """`text` with lone surrogates written as escapes: a model's JSON may hold half an emoji ("\\ud83d"), which a
    tool's result or error repeats, and a tokenizer refuses such a string."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


__all__ = ["run_calls", "CallResult"]
