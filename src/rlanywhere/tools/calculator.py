"""A calculator tool: arithmetic on numbers with + - * / // % ** and parentheses, evaluated by walking the parsed
syntax tree (`ast`), never `eval`: names, calls, attributes and anything but numbers and these operators are
refused, and powers / results are bounded so that a call cannot take the process down."""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from .base import BaseTool, ToolResponse, ToolSchema

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 10**100


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; the message is what the model reads."""


def evaluate_expression(expression: str) -> int | float:
    """The value of an arithmetic expression (see the module docstring); CalculatorError names what is wrong."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    if not text:
        raise CalculatorError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        if isinstance(result, complex):
            raise CalculatorError("the result is not a real number")
        if abs(result) > MAX_MAGNITUDE:
            raise CalculatorError("result too large")
        return result
    raise CalculatorError(f"only numbers, + - * / // % ** and parentheses are allowed; found "
                          f"{type(node).__name__.lower()}")


def format_number(value: int | float) -> str:
    """Integers as integers (6.0 -> 6), other floats with up to 10 significant digits."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return f"{value:.10g}" if isinstance(value, float) else str(value)


class CalculatorTool(BaseTool):
    """`calculator(expression)`: the value of an arithmetic expression, or an error text.

    `calc_reward` is 1.0 for a row whose calls evaluated at least one expression, else 0.0: a tool-use signal a
    reward function can read from `extra_info["rollout_reward_scores"]["calculator"]` (verl's layout)."""

    def __init__(self, config: dict | None = None, tool_schema: Any = None):
        super().__init__(config, tool_schema)
        self._evaluated: dict[str, int] = {}  # instance -> expressions evaluated without error

    @classmethod
    def default_schema(cls) -> ToolSchema:
        return ToolSchema("calculator", "Evaluate an arithmetic expression with + - * / and parentheses.",
                          {"type": "object", "properties": {"expression": {
                              "type": "string", "description": "the expression, e.g. 123 * 456 + 7"}},
                           "required": ["expression"]})

    def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        expression = parameters.get("expression", parameters.get("expr"))
        if expression is None:
            raise CalculatorError("missing argument 'expression'")
        value = format_number(evaluate_expression(str(expression)))
        self._evaluated[instance_id] = self._evaluated.get(instance_id, 0) + 1
        return ToolResponse(value), 0.0, {}

    def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 1.0 if self._evaluated.get(instance_id) else 0.0

    def release(self, instance_id: str, **kwargs: Any) -> None:
        self._evaluated.pop(instance_id, None)


__all__ = ["CalculatorTool", "CalculatorError", "evaluate_expression", "format_number"]
