"""A placed job's way through its iterations (`Progress`), a part of `core.Planner` like `dispatch.Dispatcher`:
which of its nodes become ready when their deps are done (a cpu node is sent at once, a service node joins its
service's queue), when an iteration ends (`IterationDone`; a checkpoint held when due), and when the job moves
to its next iteration or is done.

Pure: it changes the planner's records, appends instructions, and calls back the planner's state table
(`set_node`) and its end of a job (`end`); the planner owns everything it is given.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from plexrl.planner import checkpoints, sessions
from plexrl.planner.admission import Admitter
from plexrl.planner.costs import CostModel
from plexrl.planner.events import Instruction, IterationDone, RunNode
from plexrl.planner.placement import PlacementPolicy
from plexrl.planner.policies import QueuedNode
from plexrl.planner.records import JobRecord, JobStatus, NodeStatus, ServiceRecord


@dataclass(slots=True)
class Progress:
    """The planner's services, cost model, placement and admission (shared, not copied), its clock, the
    `inline_below` setting (`Planner`), the set of services an event concerned (`dirty`, offered a dispatch),
    the state table's setter and the planner's end of a job; and the queue's sequence numbers."""

    services: dict[str, ServiceRecord]
    costs: CostModel
    placement: PlacementPolicy
    admission: Admitter
    clock: Callable[[], float]
    inline_below: float | None
    dirty: set[str]
    set_node: Callable[[JobRecord, str, NodeStatus], None]
    end: Callable[[str, JobStatus, str, list[Instruction]], None]
    seq: Iterator[int] = field(default_factory=itertools.count)

    def advance(self, job: JobRecord, out: list[Instruction]) -> None:
        """Make ready every waiting node whose deps are done; close iterations whose nodes are all done
        (a loop, not recursion: many iterations in a row may have nothing to run)."""
        while True:
            # one pass is enough: a node made ready here is not done, so it cannot unblock another
            nodes, plan = job.nodes, job.plan.nodes
            baseline = job.iteration < 0
            for name in job.plan.baseline if baseline else (job.plan.order or tuple(plan)):
                if nodes.get(name) == "waiting" and (baseline or all(nodes[d] == "done" for d in plan[name].deps)):
                    self.make_ready(job, name, out)
            if job.remaining or (job.plan.open and not nodes):  # (an idle session: no call, no iteration)
                return
            out.append(IterationDone(job.job_id, job.iteration))
            if getattr(self.placement, "uses_load", True):
                self.admission.due = True  # its predicted load settled: a load-aware placement may change
            if sessions.checkpoint_due(job) if job.plan.open else checkpoints.due(job.plan, job.iteration):  # (held)
                checkpoints.hold(job, self.services[job.service])  # type: ignore[index]  # (placed)
                self.dirty.add(job.service)  # type: ignore[arg-type]
                return
            if not self.next_iteration(job, out):
                return

    def next_iteration(self, job: JobRecord, out: list[Instruction]) -> bool:
        """Move a job whose iteration ended to its next one; False if that was its last (the job is done)."""
        job.iteration = job.plan.first_iteration if job.iteration < 0 else job.iteration + 1
        if job.iteration >= job.plan.iterations or (job.closing and job.call is None):  # (a session: `sessions.py`)
            self.end(job.job_id, "done", "", out)
            return False
        job.start_iteration(self.clock())
        return True

    def make_ready(self, job: JobRecord, name: str, out: list[Instruction]) -> None:
        """A node's deps are done: a cpu node is sent at once, a service node is queued on the job's service."""
        self.set_node(job, name, "ready")
        if job.plan.nodes[name].runs_on == "cpu":
            self.set_node(job, name, "running")
            job.cpu_started[name] = self.clock()
            out.append(RunNode(job.job_id, job.iteration, name, "cpu", None, inline=self.tiny(job, name)))
        else:
            self.queue(job, name)

    def queue(self, job: JobRecord, name: str) -> None:
        """Append a node of a placed job to its service's queue."""
        q = QueuedNode(job.job_id, job.iteration, name, self.clock(), next(self.seq))
        self.services[job.service].queue.append(q)  # type: ignore[index]  # (a placed job has a service)

    def tiny(self, job: JobRecord, name: str) -> bool:
        """Whether a cpu node is predicted to take less than `inline_below` (and may run inline at all)."""
        if self.inline_below is None or not job.plan.nodes[name].inline:
            return False
        return self.costs.observed(job.job_id, name) and self.costs.predict(job.job_id, name) < self.inline_below


__all__ = ["Progress"]
