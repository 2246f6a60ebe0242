"""`get_tool`: a tool by name, a built-in (`calculator`, `python`) or a user's own by dotted path (resolved
for the `tool` role only, `plexrl.roles`). Above the tools it builds, so that `base.py` imports none of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plexrl.roles import resolve
from plexrl.tools.base import Tool, ToolSpec
from plexrl.tools.calculator import Calculator
from plexrl.tools.python import PythonTool


def _builtins() -> dict[str, Callable[..., Tool]]:
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


__all__ = ["get_tool"]
