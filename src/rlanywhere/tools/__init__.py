"""Tools a model calls during multi-turn rollouts: the BaseTool contract (verl's), built-in tools (calculator,
Python sandbox, verl's GSM8K tool), verl's tool config YAML, hermes tool-call parsing and parallel execution."""

from .base import BaseTool, ToolResponse, ToolSchema
from .calculator import CalculatorTool, evaluate_expression
from .executor import CallResult, run_calls
from .gsm8k import Gsm8kTool
from .parsing import ToolCall, parse_tool_calls
from .registry import ToolConfigError, load_tool_config, tools_from_config
from .sandbox import PythonSandboxTool, run_python

__all__ = ["BaseTool", "ToolResponse", "ToolSchema", "CalculatorTool", "PythonSandboxTool", "Gsm8kTool",
           "evaluate_expression", "run_python", "ToolCall", "parse_tool_calls", "run_calls", "CallResult",
           "load_tool_config", "tools_from_config", "ToolConfigError"]
