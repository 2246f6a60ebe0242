"""What every driver does the same way: keep each job's node outputs for the current iteration, turn node
results into planner events and hook calls, collect an iteration's metrics, close jobs, and skip the work
of a job that is being failed. A concrete driver (`LocalDriver`, `DaskDriver`) only decides *where and
when* a node runs and how its result comes back.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from plexrl.batch import Batch
from plexrl.hooks.base import Hook, HookList
from plexrl.job import JobHandle
from plexrl.planner import JobCancelled, JobFailed, NodeFinished, Planner, ServiceJoined
from plexrl.planner.costs import CostModel
from plexrl.planner.policies import OrderingPolicy, PlacementPolicy
from plexrl.services.service import NodeResult

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Budgets:
    """Byte budgets per tier of every service (None = unlimited)."""

    device: int | None = None
    host: int | None = None
    disk: int | None = None

    def joined(self, service_id: str) -> ServiceJoined:
        return ServiceJoined(service_id, self.device, self.host, self.disk)


class DriverBase:
    def __init__(
        self,
        *,
        hooks: list[Hook] | None,
        placement: PlacementPolicy | None,
        ordering: OrderingPolicy | None,
        clock: Callable[[], float],
        validate: bool,
        budgets: Budgets | None = None,
        costs: CostModel | None = None,
        lookahead: bool = False,
    ) -> None:
        self.clock = clock
        self.hooks = HookList(hooks)
        self.budgets = budgets or Budgets()
        self.planner = Planner(
            clock=clock, placement=placement, ordering=ordering, validate=validate, costs=costs, lookahead=lookahead
        )
        self.jobs: dict[str, JobHandle] = {}
        self.outputs: dict[str, dict[str, Batch]] = {}
        self.seconds: dict[str, dict[str, float]] = {}
        self.iter_start: dict[str, float] = {}
        self.failing: set[str] = set()  # reported to the planner, FailJob not yet received
        self.placed: dict[str, str] = {}  # job -> service
        self._cancels: deque[JobCancelled] = deque()
        self._cancel_lock = threading.Lock()

    def cancel(self, job_id: str, reason: str = "cancelled by user") -> None:
        """Cancel one job (thread-safe, callable from a hook; takes effect at the next event). Its finished
        iterations stay recorded; the other jobs go on."""
        with self._cancel_lock:
            self._cancels.append(JobCancelled(job_id, reason))

    def _take_cancels(self) -> list[JobCancelled]:
        with self._cancel_lock:
            out = list(self._cancels)
            self._cancels.clear()
        return out

    def _register(self, jobs: list[JobHandle]) -> None:
        for job in jobs:
            if job.job_id in self.jobs:
                raise ValueError(f"two jobs are named {job.job_id!r}; give each job a unique name")
            self.jobs[job.job_id] = job

    def _fail(self, job: JobHandle, what: str, exc: BaseException | str) -> JobFailed:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        log.error("job %s: %s failed: %s", job.job_id, what, text)
        self.failing.add(job.job_id)
        return JobFailed(job.job_id, f"{what}: {text}")

    def _start_job(self, job: JobHandle, service_id: str) -> None:
        job.started_at = self.clock()
        self.outputs[job.job_id], self.seconds[job.job_id] = {}, {}
        job.status = "running"
        self.placed[job.job_id] = service_id
        self.hooks.on_job_start(job)
        self.iter_start[job.job_id] = self.clock()

    def _inputs(self, job: JobHandle, node_name: str) -> dict[str, Batch]:
        node = job.graph.node(node_name)
        outputs = self.outputs[job.job_id]
        return {port: outputs[src] for port, src in node.inputs.items() if src in outputs}

    def _node_started(self, job: JobHandle, iteration: int, node: str, lane: str, start: float) -> None:
        self.hooks.before_node(job, iteration, node, lane, start)

    def _node_done(self, job: JobHandle, res: NodeResult, lane: str) -> NodeFinished:
        """Record a node's result (outputs, hook calls incl. the swap span) and make the planner's event."""
        if res.swap_end > res.swap_start:
            self.hooks.on_swap(job, lane, res.swap_start, res.swap_end, res.swap_bytes)
        for kind, start, end, nbytes in res.weight_loads:
            self.hooks.on_weight_load(job, lane, kind, start, end, nbytes)
            if job.job_id in self.seconds:
                seconds = self.seconds[job.job_id]
                seconds[f"weight_{kind}"] = seconds.get(f"weight_{kind}", 0.0) + (end - start)
        self.hooks.after_node(job, res.iteration, res.node, lane, res.start, res.end, res.output)
        duration = res.end - res.start
        swap_sec = res.swap_end - res.swap_start
        if res.error is not None:
            return NodeFinished(job.job_id, res.iteration, res.node, ok=False, error=res.error, duration=duration)
        if job.job_id in self.outputs and res.output is not None:
            self.outputs[job.job_id][res.node] = res.output
            self.seconds[job.job_id][res.node] = duration
        return NodeFinished(job.job_id, res.iteration, res.node, True, None, duration, res.swap_bytes, swap_sec)

    def _end_iteration(self, job: JobHandle, iteration: int) -> JobFailed | None:
        """Collect the iteration's metrics (iteration -1 is the baseline pass, logged as step 0)."""
        now = self.clock()
        metrics: dict[str, float] = {}
        try:
            for name, out in self.outputs[job.job_id].items():
                for key, value in out.metrics().items():
                    metrics[f"{name}/{key}"] = float(value)
        except Exception as exc:
            return self._fail(job, f"metrics of iteration {iteration}", exc)
        for name, sec in self.seconds[job.job_id].items():
            metrics[f"time/{name}"] = sec
            if f"{name}/tokens" in metrics and sec > 0:
                metrics[f"{name}/tokens_per_s"] = metrics[f"{name}/tokens"] / sec
        if iteration >= 0:
            metrics["time/iteration"] = now - self.iter_start[job.job_id]  # includes the previous hooks
            job.iterations_done += 1
        self.iter_start[job.job_id] = now
        job.history.append(metrics)
        self.hooks.on_iteration_end(job, iteration, metrics)
        self.outputs[job.job_id], self.seconds[job.job_id] = {}, {}
        return None

    def _close(self, job: JobHandle, status: str, reason: str) -> None:
        job.status, job.error, job.finished_at = status, reason, self.clock()
        if status == "failed":
            log.error("job %s failed: %s", job.job_id, reason)
        if job.started_at is not None:
            self.hooks.on_job_end(job)
        self.outputs.pop(job.job_id, None)

    def _close_open_jobs(self, exc: BaseException) -> None:
        for job in self.jobs.values():
            if job.status == "running":
                cancelled = isinstance(exc, KeyboardInterrupt)
                status = "cancelled" if cancelled else "failed"
                self._close(job, status, f"interrupted: {type(exc).__name__}: {exc}".rstrip(": "))
