"""The `python` tool: runs model-written code in the `Sandbox` and returns what it printed."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from plexrl.tools.base import ToolResult, ToolSpec, failed, parse_arguments
from plexrl.tools.sandbox import Sandbox


class PythonArguments(BaseModel):
    """Arguments of one python call."""

    model_config = ConfigDict(extra="forbid")

    code: str = Field(description="a complete Python program; what it prints to stdout is the tool's output")


class PythonTool:
    """Built-in tool "python"."""

    spec = ToolSpec(
        name="python",
        description="Run a Python program in an isolated sandbox (no network, no files) and return its output.",
        arguments=PythonArguments,
    )

    def __init__(self, sandbox: Sandbox | None = None) -> None:
        self.sandbox = sandbox or Sandbox()

    def create(self, episode_id: str) -> None:
        """Nothing to allocate: every call runs in a fresh sandbox."""

    def execute(self, episode_id: str, arguments: dict[str, Any]) -> ToolResult:
        """Run `arguments["code"]`: stdout on success; stdout + stderr and the reason on failure."""
        started = time.perf_counter()
        parsed = parse_arguments(self.spec, arguments)
        if isinstance(parsed, str):
            return failed(parsed, started)
        assert isinstance(parsed, PythonArguments)
        result = self.sandbox.run(parsed.code)
        if result.ok:
            return ToolResult(ok=True, output=result.stdout, error=None, latency_s=time.perf_counter() - started)
        return failed(result.error or "failed", started, output=result.stdout + result.stderr)

    def release(self, episode_id: str) -> None:
        """Nothing to free."""
