"""The tool contract: what a tool declares (`ToolSpec`), what one call returns (`ToolResult`), the `Tool`
protocol, and `get_tool` to build one by name.

A tool's resources follow create -> execute* -> release per episode (`episode_id`). `execute` never raises on
bad arguments or hostile input: it returns `ToolResult(ok=False, error=...)` with a sentence saying what was
wrong. Tools do not know about batches, tokens or loss masks; the agentic rollout that calls them does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ToolSpec(BaseModel):
    """What a tool is called and what it takes: `arguments` is the pydantic model of one call's arguments."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    name: str = Field(description="name the model uses to call the tool, e.g. 'python'")
    description: str = Field(description="one or two sentences telling the model what the tool does")
    arguments: type[BaseModel] = Field(description="pydantic model validating the arguments of one call")

    def json_schema(self) -> dict[str, Any]:
        """The function-calling schema of this tool: {"name", "description", "parameters": <JSON schema>}."""
        return {"name": self.name, "description": self.description, "parameters": self.arguments.model_json_schema()}


@dataclass(slots=True)
class ToolResult:
    """The outcome of one call. `output` is what the model sees on success (may be empty); on failure
    `ok` is False and `error` says why (and `output` holds whatever partial output there was)."""

    ok: bool
    output: str
    error: str | None
    latency_s: float


@runtime_checkable
class Tool(Protocol):
    """A tool the policy can call during an episode. Implementations must be safe to call from several
    threads for different episodes at once."""

    spec: ToolSpec

    def create(self, episode_id: str) -> None:
        """Allocate per-episode resources (idempotent)."""
        ...

    def execute(self, episode_id: str, arguments: dict[str, Any]) -> ToolResult:
        """Run one call. Never raises on bad input or hostile code: returns ok=False with a clear error."""
        ...

    def release(self, episode_id: str) -> None:
        """Free per-episode resources (idempotent; unknown episodes are ignored)."""
        ...


def parse_arguments(spec: ToolSpec, arguments: Any) -> BaseModel | str:
    """Validate raw call arguments against `spec.arguments`: the model instance, or an error sentence."""
    if not isinstance(arguments, dict):
        return f"tool {spec.name!r} takes a JSON object of arguments, got {type(arguments).__name__}"
    try:
        return spec.arguments.model_validate(arguments)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(arguments)'}: {e['msg']}" for e in exc.errors())
        fields = ", ".join(spec.arguments.model_fields)
        return f"invalid arguments for tool {spec.name!r} ({problems}); expected fields: {fields}"


def failed(error: str, started: float, output: str = "") -> ToolResult:
    """A failed `ToolResult` timed from `started` (a `time.perf_counter()` value)."""
    return ToolResult(ok=False, output=output, error=error, latency_s=time.perf_counter() - started)


def _builtins() -> dict[str, Callable[..., Tool]]:
    from plexrl.tools.calculator import Calculator
    from plexrl.tools.python import PythonTool

    return {"calculator": Calculator, "python": PythonTool}


def get_tool(name: str, **params: Any) -> Tool:
    """Build a tool: a built-in by name ("calculator", "python") or a user's own as "pkg.module:Factory",
    where Factory is a tool class (a `ToolSpec` as its `spec`) or a factory declared with
    `@plexrl.roles.declare("tool")` (`plexrl.roles`: nothing else of a module can be named); `params` go to
    its constructor.

    Raises ValueError for an unknown name, a module or attribute that cannot be found, or a factory that
    does not return a Tool.
    """
    builtins = _builtins()
    if name in builtins:
        return builtins[name](**params)
    hint = f"use a built-in tool ({', '.join(sorted(builtins))}) or a dotted path 'pkg.module:Factory'"
    if ":" not in name:
        raise ValueError(f"unknown tool {name!r}: {hint}")
    from plexrl.roles import resolve

    try:
        factory = resolve(name, "tool")
    except LookupError as exc:
        raise ValueError(f"tool {name!r}: {exc}; {hint}") from None
    try:
        tool = factory(**params)
    except Exception as exc:  # a user's tool with a bug: its error, named (validation builds tools)
        raise ValueError(f"tool {name!r}: building it raised {type(exc).__name__}: {exc}") from None
    if not isinstance(tool, Tool) or not isinstance(getattr(tool, "spec", None), ToolSpec):
        raise ValueError(
            f"tool {name!r}: it returned {type(tool).__name__}, which is not a Tool "
            "(needs a ToolSpec `spec` and create/execute/release methods)"
        )
    return tool
