"""`LocalDriver`: carries out the planner's instructions in-process, one at a time.

The loop: pop an event, hand it to the planner, carry out each instruction (load a placed job on its
service, run a node, close an iteration or a job), and queue the events the work produced. Nodes run
synchronously, so the clock is real and results are deterministic. Anything that goes wrong with one job
(an operator raising, its engine failing to load, its metrics failing to compute) fails that job only
(DESIGN.md invariant 5): the driver reports it to the planner and the other jobs go on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from plexrl.batch import Batch
from plexrl.hooks.base import Hook, HookList
from plexrl.job import JobHandle
from plexrl.operator import OpContext
from plexrl.planner import (
    FailJob,
    IterationDone,
    JobDone,
    JobFailed,
    JobSubmitted,
    NodeFinished,
    PlaceJob,
    Planner,
    RunNode,
    ServiceJoined,
)
from plexrl.planner.events import Event, Instruction
from plexrl.planner.policies import OrderingPolicy, PlacementPolicy
from plexrl.services.service import Service

log = logging.getLogger(__name__)


class LocalDriver:
    def __init__(
        self,
        *,
        services: int = 1,
        hooks: list[Hook] | None = None,
        placement: PlacementPolicy | None = None,
        ordering: OrderingPolicy | None = None,
        clock: Callable[[], float] = time.perf_counter,
        device: str = "cpu",
        validate: bool = True,
    ) -> None:
        self.clock = clock
        self.hooks = HookList(hooks)
        self.planner = Planner(clock=clock, placement=placement, ordering=ordering, validate=validate)
        self.services = {f"service-{i}": Service(f"service-{i}", device) for i in range(services)}
        self.jobs: dict[str, JobHandle] = {}
        self.outputs: dict[str, dict[str, Batch]] = {}
        self.seconds: dict[str, dict[str, float]] = {}
        self.iter_start: dict[str, float] = {}
        self.failing: set[str] = set()  # reported to the planner, FailJob not yet received

    def run(self, jobs: list[JobHandle]) -> list[JobHandle]:
        """Run `jobs` to completion (or failure); returns them with status, history and artifacts."""
        events: deque[Event] = deque(ServiceJoined(s) for s in self.services)
        for job in jobs:
            if job.job_id in self.jobs:
                raise ValueError(f"two jobs are named {job.job_id!r}; give each job a unique name")
            self.jobs[job.job_id] = job
            events.append(JobSubmitted(job.job_id, job.plan()))
        try:
            while events:
                for ins in self.planner.handle(events.popleft()):
                    ev = self._carry_out(ins)
                    if ev is not None:
                        events.append(ev)
        except BaseException as exc:  # interrupted (Ctrl-C) or a driver bug: close what is open, keep records
            for job in jobs:
                if job.status == "running":
                    self._close(job, "failed", f"interrupted: {type(exc).__name__}: {exc}", None)
            raise
        finally:
            self.hooks.close()
        return jobs

    def _carry_out(self, ins: Instruction) -> Event | None:
        if ins.job_id in self.failing and not isinstance(ins, FailJob):
            return None  # the job is being failed; do no more of its work
        if isinstance(ins, RunNode):
            return self._run_node(ins)
        job = self.jobs[ins.job_id]
        if isinstance(ins, PlaceJob):
            return self._place(job, ins.service_id)
        if isinstance(ins, IterationDone):
            return self._end_iteration(job, ins.iteration)
        if isinstance(ins, JobDone):
            self._end_job(job, "done", "", ins.service_id)
        elif isinstance(ins, FailJob):
            self.failing.discard(job.job_id)
            self._end_job(job, "failed", ins.reason, ins.service_id)
        return None

    def _fail(self, job: JobHandle, what: str, exc: BaseException) -> JobFailed:
        log.error("job %s: %s failed: %s", job.job_id, what, exc, exc_info=log.isEnabledFor(logging.INFO))
        self.failing.add(job.job_id)
        return JobFailed(job.job_id, f"{what}: {type(exc).__name__}: {exc}")

    def _place(self, job: JobHandle, service_id: str) -> Event | None:
        job.started_at = self.clock()
        self.outputs[job.job_id], self.seconds[job.job_id] = {}, {}
        job.status = "running"
        self.hooks.on_job_start(job)
        self.iter_start[job.job_id] = self.clock()
        try:
            self.services[service_id].load_job(job)
        except Exception as exc:
            return self._fail(job, f"loading the job on {service_id}", exc)
        return None

    def _run_node(self, ins: RunNode) -> NodeFinished:
        job = self.jobs[ins.job_id]
        node = job.graph.node(ins.node)
        outputs = self.outputs[job.job_id]
        inputs = {port: outputs[src] for port, src in node.inputs.items() if src in outputs}
        lane = ins.service_id or "cpu"
        start = self.clock()
        self.hooks.before_node(job, ins.iteration, ins.node, lane, start)
        try:
            if ins.service_id is not None:
                out = self.services[ins.service_id].run(job, ins.iteration, node, inputs)
            else:
                ctx = OpContext(job.job_id, ins.iteration, node.name, job.config.seed, job.task, job.tokenizer)
                out = node.operator.run(ctx, inputs, node.params)
        except Exception as exc:  # fails this job only
            end = self.clock()
            log.error(
                "job %s node %s (iteration %d) failed: %s", job.job_id, ins.node, ins.iteration, exc,
                exc_info=log.isEnabledFor(logging.INFO),
            )  # fmt: skip
            self.hooks.after_node(job, ins.iteration, ins.node, lane, start, end, None)
            error = f"{type(exc).__name__}: {exc}"
            return NodeFinished(job.job_id, ins.iteration, ins.node, ok=False, error=error, duration=end - start)
        end = self.clock()
        outputs[ins.node] = out
        self.seconds[job.job_id][ins.node] = end - start
        self.hooks.after_node(job, ins.iteration, ins.node, lane, start, end, out)
        return NodeFinished(job.job_id, ins.iteration, ins.node, ok=True, duration=end - start)

    def _end_iteration(self, job: JobHandle, iteration: int) -> Event | None:
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

    def _end_job(self, job: JobHandle, status: str, reason: str, service_id: str | None) -> None:
        service = self.services.get(service_id) if service_id else None
        if status == "done" and service is not None and job.config.tracking.log_model:
            try:
                job.artifacts["model"] = service.save_model(job, job.run_dir / "jobs" / job.job_id / "model")
            except Exception:
                log.exception("could not save the final model of job %s", job.job_id)
        self._close(job, status, reason, service)

    def _close(self, job: JobHandle, status: str, reason: str, service: Service | None) -> None:
        job.status, job.error, job.finished_at = status, reason, self.clock()
        if status != "done":
            log.error("job %s failed: %s", job.job_id, reason)
        if job.started_at is not None:
            self.hooks.on_job_end(job)
        if service is not None:
            service.release(job.job_id)
        self.outputs.pop(job.job_id, None)
