"""Tools from verl's tool config YAML:

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool     # or one of ours, or your own importable class
        config: {type: native}
        tool_schema: {type: function, function: {name, description, parameters}}

verl's class names of tools we implement ourselves map to ours (`VERL_TOOL_CLASSES`); any other name is imported
(`package.module.Class`) and must follow the BaseTool contract. Errors name the file, the entry and the fix.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ..errors import UserError
from .base import BaseTool
from .calculator import CalculatorTool
from .gsm8k import Gsm8kTool
from .sandbox import PythonSandboxTool

BUILTIN_TOOLS: dict[str, type] = {"calculator": CalculatorTool, "python": PythonSandboxTool, "gsm8k": Gsm8kTool}
VERL_TOOL_CLASSES: dict[str, type] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": Gsm8kTool,
    "rlanywhere.tools.CalculatorTool": CalculatorTool,
    "rlanywhere.tools.PythonSandboxTool": PythonSandboxTool,
    "rlanywhere.tools.Gsm8kTool": Gsm8kTool,
}


class ToolConfigError(UserError, ValueError):
    """A tool config that cannot be loaded; the message names the entry and the fix."""


def resolve_tool_class(class_name: str, where: str) -> type:
    if class_name in VERL_TOOL_CLASSES:
        return VERL_TOOL_CLASSES[class_name]
    if class_name in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[class_name]
    module_name, _, attr = class_name.rpartition(".")
    if class_name.startswith("verl."):
        raise ToolConfigError(f"{where}: class_name {class_name!r} is a verl tool that has no counterpart here; "
                              f"available: {sorted(VERL_TOOL_CLASSES)} and built-ins {sorted(BUILTIN_TOOLS)}, or your "
                              "own class (package.module.Class)")
    try:
        cls = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError) as err:
        raise ToolConfigError(f"{where}: cannot import class_name {class_name!r} ({err}); give an importable "
                              f"package.module.Class or a built-in: {sorted(BUILTIN_TOOLS)}") from None
    if cls is None:
        raise ToolConfigError(f"{where}: class_name {class_name!r} is not package.module.Class or a built-in "
                              f"({sorted(BUILTIN_TOOLS)})")
    if not all(callable(getattr(cls, m, None)) for m in ("execute", "create", "release")):
        raise ToolConfigError(f"{where}: {class_name} lacks create / execute / release; subclass "
                              "rlanywhere.tools.BaseTool")
    return cls


def tools_from_config(data: Any, where: str = "tool config") -> list[BaseTool]:
    """Tool instances from the parsed YAML (`{"tools": [...]}`); names must be unique."""
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        raise ToolConfigError(f"{where}: expected a top-level 'tools:' list of entries with class_name, config and "
                              "tool_schema (verl's tool config format)")
    tools: list[BaseTool] = []
    for i, entry in enumerate(data["tools"]):
        entry_where = f"{where}: tools[{i}]"
        if not isinstance(entry, dict) or not entry.get("class_name"):
            raise ToolConfigError(f"{entry_where} needs a class_name")
        cls = resolve_tool_class(str(entry["class_name"]), entry_where)
        try:
            tool = cls(dict(entry.get("config") or {}), entry.get("tool_schema"))
        except (ValueError, TypeError) as err:
            raise ToolConfigError(f"{entry_where} ({entry['class_name']}): {err}") from None
        tools.append(tool)
    names = [t.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ToolConfigError(f"{where}: tool names {duplicates} appear more than once; each tool needs its own name")
    return tools


def load_tool_config(path: str | Path) -> list[BaseTool]:
    """Tools from a verl tool config YAML file."""
    path = Path(path)
    if not path.is_file():
        raise ToolConfigError(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={str(path)!r}: no such file; "
                              "give the path of a tool config YAML (tools: - class_name, config, tool_schema)")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as err:  # noqa: BLE001 - any YAML error becomes one line naming the file
        raise ToolConfigError(f"{path}: not valid YAML ({err})") from None
    return tools_from_config(data, str(path))


__all__ = ["load_tool_config", "tools_from_config", "resolve_tool_class", "ToolConfigError", "BUILTIN_TOOLS",
           "VERL_TOOL_CLASSES"]
