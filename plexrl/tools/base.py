"""The tool contract: what a tool declares (`ToolSpec`), what one call returns (`ToolResult`), the `Tool`
protocol, and `get_tool` to build one by name.

A tool's resources follow create -> execute* -> release per episode (`episode_id`). `execute` never raises on
bad arguments or hostile input: it returns `ToolResult(ok=False, error=...)` with a sentence saying what was
wrong. Tools do not know about batches, tokens or loss masks; the agentic rollout that calls them does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ToolSpec(BaseModel):
    """What a tool is called and what it takes: `arguments` is the pydantic model of one call's arguments."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    # declared for a role (`plexrl.roles`): a class whose `spec` is a ToolSpec is a tool, no import needed there
    __plexrl_role__: ClassVar[str] = "tool"

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
