"""`ClusterView`: what `plexrl serve` shows of its cluster (the page at `/`, `GET /cluster`, `/metrics`), kept by
a hook on the server's one runner.

Threads: the hook's callbacks run on the runner's thread; they update the view's tables under `_lock`, and
copy there, on the runner's thread, the little they need of the planner (each service's waiting nodes, the
jobs waiting for room on a service). `snapshot()` runs on HTTP threads: it copies the tables under the same
lock and computes from the copy. Nothing here reads the runner's or the planner's tables from another thread.

The numbers follow `plexrl.accounting` (docs/architecture.md, "Accounting"), counted from the view's start:
- per service: `busy` (node spans), `swap` (blocking state moves), `startup` (a job's engine and first state
  built on it), `idle` (the rest of the wall time since the start; never negative);
- per job: accelerator-seconds so far = its own busy, swap and startup seconds plus a share of each of its
  services' idle time in proportion to how long it was placed there (as `accounting.account` does at the end
  of a run); slowdown so far = seconds since its first placement (to its end, once ended) over the seconds its
  nodes took (its solo pace, as the planner's `slowdown` ordering counts it); the latest reward
  (`*/reward_mean`) and held-out accuracy (the pipeline's evaluation node, else `*/accuracy`).

Bounds: the most recent `max_spans` spans and checkpoint marks, and the `max_jobs` most recent ended jobs
(running ones are always kept); service totals are kept whole. What it does NOT do: remember anything across
a restart (the journal and MLflow keep the history), or decide anything.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plexrl.hooks.base import Hook
from plexrl.job.spec import JobRun

BUCKETS = ("busy", "swap", "startup")
KIND_BUCKET = {"node": "busy", "swap": "swap", "load": "startup"}


@dataclass(frozen=True, slots=True)
class LiveSpan:
    """One span on a lane (a service id, or "cpu"), on the runner's clock. `kind`: node, swap, load, or
    checkpoint (a mark: `start == end`)."""

    job: str
    lane: str
    kind: str
    node: str
    start: float
    end: float


@dataclass(slots=True)
class LiveJob:
    """What the view knows of one job (its attempts in this server process)."""

    job_id: str
    user: str = ""
    service: str | None = None
    first_placed: float | None = None
    placed: float | None = None  # the current attempt's placement (None: not placed now)
    ended: float | None = None
    work: float = 0.0  # seconds its nodes took
    seconds: dict[str, float] = field(default_factory=dict)  # bucket -> its own seconds on services
    residence: dict[str, float] = field(default_factory=dict)  # service -> seconds placed there (ended attempts)
    reward: float | None = None
    accuracy: float | None = None
    steps: int = 0


@dataclass(frozen=True, slots=True)
class ServiceView:
    service: str
    busy: float
    swap: float
    startup: float
    idle: float
    jobs: tuple[str, ...]  # placed there now
    waiting: tuple[tuple[str, str], ...]  # (job, node): ready service nodes waiting for it, in the planner's queue


@dataclass(frozen=True, slots=True)
class JobView:
    job_id: str
    user: str
    service: str | None
    steps: int
    reward: float | None
    accuracy: float | None
    slowdown: float | None
    accelerator_seconds: float
    running: bool


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A consistent copy of the view at `now` (the runner's clock); `start`: when the view began counting."""

    now: float
    start: float
    services: list[ServiceView]
    jobs: dict[str, JobView]
    spans: list[LiveSpan]
    unplaced: dict[str, str]  # jobs the planner holds, waiting for room on a service -> why, in words


