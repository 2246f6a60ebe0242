"""The `calculator` tool: exact, safe arithmetic over + - * / // % ** and parentheses.

The expression is parsed with `ast` and evaluated by walking the tree; nothing is ever passed to eval/exec.
Only int and float literals, unary +/-, and the binary operators above are accepted. Ints stay exact (Python
big ints); `/` gives a float unless both sides are ints that divide exactly. Work is bounded: expression
length, exponent size and result size are capped, so a call cannot hang or exhaust memory.
"""

from __future__ import annotations

import ast
import math
import operator
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from plexrl.tools.base import ToolResult, ToolSpec, failed, parse_arguments

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 4096  # about 1233 decimal digits
MAX_DEPTH = 60


class CalculatorArguments(BaseModel):
    """Arguments of one calculator call."""

    model_config = ConfigDict(extra="forbid")

    expression: str = Field(description="arithmetic expression, e.g. '(3 + 4) * 2 ** 10 / 7'")


class CalculatorError(ValueError):
    """An expression the calculator refuses, with the reason in words."""


Number = int | float

_BINARY: dict[type[ast.operator], tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}


def _check(value: Number) -> Number:
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise CalculatorError(f"result too large (more than {MAX_INT_BITS} bits)")
    elif not math.isfinite(value):
        raise CalculatorError("result is not a finite number (overflow)")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(base, int) and isinstance(exponent, int):
        if exponent < 0:
            if base == 0:
                raise CalculatorError("zero cannot be raised to a negative power")
            return _check(float(base) ** exponent) if abs(exponent) <= MAX_INT_BITS else 0.0
        if base in (0, 1):
            return base
        if base == -1:
            return 1 if exponent % 2 == 0 else -1
        if exponent * max(abs(base).bit_length() - 1, 1) > MAX_INT_BITS:
            raise CalculatorError(f"exponent too large: {base} ** {exponent} has more than {MAX_INT_BITS} bits")
        return _check(base**exponent)
    if base < 0 and not float(exponent).is_integer():
        raise CalculatorError("a negative number cannot be raised to a fractional power")
    try:
        result = float(base) ** float(exponent)
    except (OverflowError, ZeroDivisionError) as exc:
        raise CalculatorError(f"cannot compute {base} ** {exponent}: {exc}") from exc
    return _check(result)


def _evaluate(node: ast.AST, depth: int = 0) -> Number:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"expression nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, depth + 1)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        symbol, fn = _BINARY[type(node.op)]
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if symbol in ("/", "//", "%") and right == 0:
            raise CalculatorError("division by zero")
        if isinstance(node.op, ast.Div) and isinstance(left, int) and isinstance(right, int) and left % right == 0:
            return _check(left // right)
        try:
            return _check(fn(left, right))
        except OverflowError as exc:
            raise CalculatorError(f"overflow in {symbol}: {exc}") from exc
    what = type(node).__name__
    raise CalculatorError(f"unsupported syntax ({what}); use numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> Number:
    """Evaluate an arithmetic expression safely. Raises CalculatorError with a clear reason on refusal.

    >>> evaluate("(3 + 4) * 2 ** 10")
    7168
    >>> evaluate("7 / 2"), evaluate("8 / 2")
    (3.5, 4)
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if not text:
        raise CalculatorError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as exc:
        reason = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        raise CalculatorError(f"not a valid arithmetic expression: {reason}") from None
    except RecursionError as exc:
        raise CalculatorError("expression nested too deeply") from exc
    return _evaluate(tree)


def format_number(value: Number) -> str:
    """Text of a result: ints exact, floats by repr ('inf'/'nan' never occur: they are refused)."""
    return str(value) if isinstance(value, int) else repr(value)


class Calculator:
    """Built-in tool "calculator". Stateless: create/release do nothing."""

    spec = ToolSpec(
        name="calculator",
        description="Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses).",
        arguments=CalculatorArguments,
    )

    def create(self, episode_id: str) -> None:
        """Nothing to allocate."""

    def execute(self, episode_id: str, arguments: dict[str, Any]) -> ToolResult:
        """Evaluate `arguments["expression"]`; ok=False with the reason on any refusal."""
        started = time.perf_counter()
        parsed = parse_arguments(self.spec, arguments)
        if isinstance(parsed, str):
            return failed(parsed, started)
        assert isinstance(parsed, CalculatorArguments)
        try:
            value = evaluate(parsed.expression)
        except CalculatorError as exc:
            return failed(f"calculator: {exc}", started)
        except (RecursionError, MemoryError, ArithmeticError, ValueError, TypeError) as exc:
            return failed(f"calculator: cannot evaluate ({type(exc).__name__}: {exc})", started)
        return ToolResult(ok=True, output=format_number(value), error=None, latency_s=time.perf_counter() - started)

    def release(self, episode_id: str) -> None:
        """Nothing to free."""
