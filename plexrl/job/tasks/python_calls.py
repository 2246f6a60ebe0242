"""`PythonExpression`: the calculator's contract (an expression in, its value out) served by the sandboxed
`python` tool, for the agentic job of the multiplexed mixes.

The `tool_arithmetic` task's calls carry a bare expression (`<call>347*58</call>`); the `python` tool returns
what a program prints. This tool runs `print(<expression>)` in the sandbox, so every call is a real
sandboxed Python process (~60-140 ms here) instead of an in-process AST walk (~0.01 ms): the tool stall of
an agentic job that the PlexRL paper names as an idle source. Use it from YAML by dotted path:
`pipeline: {name: grpo_tools, params: {tool: "plexrl.job.tasks.python_calls:PythonExpression"}}`.

The expression is the only argument; anything but a single expression (statements, several lines) is
refused before the sandbox runs, and so is one longer than `max_chars`. The sandbox still isolates whatever
the expression does (it may call functions). It never raises: failures come back as a failed `ToolResult`.
"""

from __future__ import annotations

import ast
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from plexrl.tools.base import ToolResult, ToolSpec, failed, parse_arguments
from plexrl.tools.python import PythonTool


class ExpressionArguments(BaseModel):
    """Arguments of one call."""

    model_config = ConfigDict(extra="forbid")
    expression: str = Field(description="one Python expression, e.g. '347*58'; its value is printed")


class PythonExpression:
    """Tool "python expression": the value of one Python expression, computed in a fresh sandbox. `limits` go
    to the sandbox (`SandboxLimits` fields, e.g. timeout_s=2)."""

    spec = ToolSpec(
        name="python_expression",
        description="Evaluate one Python expression in an isolated sandbox and return its printed value.",
        arguments=ExpressionArguments,
    )

    def __init__(self, *, max_chars: int = 200, **limits: Any) -> None:
        self.max_chars = max_chars
        self.python = PythonTool(**limits)

    def create(self, episode_id: str) -> None:
        """Nothing to allocate: every call runs in a fresh sandbox."""

    def execute(self, episode_id: str, arguments: dict[str, Any]) -> ToolResult:
        """ok: the expression's value as printed (no trailing newline). Not ok: why."""
        started = time.perf_counter()
        parsed = parse_arguments(self.spec, arguments)
        if isinstance(parsed, str):
            return failed(parsed, started)
        assert isinstance(parsed, ExpressionArguments)
        text = parsed.expression.strip()
        if len(text) > self.max_chars:
            return failed(f"expression longer than {self.max_chars} characters", started)
        try:
            ast.parse(text, mode="eval")
        except SyntaxError as exc:
            return failed(f"not a single Python expression: {exc.msg}", started)
        result = self.python.execute(episode_id, {"code": self.program(text)})
        if not result.ok:
            return result
        value = result.output.rstrip("\n")
        return ToolResult(ok=True, output=value, error=None, latency_s=time.perf_counter() - started)

    def program(self, expression: str) -> str:
        """The program the sandbox runs for one call: print the expression's value."""
        return f"print({expression})"

    def release(self, episode_id: str) -> None:
        """Nothing to free."""
