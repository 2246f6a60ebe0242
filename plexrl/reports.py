"""The records that cross layers: what a service or an executor reports of one unit of work. Services (the
bottom layer) make them, executors carry them, the runner reads them; so they live below all three, in a
module that imports nothing of plexrl. Small by construction: an output itself never travels in one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Handle = int
"""Names one submitted unit of work (a job load or a node) and, for a node, its output."""


@dataclass(slots=True)
class NodeReport:
    """What the runner learns of one node: timings (seconds on the service's clock), swap figures, weight
    loads and the output's metrics. Small by construction; the output itself stays where it was made."""

    job_id: str
    iteration: int
    node: str
    error: str | None
    start: float
    end: float
    swap_start: float = 0.0
    swap_end: float = 0.0
    swap_bytes: int = 0
    # weight loads into a vLLM engine during the node: (kind "sync" | "swap", start, end, bytes)
    weight_loads: list[tuple[str, float, float, int]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # output.metrics(), per-iteration scalars
    measured: dict[str, int] = field(default_factory=dict)  # state bytes of jobs moved off device before it
    # a slice of a sliced node that ended before the node (decode-step preemption): no output and no metrics;
    # its generation waits, paused, on the service for the node's next slice
    paused: bool = False
    # a session's call (`plexrl.sessions`): its reply as plain data (`Reply` fields), the only part of a session
    # node's output that leaves the service
    reply: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class LoadReport:
    """A job's engine and state were created on a service (or that failed: `error`)."""

    job_id: str
    service_id: str
    nbytes: int
    start: float
    end: float
    error: str | None = None


@dataclass(slots=True)
class CheckpointReport:
    """A job's state was saved to `path` (or that failed: `error`; an earlier checkpoint stays intact)."""

    job_id: str
    service_id: str
    path: str
    start: float
    end: float
    error: str | None = None


__all__ = ["CheckpointReport", "Handle", "LoadReport", "NodeReport"]
