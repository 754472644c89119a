"""Runs the tool calls of many rollout rows at once, each in its own daemon thread, with a time limit per call.

A call that raises, returns something that is not (text, reward, metrics), or runs over `timeout_s` gives the model
an error text instead and is counted as an error; a hung call's thread is left behind (daemon: it cannot keep the
process alive) and the rollout goes on. Tools' own isolation (the Python sandbox's subprocess) is what bounds memory.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
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
        text = response.text
    elif isinstance(response, str):
        text = response
    elif hasattr(response, "text") and isinstance(getattr(response, "text"), (str, type(None))):
        text = response.text or ""
    else:
        raise ValueError(f"the tool returned {type(response).__name__}, not text")
    reward = float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else 0.0
    return text, reward


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
    for i, (tool, instance_id, call) in enumerate(jobs):
        if call.error is not None or tool is None:
            results[i] = CallResult(call.error or f"Error: unknown tool {call.name!r}", 0.0, True, 0.0)
            done[i].set()
            continue
        threading.Thread(target=work, args=(i, tool, instance_id, call), daemon=True,
                         name=f"tool-{tool.name}").start()
    for i, event in enumerate(done):
        if not event.wait(max(timeout_s - (time.perf_counter() - started), 0.0)):
            results[i] = CallResult(f"Error: the tool did not answer within {timeout_s:g} s", 0.0, True, timeout_s)
    return [r for r in results]  # type: ignore[misc]


__all__ = ["run_calls", "CallResult"]
