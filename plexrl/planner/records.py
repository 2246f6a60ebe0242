"""The planner's records and its state tables: job and node states, every legal move, and the per-job and
per-service records the planner keeps. Data only; `core.Planner` is the one thing that changes them.

States (each change goes through one table; an illegal move raises `InvalidTransition` with recent history):
- job:  queued -> running (placed on a service) -> done | failed | cancelled   (queued -> failed | cancelled too):
  THE job status vocabulary (`JobStatus`, `TERMINAL`), also of a job's record (`plexrl.job.spec.JobRun`) and of
  the server's journal (`plexrl.server.journal_records`);
- node (per iteration of a placed job): waiting -> ready -> running -> done; inactive nodes (`every`)
  go waiting -> done directly; a failed cpu node with runs left (`JobPlan.retry`) goes running -> backoff
  -> running: while it waits, its job counts as away for the predicted backoff left plus the node's time;
  a slice of a sliced service node that ends before the node (`NodeFinished(paused=True)`) goes running ->
  paused -> running: its next slice is queued on the service like any node, and its job, whose paused
  generation waits there, is never evicted meanwhile (`slices.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from plexrl.planner.events import JobPlan
from plexrl.planner.policies import QueuedNode
from plexrl.planner.state import StateManager

CLIENT = "<client>"  # a session's pseudo node: its client's time from a call's end to its next call (`sessions.py`)

# a job's status: ONE vocabulary for the planner, a job's record (`JobRun`) and the server's journal
JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]
NodeStatus = Literal["waiting", "ready", "running", "paused", "backoff", "done"]

JOB_TRANSITIONS: set[tuple[JobStatus, JobStatus]] = {
    ("queued", "running"),
    ("queued", "failed"),
    ("queued", "cancelled"),
    ("running", "done"),
    ("running", "failed"),
    ("running", "cancelled"),
}
NODE_TRANSITIONS: set[tuple[NodeStatus, NodeStatus]] = {
    ("waiting", "ready"),
    ("waiting", "done"),  # inactive this iteration
    ("ready", "running"),
    ("running", "done"),
    ("running", "ready"),  # a chunk of a chunked service node ended; the next one waits for the service
    ("running", "backoff"),  # a cpu node failed with runs left (`JobPlan.retry`): it waits, then runs again
    ("backoff", "running"),
    ("running", "paused"),  # a slice of a sliced service node ended, the node did not: its next slice is queued
    ("paused", "running"),
}
TERMINAL: frozenset[JobStatus] = frozenset({"done", "failed", "cancelled"})  # a job's status there never changes


class InvalidTransition(RuntimeError):
    """An illegal state move; the message carries the planner's recent history."""


@dataclass(slots=True)
class SliceProgress:
    """The slices a sliced service node has run this iteration (decode-step preemption): how many, the seconds
    they took, and the last one's seconds."""

    slices: int = 0
    seconds: float = 0.0
    last: float = 0.0


@dataclass(slots=True)
class JobRecord:
    job_id: str
    plan: JobPlan
    status: JobStatus = "queued"
    service: str | None = None
    iteration: int = 0
    nodes: dict[str, NodeStatus] = field(default_factory=dict)
    remaining: int = 0  # nodes of this iteration not done yet
    submitted_at: float = 0.0
    placed_at: float | None = None
    finished_at: float | None = None
    reason: str = ""
    cpu_started: dict[str, float] = field(default_factory=dict)
    # the plan's edges, for the gap prediction: node -> successors; nodes with no deps (an iteration's sources)
    successors: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sources: tuple[str, ...] = ()
    chunk: dict[str, int] = field(default_factory=dict)  # chunked service node -> its chunks done this iteration
    work_done: float = 0.0  # seconds its finished nodes took (the `Slowdown` ordering's solo pace)
    runs: dict[str, int] = field(default_factory=dict)  # cpu node -> its runs this iteration (retries: > 1)
    backoff: dict[str, float] = field(default_factory=dict)  # cpu node in `backoff` -> when it runs again
    # sliced service node with a paused generation (`paused`, or running a later slice) -> its slices so far
    slices: dict[str, SliceProgress] = field(default_factory=dict)
    # the iteration whose checkpoint the job waits for (queued or running on its service; `checkpoints.py`)
    checkpoint: int | None = None
    # a session (`sessions.py`): its announced call not started yet, whether it is closing, its calls that
    # changed the trained weights; its latest call's kind and the kinds seen to follow each kind (`batches.py`)
    call: str | None = None
    closing: bool = False
    commits: int = 0
    last_call: str | None = None
    follows: dict[str, set[str]] = field(default_factory=dict)

    @classmethod
    def of(cls, job_id: str, plan: JobPlan, now: float) -> JobRecord:
        """The record of a job just submitted, with its plan's edges (`successors`, `sources`)."""
        succ: dict[str, list[str]] = {name: [] for name in plan.nodes}
        for name, node in plan.nodes.items():
            for dep in node.deps:
                succ[dep].append(name)
        sources = tuple(name for name, node in plan.nodes.items() if not node.deps)
        return cls(job_id, plan, submitted_at=now, successors={n: tuple(s) for n, s in succ.items()}, sources=sources)

    def start_iteration(self, now: float = 0.0) -> None:
        """Node states for `iteration`, as they start: the baseline pass (-1) has only the baseline nodes,
        without their deps; a normal iteration has every node, `waiting`, those inactive this iteration (`every`)
        `done` from the start. A session's (`sessions.py`): its announced call's node, waiting, or none when no
        call is announced (idle: its client is away from `now` on)."""
        if self.plan.open:
            self.nodes = {} if self.call is None else {self.call: "waiting"}
            if self.call is None:
                self.cpu_started[CLIENT] = now
            self.call = None
        elif self.iteration < 0:
            self.nodes = dict.fromkeys(self.plan.baseline, "waiting")
        else:
            active = {n: p.active(self.iteration, self.plan.iterations) for n, p in self.plan.nodes.items()}
            self.nodes = {n: "waiting" if on else "done" for n, on in active.items()}
            self.runs.clear()
        self.remaining = sum(state != "done" for state in self.nodes.values())


@dataclass(slots=True)
class ServiceRecord:
    service_id: str
    running: tuple[str, int, str] | None = None
    # when `running` started, as the planner learnt it (a node sent ahead: when the one before it ended)
    running_since: float = 0.0
    queue: list[QueuedNode] = field(default_factory=list)
    jobs: set[str] = field(default_factory=set)
    alive: bool = True
    state: StateManager = field(default_factory=lambda: StateManager(""))
    resident: str | None = None  # the job that ran last here (its state is on device)
    prefetching: str | None = None
    next: tuple[str, int, str] | None = None  # lookahead: dispatched to run right after `running`
    # co-scheduled rollouts (`batches.py`): every member of the cohort running here, `running` among them
    cohort: set[tuple[str, int, str]] = field(default_factory=set)
    next_cohort: set[tuple[str, int, str]] = field(default_factory=set)  # lookahead: a cohort sent ahead, `next` in it
    # checkpoints (`checkpoints.py`): (job, iteration) waiting for the service, in order, and the one running
    checkpoints: list[tuple[str, int]] = field(default_factory=list)
    checkpointing: tuple[str, int] | None = None
