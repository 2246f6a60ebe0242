"""User-facing errors.

A `ConfigError` carries every problem found in a config or pipeline at once, each naming where it is and
what to do about it. The CLI prints them without a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


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
