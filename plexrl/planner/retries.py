"""Retries as the planner sees them: a failed cpu node with runs left (`JobPlan.retry`) goes running -> backoff,
waits out its delay, and runs again when a `Tick` comes after its backoff ended. `Backoffs` holds which jobs
have a node in backoff, answers when the planner next needs waking (`wake_at`), and hands back the nodes whose
backoff has ended (`due`). Pure: the planner passes the clock's time and its own state-table setter, so
every state change still goes through `core.Planner`'s one table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from plexrl.planner.events import NodeFinished, RetryNode
from plexrl.planner.records import JobRecord, NodeStatus

SetNode = Callable[[JobRecord, str, NodeStatus], None]


class Backoffs:
    """The jobs with a cpu node in `backoff` (each node's end time lives in `JobRecord.backoff`)."""

    __slots__ = ("jobs",)

    def __init__(self) -> None:
        self.jobs: set[str] = set()

    def back_off(self, job: JobRecord, ev: NodeFinished, runs: int, now: float, set_node: SetNode) -> RetryNode:
        """`ev.node` failed after `runs` runs with runs left: it waits in `backoff` until its delay has passed."""
        retry = job.plan.retry
        assert retry is not None
        delay = retry.delay(runs)
        set_node(job, ev.node, "backoff")
        job.runs[ev.node] = runs
        job.backoff[ev.node] = now + delay
        self.jobs.add(job.job_id)
        return RetryNode(job.job_id, ev.iteration, ev.node, runs, retry.attempts, delay, ev.error or "")

    def wake_at(self, records: Mapping[str, JobRecord]) -> float | None:
        """The earliest end of a backoff; None: no node waits."""
        ends = [t for j in self.jobs for t in records[j].backoff.values()]
        return min(ends) if ends else None

    def due(
        self, records: Mapping[str, JobRecord], now: float, set_node: SetNode
    ) -> Iterator[tuple[JobRecord, str, int]]:
        """The nodes whose backoff has ended, in job and node order, each made `running` again: (job, node, its
        run number)."""
        for job_id in sorted(self.jobs):
            job = records[job_id]
            for node in [n for n, t in sorted(job.backoff.items()) if t <= now]:
                del job.backoff[node]
                set_node(job, node, "running")
                job.cpu_started[node] = now
                job.runs[node] = runs = job.runs.get(node, 1) + 1
                yield job, node, runs
            if not job.backoff:
                self.jobs.discard(job_id)

    def discard(self, job_id: str) -> None:
        self.jobs.discard(job_id)


__all__ = ["Backoffs"]
