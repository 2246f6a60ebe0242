"""`LocalDriver`: carries out the planner's instructions in-process, one at a time.

The loop: pop an event, hand it to the planner, carry out each instruction (load a placed job on its
service, run a node with its swaps, close an iteration or a job), and queue the events the work produced.
Nodes run synchronously, so results are deterministic; the tests use it to check the planner, the
StateManager's moves and the services without a cluster. Anything that goes wrong with one job (an
operator raising, its engine failing to load, its metrics failing to compute, a swap failing) fails that
job only (DESIGN.md invariant 5): the driver reports it to the planner and the other jobs go on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from plexrl.drivers.base import Budgets, DriverBase
from plexrl.hooks.base import Hook
from plexrl.job import JobHandle
from plexrl.planner import FailJob, IterationDone, JobDone, JobSubmitted, PlaceJob, RunNode
from plexrl.planner.costs import CostModel
from plexrl.planner.events import Event, Instruction
from plexrl.planner.policies import OrderingPolicy, PlacementPolicy
from plexrl.services.service import Service, run_cpu_node

log = logging.getLogger(__name__)


class LocalDriver(DriverBase):
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
        budgets: Budgets | None = None,
        costs: CostModel | None = None,
    ) -> None:
        super().__init__(
            hooks=hooks, placement=placement, ordering=ordering, clock=clock, validate=validate,
            budgets=budgets, costs=costs,
        )  # fmt: skip
        self.services = {
            f"service-{i}": Service(f"service-{i}", device, validate=validate, clock=clock) for i in range(services)
        }

    def run(self, jobs: list[JobHandle]) -> list[JobHandle]:
        """Run `jobs` to completion (or failure); returns them with status, history and artifacts."""
        self._register(jobs)
        events: deque[Event] = deque(self.budgets.joined(s) for s in self.services)
        events.extend(JobSubmitted(job.job_id, job.plan()) for job in jobs)
        self.hooks.on_start(self.clock())
        try:
            while events:
                events.extendleft(reversed(self._take_cancels()))
                for ins in self.planner.handle(events.popleft()):
                    ev = self._carry_out(ins)
                    if ev is not None:
                        events.append(ev)
        except BaseException as exc:  # interrupted (Ctrl-C) or a driver bug: close what is open, keep records
            self._close_open_jobs(exc)
            raise
        finally:
            self.hooks.close()
            for service in self.services.values():
                service.close()
        return jobs

    def _carry_out(self, ins: Instruction) -> Event | None:
        if ins.job_id in self.failing and not isinstance(ins, FailJob):
            return None  # the job is being failed; do no more of its work
        job = self.jobs[ins.job_id]
        if isinstance(ins, RunNode):
            lane = ins.service_id or "cpu"
            self._node_started(job, ins.iteration, ins.node, lane, self.clock())
            inputs = self._inputs(job, ins.node)
            if ins.service_id is None:
                res = run_cpu_node(job, ins.iteration, ins.node, inputs, self.clock)
            else:
                svc = self.services[ins.service_id]
                res = svc.run_node(job.job_id, ins.iteration, ins.node, inputs, ins.swaps, ins.prefetch)
            return self._node_done(job, res, lane)
        if isinstance(ins, PlaceJob):
            self._start_job(job, ins.service_id)
            start = self.clock()
            try:
                nbytes = self.services[ins.service_id].load_job(job, ins.tier)
            except Exception as exc:
                return self._fail(job, f"loading the job on {ins.service_id}", exc)
            self.hooks.on_swap(job, ins.service_id, start, self.clock(), nbytes)
            return None
        if isinstance(ins, IterationDone):
            return self._end_iteration(job, ins.iteration)
        if isinstance(ins, JobDone):
            self._end_job(job, "done", "", ins.service_id)
        elif isinstance(ins, FailJob):
            self.failing.discard(job.job_id)
            self._end_job(job, "cancelled" if ins.cancelled else "failed", ins.reason, ins.service_id)
        return None

    def _end_job(self, job: JobHandle, status: str, reason: str, service_id: str | None) -> None:
        service = self.services.get(service_id) if service_id else None
        if status == "done" and service is not None and job.config.tracking.log_model:
            try:
                path = job.run_dir / "jobs" / job.job_id / "model"
                job.artifacts["model"] = service.save_model(job.job_id, path)
            except Exception:
                log.exception("could not save the final model of job %s", job.job_id)
        self._close(job, status, reason)
        if service is not None:
            service.release(job.job_id)
