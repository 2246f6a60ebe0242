"""What a dotted path in a config may name: only code declared for that role, in an allowed module.

A config is data. It names code only through a `pkg.module:name` reference in a field of a role (an
operator, a pipeline builder, a tool, a reward, a dataset loader), and `resolve(ref, role)` is the ONE place
that turns such a reference into an object:

1. the reference has the strict form `pkg.module:name` (ASCII identifiers, no spaces; `parse_ref`);
2. its module lies inside the allow-list in force (`allowed_modules(...)`, set by a server around
   validation): checked BEFORE the import, so a refused module's top-level code never runs;
3. the object found is declared for the role: an `Operator` (`@operator`), a function decorated with
   `@pipeline_builder`, a tool class with a `ToolSpec` as its `spec` (or a factory decorated with
   `@declare("tool")`), a reward or dataset loader decorated with `@declare("reward")` / `@declare("dataset")`.
   Any other function of an allowed module (a project helper that reads files, re-opens the allow-list, ...)
   is refused, so validation never calls what a config chose with arguments the config chose.

An exception raised while importing the module (a user module with a bug) becomes a `LookupError` naming the
module, never a crash of the caller. What this module does NOT do: check what declared code does once it
runs (the allow-list is the trust boundary), or sandbox an allowed module's import.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Literal, TypeVar

Role = Literal["operator", "pipeline", "tool", "reward", "dataset"]
ROLE_ATTR = "__plexrl_role__"
# ASCII identifiers only: what the scan of a config sees is exactly what the import would use
REF = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*):([A-Za-z_][A-Za-z0-9_]*)", re.ASCII)
HOW = {
    "operator": "decorate the function with @plexrl.operator(runs_on=...)",
    "pipeline": "decorate the builder with @plexrl.pipeline_builder",
    "tool": "give the class a ToolSpec as its `spec` (see plexrl/tools/base.py), or decorate the factory with "
    '@plexrl.roles.declare("tool")',
    "reward": 'decorate the function with @plexrl.roles.declare("reward")',
    "dataset": 'decorate the loader with @plexrl.roles.declare("dataset")',
}

NOUN = {
    "operator": "an operator",
    "pipeline": "a declared pipeline builder",
    "tool": "a declared tool",
    "reward": "a declared reward",
    "dataset": "a declared dataset loader",
}

_ALLOWED: ContextVar[tuple[str, ...] | None] = ContextVar("plexrl_allowed_modules", default=None)
T = TypeVar("T")


def declare(role: Role) -> Callable[[T], T]:
    """Mark a function or class as usable by dotted path in the role `role`; returns it unchanged."""
    if role not in HOW:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(HOW)}")

    def mark(obj: T) -> T:
        setattr(obj, ROLE_ATTR, role)
        return obj

    return mark


def pipeline_builder(fn: T) -> T:
    """Declare `fn` a pipeline builder: a function of keyword parameters returning a `PipelineGraph`, usable
    as `pipeline: {name: pkg.module:fn, params: {...}}`."""
    return declare("pipeline")(fn)


def parse_ref(ref: str) -> tuple[str, str] | None:
    """`(module, attribute)` of a strict `pkg.module:name` reference, else None.

    >>> parse_ref("mypkg.ops:length_penalty")
    ('mypkg.ops', 'length_penalty')
    >>> parse_ref(" os:system") is None, parse_ref("Answer: 42") is None
    (True, True)
    """
    m = REF.fullmatch(ref)
    return (m.group(1), m.group(2)) if m else None


def module_allowed(module: str, allowed: tuple[str, ...] | list[str]) -> bool:
    """Whether `module` is one of `allowed` or inside one of them (a package matches its submodules)."""
    return any(module == a or module.startswith(a + ".") for a in allowed)


@contextlib.contextmanager
def allowed_modules(modules: list[str] | tuple[str, ...]) -> Iterator[None]:
    """Within the block (this thread or task), `resolve` imports only modules inside `modules`."""
    token = _ALLOWED.set(tuple(modules))
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def current_allowed() -> tuple[str, ...] | None:
    """The allow-list in force here, None when there is none (a user's own `plexrl run`)."""
    return _ALLOWED.get()


def is_declared(obj: Any, role: Role) -> bool:
    """Whether `obj` is declared for `role` (see the module docstring). An operator is an instance of a class
    declared for the role (`Operator`); a tool class is one whose `spec` is an instance of a class declared
    for it (`ToolSpec`): the classes carry the mark, so nothing here imports them (roles sit below both)."""
    if role == "operator":
        return getattr(type(obj), ROLE_ATTR, None) == "operator"
    tool_specs = (getattr(type(c.__dict__.get("spec")), ROLE_ATTR, None) for c in getattr(obj, "__mro__", ()))
    if role == "tool" and isinstance(obj, type) and "tool" in tool_specs:
        return True  # a tool class: its spec is part of the class, not made by calling it
    return callable(obj) and getattr(obj, ROLE_ATTR, None) == role


def resolve(ref: str, role: Role, *, builtin: bool = False) -> Any:
    """The object `ref` (`pkg.module:name`) names for `role`, after the checks of the module docstring.
    `builtin`: `ref` comes from PlexRL's own table of built-in names (`grpo`, `verify`, `calculator`), not
    from a config, so the allow-list does not apply (the role check does). Raises LookupError with a sentence
    that says what to write instead."""
    parsed = parse_ref(ref) if isinstance(ref, str) else None
    if parsed is None:
        raise LookupError(f"{ref!r} is not a dotted path of the form 'pkg.module:name' (no spaces)")
    module_name, attr = parsed
    allowed = _ALLOWED.get()
    if allowed is not None and not builtin and not module_allowed(module_name, allowed):
        raise LookupError(
            f"{ref!r} names module {module_name!r}, outside the allowed modules {list(allowed)}; ask the "
            "server's owner to add it to `allowed_modules`"
        )
    fresh = module_name not in sys.modules
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise LookupError(
            f"cannot import module {module_name!r} of {ref!r} ({exc}); check the path and that the module is "
            "importable (installed, or on PYTHONPATH)"
        ) from None
    except Exception as exc:  # a user module with a bug: its error, named, not a crash of the caller
        if fresh:
            sys.modules.pop(module_name, None)
        raise LookupError(
            f"importing module {module_name!r} of {ref!r} raised {type(exc).__name__}: {exc}; fix the module"
        ) from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise LookupError(f"module {module_name!r} has no attribute {attr!r} ({ref!r})")
    if not is_declared(obj, role):
        raise LookupError(f"{ref!r} is not {NOUN[role]}; {HOW[role]}")
    return obj


__all__ = [
    "Role",
    "allowed_modules",
    "current_allowed",
    "declare",
    "is_declared",
    "module_allowed",
    "parse_ref",
    "pipeline_builder",
    "resolve",
]
