"""The `python` tool: runs model-written code in the `Sandbox` and returns what it printed.

Every call is a fresh sandboxed process: nothing (variables, files) carries over between calls, even within
one episode, so create/release hold no resources. Output is capped by `SandboxLimits.max_output_bytes`.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from plexrl.tools.base import ToolResult, ToolSpec, failed, parse_arguments
from plexrl.tools.sandbox import Sandbox, SandboxLimits

TRUNCATED = "\n[output truncated]"


class PythonArguments(BaseModel):
    """Arguments of one python call."""

    model_config = ConfigDict(extra="forbid")

    code: str = Field(description="a complete Python program; what it prints to stdout is the tool's output")


class PythonTool:
    """Built-in tool "python". `limits` are `SandboxLimits` fields (e.g. timeout_s=2); pass `sandbox` instead
    to share one configured Sandbox. `strict=True` refuses to run code where the sandbox's isolation is
    degraded (each call then fails with the reason); off by default, because the tool's output only feeds the
    policy, not the reward. Raises pydantic.ValidationError (a ValueError) for bad limits."""

    spec = ToolSpec(
        name="python",
        description="Run a Python program in an isolated sandbox (no network, no files kept, standard library "
        "only) and return what it prints.",
        arguments=PythonArguments,
    )

    def __init__(self, sandbox: Sandbox | None = None, *, strict: bool = False, **limits: Any) -> None:
        if sandbox is not None and (limits or strict):
            raise ValueError("pass either a sandbox or limits (and strict) for a new one, not both")
        self.sandbox = sandbox or Sandbox(SandboxLimits(**limits), strict=strict)

    def create(self, episode_id: str) -> None:
        """Nothing to allocate: every call runs in a fresh sandbox."""

    def execute(self, episode_id: str, arguments: dict[str, Any]) -> ToolResult:
        """Run `arguments["code"]`. ok: its stdout. Not ok: stdout + stderr as output and the reason as error."""
        started = time.perf_counter()
        parsed = parse_arguments(self.spec, arguments)
        if isinstance(parsed, str):
            return failed(parsed, started)
        assert isinstance(parsed, PythonArguments)
        result = self.sandbox.run(parsed.code)
        if result.ok:
            return ToolResult(ok=True, output=result.stdout, error=None, latency_s=time.perf_counter() - started)
        output = result.stdout + result.stderr + (TRUNCATED if result.truncated else "")
        return failed(f"python: {result.error}", started, output=output)

    def release(self, episode_id: str) -> None:
        """Nothing to free."""
