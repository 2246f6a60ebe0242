"""The planner's invariants, checked after every event in tests and with `validate=True` (see `core`): a
service runs at most one node (plus one sent ahead; or one cohort of co-scheduled rollouts, checked in
`batches.py`), of a job placed on it, whose state is on device; what a service queues belongs to its jobs;
every tier within budget; states recorded = jobs placed; a job's count of nodes left matches its node states;
its nodes in backoff are cpu nodes with a backoff end. Pure: reads the planner's records, changes nothing."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from plexrl.planner.records import JobRecord, ServiceRecord


def any_violation(jobs: Mapping[str, JobRecord], services: Mapping[str, ServiceRecord]) -> str | None:
    """The first broken invariant of all: the core's (`first_violation`), then those of slices, co-scheduled
    cohorts and checkpoints (each in its own module)."""
    from plexrl.planner import batches, checkpoints, slices

    return (first_violation(jobs, services) or slices.violation(jobs, services)
            or batches.violation(jobs, services) or checkpoints.violation(jobs, services))  # fmt: skip


def history(log: Iterable[Any], message: str, last: int = 10) -> str:
    """`message` with the planner's last `last` transitions (event -> instructions), oldest first."""
    lines = [message, "recent history (oldest first):"]
    for t in list(log)[-last:]:
        lines.append(f"  t={t.time:.3f} {t.event!r} -> {t.instructions!r}")
    return "\n".join(lines)


def first_violation(jobs: Mapping[str, JobRecord], services: Mapping[str, ServiceRecord]) -> str | None:
    """The first broken invariant, described; None when all hold."""
    for svc in services.values():
        try:
            svc.state.validate()
        except AssertionError as exc:
            return str(exc)
        if set(svc.state.where) != svc.jobs:
            return f"{svc.service_id}: states {set(svc.state.where)} != jobs"
        if svc.next is not None and (svc.running is None or svc.running[0] == svc.next[0]):
            return f"{svc.service_id}: next {svc.next} with running {svc.running}"
        for key in (svc.running, svc.next):
            if key is None:
                continue
            job_id, it, node = key
            job = jobs[job_id]
            if job.service != svc.service_id or job.status != "running":
                return f"{svc.service_id} runs {job_id}, not placed there"
            if not svc.state.on_device(job_id):
                return f"{svc.service_id} runs {job_id} whose state is off device"
            if job.iteration != it or job.nodes.get(node) != "running":
                return f"{svc.service_id} runs {job_id}/{node} not marked running"
        for q in svc.queue:
            if jobs[q.job_id].service != svc.service_id:
                return f"{q.job_id} queued on foreign service {svc.service_id}"
    for job in jobs.values():
        if job.status == "running":
            if job.remaining != sum(s != "done" for s in job.nodes.values()):
                return f"{job.job_id}: {job.remaining} nodes counted as left"
            if job.service is None or job.job_id not in services[job.service].jobs:
                return f"{job.job_id} placed but not on its service"
            waiting = {n for n, s in job.nodes.items() if s == "backoff"}
            if waiting != set(job.backoff) or any(job.plan.nodes[n].runs_on != "cpu" for n in waiting):
                return f"{job.job_id}: nodes in backoff {sorted(waiting)} != backoff times {sorted(job.backoff)}"
            running = [n for n, s in job.nodes.items() if s == "running" and job.plan.nodes[n].runs_on == "service"]
            if len(running) > 1:
                return f"{job.job_id} runs {running} at once on one service"
        elif job.status == "queued" and job.service is not None:
            return f"{job.job_id} queued yet has a service"
    return None
