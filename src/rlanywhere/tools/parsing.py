"""Tool calls in a model's turn, hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number per turn. Every problem (JSON that does not parse, a call without a name, an unknown tool, a call cut off by
the length limit) becomes a `ToolCall` with an `error` text that goes back to the model as the call's result."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # set: the call is not executed; this text is its result


def parse_tool_calls(text: str, known_tools: set[str] | None = None) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` in `text`, in order; an opening tag never closed is a truncated call."""
    calls = [_parse_one(body, known_tools) for body in _CALL.findall(text)]
    tail = text[text.rfind(TOOL_CALL_CLOSE) + len(TOOL_CALL_CLOSE):] if TOOL_CALL_CLOSE in text else text
    if TOOL_CALL_OPEN in tail:
        calls.append(ToolCall(None, error="Error: the tool call has no closing </tool_call> (cut off or never closed)"))
    return calls


NAME_SHOWN = 64  # characters of a model-written tool name that an error text repeats


def _json(text: str) -> tuple[object, str | None]:
    """(the parsed value, None) or (None, why not). Besides malformed JSON, a policy can write JSON that Python's
    parser refuses otherwise (nesting deeper than the recursion limit, an integer of thousands of digits): the
    model gets an error text for those too, the rollout goes on."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as err:
        return None, f"{err.msg} at character {err.pos}"
    except (ValueError, RecursionError) as err:
        return None, f"{type(err).__name__}: {str(err)[:200]}"


def _parse_one(body: str, known_tools: set[str] | None) -> ToolCall:
    payload, problem = _json(body.strip())
    if problem is not None:
        return ToolCall(None, error=f"Error: the tool call is not valid JSON ({problem})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(None, error='Error: a tool call must be {"name": <tool>, "arguments": {...}}')
    name, arguments = payload["name"], payload.get("arguments", payload.get("parameters", {}))
    shown = name if len(name) <= NAME_SHOWN else name[:NAME_SHOWN] + "..."
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments, problem = _json(arguments)
        if problem is not None:
            return ToolCall(name, error=f"Error: the arguments of {shown!r} are not a JSON object")
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f"Error: the arguments of {shown!r} must be a JSON object")
    if known_tools is not None and name not in known_tools:
        return ToolCall(name, error=f"Error: unknown tool {shown!r}; available: {', '.join(sorted(known_tools))}")
    return ToolCall(name, arguments)


__all__ = ["ToolCall", "parse_tool_calls", "TOOL_CALL_OPEN", "TOOL_CALL_CLOSE"]
