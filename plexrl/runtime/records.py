"""The runner's small records: what it needs of a job's spec (`RunnableSpec`), the services' byte budgets
(`Budgets`), and its bookkeeping of work in flight (`Pending`) and of each job's current iteration
(`Iteration`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from plexrl.planner import JobPlan, ServiceJoined
from plexrl.runtime.executor import Handle, NodeTask


class RunnableSpec(Protocol):
    """What the runner needs of a job's spec (`JobSpec` for real jobs; the simulator has its own)."""

    @property
    def job_id(self) -> str: ...

    def plan(self) -> JobPlan: ...

    def inputs(self, node: str) -> Mapping[str, str]:
        """Input port -> the node whose output feeds it."""
        ...

    @property
    def model_dir(self) -> Path | None:
        """Where to save the final model once done (None: do not)."""
        ...


@dataclass(frozen=True, slots=True)
class Budgets:
    """Byte budgets per tier of every service (None = unlimited)."""

    device: int | None = None
    host: int | None = None
    disk: int | None = None

    def joined(self, service_id: str) -> ServiceJoined:
        return ServiceJoined(service_id, self.device, self.host, self.disk)


@dataclass(slots=True)
class Pending:
    kind: str  # "node" | "load" | "checkpoint"
    job_id: str
    lane: str
    iteration: int = 0
    node: str = ""
    task: NodeTask | None = None  # a node's task (run again on a retry)
    attempt: int = 1  # which run of the node this is


@dataclass(slots=True)
class Iteration:
    """A job's current iteration as the runner sees it: output handles, metrics and seconds per node."""

    start: float
    outputs: dict[str, Handle] = field(default_factory=dict)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
