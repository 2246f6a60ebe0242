"""User-facing errors.

A `ConfigError` carries every problem found in a config or pipeline at once, each naming where it is and
what to do about it. The CLI prints them without a traceback.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with user input: `where` names the field or node, `message` says what and how to fix."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


class PlexRLError(Exception):
    """Base class of errors that are the user's to fix (printed without traceback by the CLI)."""


class ConfigError(PlexRLError):
    """All problems of one config or pipeline, reported together."""

    def __init__(self, problems: list[Problem], source: str = "") -> None:
        self.problems = list(problems)
        self.source = source
        head = f"{len(self.problems)} problem(s) in {source or 'the configuration'}:"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))


class OperatorError(PlexRLError):
    """An operator raised while running one node of one job; fails (or retries) that job only."""

    def __init__(self, job_id: str, iteration: int, node: str, cause: BaseException) -> None:
        self.job_id, self.iteration, self.node, self.cause = job_id, iteration, node, cause
        super().__init__(
            f"job {job_id!r}, iteration {iteration}, node {node!r} failed: {type(cause).__name__}: {cause}"
        )


def pydantic_problem(err: Any, prefix: str, model: type[BaseModel] | None) -> Problem:
    """A pydantic error as a Problem: its dotted location under `prefix`, and for an unknown key the known
    keys of that place in `model` (with the closest one)."""
    loc = [str(x) for x in err["loc"]]
    where = ".".join(([prefix] if prefix else []) + loc)
    if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        known = _known_keys(model, loc[:-1]) if model else []
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        msg = f"unknown key; {hint}known keys here: {', '.join(known)}" if known else "unknown key; remove it"
    elif err["type"] == "missing":
        msg = "required; add this field"
    elif err["type"] == "value_error":  # a validator's own sentence: it names the problem and the fix
        msg = str(err["msg"]).removeprefix("Value error, ")
    else:
        msg = f"{err['msg']} (got {err.get('input')!r})"
    return Problem(where, msg)


def _known_keys(model: type[BaseModel], loc: list[str]) -> list[str]:
    current: Any = model
    for part in loc:
        current = _unwrap(current)
        if part.isdigit():
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return []
        current = current.model_fields[part].annotation
    current = _unwrap(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _unwrap(annotation: Any) -> Any:
    """`list[X] | None` -> X: the model type a nested location refers to."""
    while True:
        args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
        if not args or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return annotation
        annotation = args[0]
