"""Checkpoints as planner work (`JobPlan.checkpoint_every = k`): a job is checkpointed on its service after
every k-th iteration but its last (nothing would resume from that one).

When such an iteration ends, the planner holds the job (its next iteration starts only when the checkpoint's
`CheckpointFinished` comes back) and queues the checkpoint on the job's service (`ServiceRecord.checkpoints`).
The service runs it as soon as it is free, before any queued node (a job waits on it, and it is short next to
the nodes it would wait behind), and while it runs (`ServiceRecord.checkpointing`) nothing else is sent there,
lookahead included: every executor then sees the service busy, so ordering, prefetch and the cost of the
others' waiting all count it. While a checkpoint waits, lookahead sends nothing ahead either: it goes next.
A failed checkpoint does not fail the job (the driver logs it; the server's journal keeps the previous one).
Pure."""

from __future__ import annotations

from collections.abc import Mapping

from plexrl.planner.events import JobPlan, RunCheckpoint
from plexrl.planner.records import JobRecord, ServiceRecord


def due(plan: JobPlan, iteration: int) -> bool:
    """Whether the job is checkpointed after `iteration` (never after the baseline pass, -1, or its last)."""
    k = plan.checkpoint_every
    return k > 0 and iteration >= 0 and (iteration + 1) % k == 0 and iteration + 1 < plan.iterations


def hold(job: JobRecord, svc: ServiceRecord) -> None:
    """The job's iteration ended and a checkpoint is due: queue it on the job's service, hold the job."""
    job.checkpoint = job.iteration
    svc.checkpoints.append((job.job_id, job.iteration))


def start(svc: ServiceRecord) -> RunCheckpoint | None:
    """The first waiting checkpoint, started, if the service is free (nothing running or sent ahead)."""
    if not svc.checkpoints or svc.checkpointing is not None or svc.running is not None:
        return None
    job_id, iteration = svc.checkpointing = svc.checkpoints.pop(0)
    return RunCheckpoint(job_id, iteration, svc.service_id)


def finish(svc: ServiceRecord, job: JobRecord, iteration: int) -> str | None:
    """The running checkpoint ended: free the service and release the job; a problem, described, if that
    checkpoint was not running."""
    if svc.checkpointing != (job.job_id, iteration) or job.checkpoint != iteration:
        return f"checkpoint of {job.job_id} after iteration {iteration} finished but was not running"
    svc.checkpointing = None
    job.checkpoint = None
    return None


def leave(svc: ServiceRecord, job_id: str) -> None:
    """An ended job's checkpoints: dropped from the queue; a running one frees the service (its report is
    abandoned, like an ended job's running node)."""
    svc.checkpoints = [c for c in svc.checkpoints if c[0] != job_id]
    if svc.checkpointing is not None and svc.checkpointing[0] == job_id:
        svc.checkpointing = None


def violation(jobs: Mapping[str, JobRecord], services: Mapping[str, ServiceRecord]) -> str | None:
    """The first broken invariant of checkpoints, described; None when all hold: a running checkpoint has the
    service to itself; every checkpoint, waiting or running, is of a job placed there, held at that iteration
    with all its nodes done, and a held job's checkpoint is on its service exactly once."""
    held = {j.job_id: j.checkpoint for j in jobs.values() if j.status == "running" and j.checkpoint is not None}
    seen: dict[str, int] = {}
    for svc in services.values():
        if not svc.alive:
            continue
        if svc.checkpointing is not None and (svc.running is not None or svc.next is not None):
            return f"{svc.service_id} checkpoints {svc.checkpointing} while it runs {svc.running} / {svc.next}"
        for job_id, iteration in [*svc.checkpoints, *([svc.checkpointing] if svc.checkpointing else [])]:
            job = jobs.get(job_id)
            if job is None or job.service != svc.service_id or held.get(job_id) != iteration:
                return f"{svc.service_id}: checkpoint of {job_id} after {iteration} is not of a job held there"
            if job.remaining or job.iteration != iteration:
                return f"{job_id} held for its checkpoint after {iteration} at iteration {job.iteration}"
            if job_id in seen:
                return f"{job_id}: two checkpoints on record"
            seen[job_id] = iteration
    missing = sorted(set(held) - set(seen))
    return f"{missing[0]} held for a checkpoint that no service has" if missing else None


__all__ = ["due", "finish", "hold", "leave", "start", "violation"]
