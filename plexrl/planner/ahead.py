"""Whether a node about to be sent ahead (lookahead) should wait for a node that is not ready yet.

Lookahead sends a service its next node while one runs, which hides the driver's round trip between the two;
but a node sent ahead is committed: a node of another job that becomes ready while the running one still
runs then waits for the running node AND the one sent ahead. When the ordering would run that other job's
node first (a job behind a verifier, whose every service node is on its critical path), sending the pick
ahead costs it a whole node's wait at every such moment. `hold` says when to send nothing ahead yet: some
job not running here has its next service node due (`OrderingView.due`: its CPU work's predicted rest)
before the running node is predicted to end, and the ordering, asked at the moment that node is due, picks
it over `pick`. The next event decides again: that job's node becomes ready (it goes ahead), or the running
node ends (the service runs the best ready node, paying one round trip)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

from plexrl.planner.batches import next_service_node, worth_waiting
from plexrl.planner.policies import OrderingPolicy, OrderingView, QueuedNode
from plexrl.planner.records import JobRecord, ServiceRecord


def waits(
    svc: ServiceRecord, jobs: Mapping[str, JobRecord], pick: QueuedNode, busy: set[str], pinned: set[str],
    view: OrderingView, now: float, predict: Callable[[str, str], float], ordering: OrderingPolicy, *,
    partner: bool, preferred: bool,
) -> Literal["partner", "preferred"] | None:  # fmt: skip
    """Why `pick`, about to be sent ahead of the node running on `svc`, should not go yet: `partner` (with
    co-scheduled rollouts, `batches.worth_waiting`: a job of its engine is due, the cohort forms when the
    service frees) or `preferred` (`hold`); None: send it. Both look as far as the running node's rest."""
    if svc.running is None or not (partner or preferred):
        return None
    window = rest_of(predict, svc.running, svc.running_since, now)
    if partner and worth_waiting(svc, jobs, pick, pinned, view.due, window):
        return "partner"
    if preferred and hold(jobs, pick, busy, ordering, view, now, window):
        return "preferred"
    return None


def hold(
    jobs: Mapping[str, JobRecord], pick: QueuedNode, busy: set[str], ordering: OrderingPolicy, view: OrderingView,
    now: float, window: float,
) -> bool:  # fmt: skip
    """True: do not send `pick` ahead now; a node of another job due within `window` seconds (the running
    node's predicted rest) would be picked over it once ready."""
    if window <= 0.0:
        return False
    for job_id, rest in sorted(view.due().items()):
        if job_id == pick.job_id or job_id in busy or rest > window:
            continue
        job = jobs[job_id]
        node = next_service_node(job)
        if node is None:
            continue
        at = now + max(rest, 0.0)
        due = QueuedNode(job_id, job.iteration, node, at, -1)
        if ordering.pick([pick, due], at, view) == 1:
            return True
    return False


def rest_of(predict: Callable[[str, str], float], running: tuple[str, int, str], since: float, now: float) -> float:
    """The running node's predicted seconds left: its predicted time less the seconds since it started."""
    return predict(running[0], running[2]) - (now - since)


__all__ = ["hold", "rest_of", "waits"]
