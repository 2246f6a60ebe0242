"""The records that cross layers: what a service or an executor reports of one unit of work. Services (the
bottom layer) make them, executors carry them, the runner reads them; so they live below all three, in a
module that imports nothing of plexrl. Small by construction: an output itself never travels in one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Handle = int
"""Names one submitted unit of work (a job load or a node) and, for a node, its output."""


@dataclass(slots=True)
class MoveRecord:
    """One state move on a service, as it happened: which job's state went from tier `src` to `dst` (`nbytes`,
    the state's bytes) in how many copy calls, with how many buffers made vs reused (host pool, CPU device
    cache; on CUDA a device buffer from the caching allocator counts as made), how many minor page faults its
    thread took (`getrusage(RUSAGE_THREAD)` around the move: exact for the copies when torch runs them on the
    calling thread, as a service's one intra-op thread does; -1 where the platform has no per-thread count),
    and where its seconds went: `queued` behind other moves (the background thread's earlier moves; for a node's
    own move, its wait for them), `copy` (the copy calls and, on CUDA, the wait for them to finish) and `wait`
    (for the compute stream's last event of the job; on CPU the lock and bookkeeping around the copy). `lane`:
    the thread (and CUDA stream) it ran on; `background`: prefetch or early swap; `why`: empty when each way was
    one copy into one buffer, else why not (a state whose tensors are not one buffer, a tier in between).
    `start`: on the service's clock. `cpu`: the seconds its thread ran on a core during the move
    (`time.thread_time`; below `copy + wait` when the thread waited for a core: other work on the same cores).
    Plain data: it travels inside a `NodeReport` and into the timeline."""

    job: str
    src: str
    dst: str
    nbytes: int
    copies: int
    made: int
    reused: int
    faults: int
    queued: float
    copy: float
    wait: float
    lane: str
    background: bool
    why: str = ""
    start: float = 0.0
    cpu: float = -1.0  # -1: not measured (a record from before the field)

    @property
    def seconds(self) -> float:
        """Seconds from the move's start to its end (its queueing not included)."""
        return self.copy + self.wait


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
    # the service's state moves that ended since its previous report (any job's: background moves included)
    moves: list[MoveRecord] = field(default_factory=list)

    def __post_init__(self) -> None:  # a report that crossed a process as plain data (`dataclasses.asdict`)
        self.moves = [MoveRecord(**m) if isinstance(m, dict) else m for m in self.moves]

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


__all__ = ["CheckpointReport", "Handle", "LoadReport", "MoveRecord", "NodeReport"]
