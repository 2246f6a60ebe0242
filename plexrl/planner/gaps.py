"""How long a job will be away from the services: after one of its nodes (the `gap` in gap-aware HRRS), and
from now until each job on a service next needs it (what to evict, what to prefetch, whom to wait for); and
how far behind its solo pace a job will end (the `slowdown` ordering). Pure."""

from __future__ import annotations

import math
from collections.abc import Callable

from plexrl.planner.records import JobRecord, ServiceRecord
from plexrl.planner.sessions import CLIENT
from plexrl.planner.sessions import busy_fraction as session_busy_fraction


def gap_after(job: JobRecord, node: str, predict: Callable[[str, str], float]) -> float:
    """Predicted seconds from the end of `node` until `job` can next use a service: the shortest way along its
    cpu successors to a service node (`predict(job_id, node)` seconds per cpu node), and, past the iteration's
    last node, through the next iteration's leading cpu nodes (once). 0 if a service node follows at once, or
    if nothing follows at all. A session's: its client's time until the next call (`sessions.CLIENT`)."""
    if job.plan.open:
        return predict(job.job_id, CLIENT)
    plan, succ, job_id = job.plan.nodes, job.successors, job.job_id
    memo: dict[tuple[str, int], float] = {}

    def reach(name: str, depth: int) -> float:  # from the end of `name` to the next service node's start
        key = (name, depth)
        if key in memo:
            return memo[key]
        wrap = not succ[name]  # the iteration's end: on to the next iteration's sources (once)
        nxt = job.sources if wrap and depth == 0 else succ[name]
        best = math.inf
        for s in nxt:
            if plan[s].runs_on == "service":
                best = 0.0
                break
            best = min(best, predict(job_id, s) + reach(s, depth + wrap))
        memo[key] = best = best if best < math.inf else 0.0
        return best

    return reach(node, 0)


def next_use(
    svc: ServiceRecord, jobs: dict[str, JobRecord], predict: Callable[[str, str], float], now: float
) -> dict[str, float]:
    """Predicted seconds until each job on `svc` next needs the service: 0 with a node queued or running
    there, the predicted rest of its CPU nodes in flight otherwise (`cpu_rests`: a retry's backoff counts), inf
    with nothing in flight."""
    soon = {q.job_id for q in svc.queue} | {c[0] for c in svc.checkpoints}  # (a checkpoint: its next iteration)
    for key in (svc.running, svc.next, svc.checkpointing, *svc.cohort, *svc.next_cohort):
        if key is not None:
            soon.add(key[0])
    out: dict[str, float] = {}
    for job_id in svc.jobs:
        if job_id in soon:
            out[job_id] = 0.0
            continue
        rests = [max(r, 0.0) for r in cpu_rests(jobs[job_id], predict, now)]
        out[job_id] = min(rests) if rests else math.inf
    return out


def cpu_rests(job: JobRecord, predict: Callable[[str, str], float], now: float) -> list[float]:
    """Predicted seconds until each of the job's cpu nodes in flight ends (negative when overdue): a running
    one from its start; one in `backoff` (a retry) from the end of its backoff, which is still to come."""
    job_id = job.job_id
    rests = [predict(job_id, n) - (now - t0) for n, t0 in job.cpu_started.items()]
    rests += [predict(job_id, n) + (t - now) for n, t in job.backoff.items()]
    return rests


def busy_fraction(job: JobRecord, predict: Callable[[str, str], float], now: float | None = None) -> float:
    """Predicted busy fraction of `job` on its service: predicted service seconds per iteration (every chunk
    of a chunked node) over service + CPU seconds (nodes that run every k iterations count 1/k). Before any
    observation the cost model's prior makes it the share of service nodes. A session's: `sessions.busy_fraction`
    (at `now`: an idle session's falls while its client stays away)."""
    if job.plan.open:
        return session_busy_fraction(job, predict, now)
    busy = gap = 0.0
    for name, node in job.plan.nodes.items():
        sec = predict(job.job_id, name) * node.chunks / (node.every or 1)
        if node.runs_on == "service":
            busy += sec
        else:
            gap += sec
    return busy / (busy + gap) if busy + gap > 0 else 0.0


def due(
    svc: ServiceRecord,
    jobs: dict[str, JobRecord],
    predict: Callable[[str, str], float],
    gap: Callable[[str, str], float],
    now: float,
) -> dict[str, float]:
    """`OrderingView.due`: for the jobs on `svc` with no node queued there, the predicted seconds until their
    next service node is ready: the running (or sent-ahead) node's job -> `gap(job, node)`, the gap that
    node's end opens; a job with CPU nodes in flight -> the least predicted rest of them (`cpu_rests`,
    negative when overdue). Jobs with nothing in flight are left out."""
    queued = {q.job_id for q in svc.queue}
    out: dict[str, float] = {}
    for key in (svc.running, svc.next, *svc.cohort, *svc.next_cohort):
        if key is not None and key[0] not in queued:
            out[key[0]] = gap(key[0], key[2])
    for job_id in svc.jobs - queued - out.keys():
        rests = cpu_rests(jobs[job_id], predict, now)
        if rests:
            out[job_id] = min(rests)
    return out


def projected_slowdown(job: JobRecord, predict: Callable[[str, str], float], now: float) -> float:
    """The job's projected slowdown: (time since placement + the predicted rest of its work at its solo pace) /
    (the time its finished nodes took + that rest), each side + 1 s. The rest is the iterations left times
    the predicted seconds per iteration (every node; nodes that run every k iterations count 1/k). A job about
    to finish is judged by how late it will end, not by how late it is now: a short job kept waiting cannot
    catch up later, a long one can (the others' end frees the service)."""
    placed = job.placed_at if job.placed_at is not None else now
    left = 1 if job.plan.open else max(job.plan.iterations - max(job.iteration, 0), 0)  # (a session: its next call)
    rest = left * sum(predict(job.job_id, n) / (p.every or 1) for n, p in job.plan.nodes.items())
    return (now - placed + rest + 1.0) / (job.work_done + rest + 1.0)
