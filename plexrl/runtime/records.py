"""The runner's small records: what it needs of a job's spec (`RunnableSpec`), the services' byte budgets
(`Budgets`), and its bookkeeping of work in flight (`Pending`) and of each job's current iteration
(`Iteration`). A failed cpu node's retry is the planner's (`JobPlan.retry`, the `backoff` node state)."""

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
    """Byte budgets per tier of every service (None = unlimited), and whether their moves run on a copy engine
    beside compute (`ServiceJoined.copy_engine`: services on GPUs)."""

    device: int | None = None
    host: int | None = None
    disk: int | None = None
    copy_engine: bool = False

    def joined(self, service_id: str) -> ServiceJoined:
        return ServiceJoined(service_id, self.device, self.host, self.disk, self.copy_engine)


@dataclass(slots=True)
class Pending:
    kind: str  # "node" | "load" | "checkpoint"
    job_id: str
    lane: str
    iteration: int = 0
    node: str = ""
    task: NodeTask | None = None  # a node's task
    attempt: int = 1  # which run of the node this is


@dataclass(slots=True)
class Iteration:
    """A job's current iteration as the runner sees it: output handles, metrics and seconds per node, and the
    handles of the chunks a chunked node has finished so far (`parts`; its last chunk's handle is its output)."""

    start: float
    outputs: dict[str, Handle] = field(default_factory=dict)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    parts: dict[str, list[Handle]] = field(default_factory=dict)

    def handles(self) -> list[Handle]:
        """Every handle of the iteration the executor still holds output for (to forget them)."""
        return [*self.outputs.values(), *(h for hs in self.parts.values() for h in hs)]

    def row(self, end: float | None) -> dict[str, float]:
        """The iteration's metrics row: `<node>/<metric>`, `time/<node>`, `<node>/tokens_per_s`, and
        `time/iteration` (from `start` to `end`; it includes the previous iteration's hooks) unless `end` is
        None (the baseline pass)."""
        metrics: dict[str, float] = {}
        for name, values in self.metrics.items():
            for key, value in values.items():
                metrics[f"{name}/{key}"] = value
        for name, sec in self.seconds.items():
            metrics[f"time/{name}"] = sec
            if f"{name}/tokens" in metrics and sec > 0:
                metrics[f"{name}/tokens_per_s"] = metrics[f"{name}/tokens"] / sec
        if end is not None:
            metrics["time/iteration"] = end - self.start
        return metrics