class ClusterView(Hook):
    """See the module docstring. `runner`: returns the server's runner, whose clock, services and planner are
    read on the runner's thread only, in the callbacks, except `clock()` and the list of service ids, read by
    `snapshot`. It is not called at construction: the view is one of the runner's hooks, built before it."""

    def __init__(self, runner: Callable[[], Any], *, max_spans: int = 5000, max_jobs: int = 1000) -> None:
        self._runner = runner
        self.max_jobs = max_jobs
        self._lock = threading.Lock()
        self._start: float | None = None
        self._spans: deque[LiveSpan] = deque(maxlen=max_spans)
        self._services: dict[str, dict[str, float]] = {}  # service -> bucket -> seconds
        self._residence_done: dict[str, float] = {}  # service -> seconds of ended attempts placed there
        self._jobs: OrderedDict[str, LiveJob] = OrderedDict()  # ended jobs in the order they ended, last
        self._waiting: dict[str, tuple[tuple[str, str], ...]] = {}
        self._unplaced: dict[str, str] = {}

    # -- callbacks (the runner's thread) -----------------------------------------------------------------
    def on_start(self, time: float) -> None:
        with self._lock:
            if self._start is None:
                self._start = time

    def on_job_start(self, run: JobRun) -> None:
        placed = run.started_at if run.started_at is not None else self.clock()
        with self._lock:
            job = self._job(run)
            job.service, job.placed, job.ended = run.service, placed, None
            if job.first_placed is None:
                job.first_placed = placed
            self._jobs.move_to_end(job.job_id)
        self._copy_planner()

    def after_node(
        self, run: JobRun, iteration: int, node: str, lane: str, start: float, end: float, metrics: dict[str, float]
    ) -> None:
        with self._lock:
            self._add(run, LiveSpan(run.job_id, lane, "node", node, start, end))
            self._job(run).work += max(end - start, 0.0)
        self._copy_planner()

    def on_swap(self, run: JobRun, lane: str, start: float, end: float, nbytes: int) -> None:
        with self._lock:
            self._add(run, LiveSpan(run.job_id, lane, "swap", "swap", start, end))

    def on_load(self, run: JobRun, lane: str, start: float, end: float, nbytes: int) -> None:
        with self._lock:
            self._add(run, LiveSpan(run.job_id, lane, "load", "load", start, end))

    def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        reward = _first(metrics, lambda k: k.endswith("/reward_mean"))
        eval_metric = getattr(run.spec, "eval_metric", None)
        name = eval_metric() if callable(eval_metric) else None
        accuracy = metrics.get(name) if name else _first(metrics, lambda k: k.endswith("/accuracy"))
        with self._lock:
            job = self._job(run)
            job.steps = max(iteration + 1, 0)  # iterations done (real numbers: a resumed job's count on)
            job.reward = reward if reward is not None else job.reward
            job.accuracy = accuracy if accuracy is not None else job.accuracy

    def on_checkpoint(self, run: JobRun, iteration: int, path: Path, error: str | None) -> None:
        if error is not None or run.service is None:
            return
        now = self.clock()
        with self._lock:
            self._spans.append(LiveSpan(run.job_id, run.service, "checkpoint", "checkpoint", now, now))

    def on_job_end(self, run: JobRun) -> None:
        end = run.finished_at if run.finished_at is not None else self.clock()
        with self._lock:
            job = self._job(run)
            if job.placed is not None and job.service is not None:
                stay = max(end - job.placed, 0.0)
                job.residence[job.service] = job.residence.get(job.service, 0.0) + stay
                self._residence_done[job.service] = self._residence_done.get(job.service, 0.0) + stay
            job.placed, job.ended = None, end
            self._jobs.move_to_end(job.job_id)
            ended = [j for j, v in self._jobs.items() if v.placed is None]
            for job_id in ended[: max(len(ended) - self.max_jobs, 0)]:
                del self._jobs[job_id]
        self._copy_planner()

    def _job(self, run: JobRun) -> LiveJob:
        """The job's entry (lock held), made at first sight."""
        job = self._jobs.get(run.job_id)
        if job is None:
            job = self._jobs[run.job_id] = LiveJob(run.job_id, str(getattr(run.spec, "user", "") or ""))
            if run.started_at is not None and run.status == "running":  # first seen after its placement
                job.service, job.placed, job.first_placed = run.service, run.started_at, run.started_at
        return job

    def _add(self, run: JobRun, span: LiveSpan) -> None:
        """A span on its lane (lock held); time on a service goes to the service's and the job's bucket."""
        self._spans.append(span)
        if span.lane == "cpu":
            return
        bucket, seconds = KIND_BUCKET[span.kind], max(span.end - span.start, 0.0)
        totals = self._services.setdefault(span.lane, dict.fromkeys(BUCKETS, 0.0))
        totals[bucket] += seconds
        mine = self._job(run).seconds
        mine[bucket] = mine.get(bucket, 0.0) + seconds

    def clock(self) -> float:
        """The runner's clock."""
        return float(self._runner().clock())

    def _copy_planner(self) -> None:
        """Copy each service's waiting nodes and the jobs waiting for room, through the planner's read API
        (`Planner.view`, on the runner's thread)."""
        planner = getattr(self._runner(), "planner", None)
        if planner is None:
            return
        view = planner.view()
        waiting, unplaced = view.waiting(), view.unplaced()
        with self._lock:
            self._waiting, self._unplaced = waiting, unplaced

    # -- reads (any thread) ------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """A consistent copy, with the accounting so far computed from it (see the module docstring)."""
        service_ids = list(getattr(self._runner(), "services", []))  # (a list the runner appends to: copied)
        with self._lock:
            now = self.clock()
            start = self._start if self._start is not None else now
            spans = list(self._spans)
            totals = {s: dict(b) for s, b in self._services.items()}
            residence_done = dict(self._residence_done)
            jobs = [dataclasses.replace(j, seconds=dict(j.seconds), residence=dict(j.residence))
                    for j in self._jobs.values()]  # fmt: skip
            waiting, unplaced = dict(self._waiting), dict(self._unplaced)
        services = sorted(set(service_ids) | set(totals) | set(waiting))
        wall = max(now - start, 0.0)
        residence_total = dict(residence_done)
        for j in jobs:
            if j.placed is not None and j.service is not None:
                residence_total[j.service] = residence_total.get(j.service, 0.0) + max(now - j.placed, 0.0)
        idle: dict[str, float] = {}
        views = []
        for sid in services:
            b = totals.get(sid, dict.fromkeys(BUCKETS, 0.0))
            idle[sid] = max(wall - sum(b.values()), 0.0)
            here = tuple(j.job_id for j in jobs if j.placed is not None and j.service == sid)
            views.append(ServiceView(sid, b["busy"], b["swap"], b["startup"], idle[sid], here, waiting.get(sid, ())))
        out: dict[str, JobView] = {}
        for j in jobs:
            stays = dict(j.residence)
            if j.placed is not None and j.service is not None:
                stays[j.service] = stays.get(j.service, 0.0) + max(now - j.placed, 0.0)
            share = sum(idle.get(s, 0.0) * t / residence_total[s] for s, t in stays.items() if residence_total.get(s))
            allocated = sum(j.seconds.values()) + share
            slowdown = None
            if j.first_placed is not None and j.work > 0:
                slowdown = max((j.ended if j.ended is not None else now) - j.first_placed, 0.0) / j.work
            running = j.placed is not None
            out[j.job_id] = JobView(
                j.job_id, j.user, j.service, j.steps, j.reward, j.accuracy, slowdown, allocated, running
            )
        return Snapshot(now, start, views, out, spans, unplaced)


def _first(metrics: dict[str, float], match: Callable[[str], bool]) -> float | None:
    keys = sorted(k for k in metrics if match(k))
    return float(metrics[keys[0]]) if keys else None


__all__ = ["ClusterView", "JobView", "LiveSpan", "ServiceView", "Snapshot"]
