"""The tool interface the model calls during a multi-turn rollout, with verl's four methods.

A tool serves many rollout rows at once: `create` opens an instance for one row (with that row's
`extra_info.tools_kwargs[<tool name>].create_kwargs`), `execute` runs one call with the parsed JSON arguments and
returns (result text, step reward, metrics), `calc_reward` scores the instance's state, `release` closes it.
Methods may be plain functions or coroutines (verl's tools are `async def`): `call_tool_method` runs either.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolResponse:
    """What a tool call gives back to the model (text only: no images here)."""

    text: str = ""


@dataclass
class ToolSchema:
    """The OpenAI function schema of a tool: `{type: function, function: {name, description, parameters}}`."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    @classmethod
    def from_dict(cls, schema: dict, where: str = "tool_schema") -> "ToolSchema":
        if not isinstance(schema, dict):
            raise ValueError(f"{where} must be a mapping {{type: function, function: {{name, description, "
                             f"parameters}}}}, got {type(schema).__name__}")
        function = schema.get("function", schema)
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name is missing: every tool needs a name the model calls it by")
        return cls(name=name, description=str(function.get("description") or ""),
                   parameters=dict(function.get("parameters") or {"type": "object", "properties": {}}))

    def to_dict(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


class BaseTool:
    """A tool (verl's BaseTool contract); subclasses override `execute`, and `create` / `calc_reward` / `release`
    when they keep per-row state. `schema` may be None when the subclass has a `default_schema()`."""

    def __init__(self, config: dict | None = None, tool_schema: dict | ToolSchema | None = None):
        self.config = dict(config or {})
        if tool_schema is None:
            tool_schema = self.default_schema()
        self.schema = tool_schema if isinstance(tool_schema, ToolSchema) else ToolSchema.from_dict(tool_schema)
        self.name = self.schema.name

    @classmethod
    def default_schema(cls) -> ToolSchema:
        raise ValueError(f"{cls.__name__} has no built-in schema: give tool_schema in the tool config")

    def get_openai_tool_schema(self) -> dict:
        return self.schema.to_dict()

    def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid.uuid4()), ToolResponse()

    def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        raise NotImplementedError(f"{type(self).__name__}.execute")

    def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


def call_tool_method(method, *args: Any, **kwargs: Any) -> Any:
    """Call a tool method that is a function or a coroutine function (then run to completion in this thread)."""
    result = method(*args, **kwargs)
    if inspect.isawaitable(result):
        return asyncio.run(_await(result))
    return result


def accepts_keyword(method, name: str) -> bool:
    """Whether `method` takes a keyword argument `name` (a parameter of that name, or **kwargs)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


async def _await(awaitable):
    return await awaitable


__all__ = ["BaseTool", "ToolResponse", "ToolSchema", "accepts_keyword", "call_tool_method"]
