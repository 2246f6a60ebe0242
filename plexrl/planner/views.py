"""What the ordering policy sees of a service (`ordering_view`) and whom the service will most likely run
next (`next_job`: what to prefetch). Pure functions of the planner's records and cost model."""

from __future__ import annotations

import math
from collections.abc import Callable

from plexrl.planner.costs import CostModel
from plexrl.planner.gaps import due, projected_slowdown
from plexrl.planner.policies import OrderingPolicy, OrderingView, job_pace
from plexrl.planner.records import JobRecord, ServiceRecord
from plexrl.planner.shares import Usage
from plexrl.planner.slices import node_rest


def ordering_view(
    svc: ServiceRecord,
    jobs: dict[str, JobRecord],
    costs: CostModel,
    usage: Usage,
    gap_after: Callable[[str, str], float],
    now: float,
) -> OrderingView:
    """The `OrderingView` of `svc` at `now`: its resident job, predicted node (what is left of a paused one:
    `slices.node_rest`), swap and gap times, users and their usage, projected slowdowns, due times and paces."""

    def swap_time(job_id: str) -> float:
        if svc.state.on_device(job_id):
            return 0.0
        return costs.swap_seconds(svc.state.size.get(job_id, 0))

    resident = svc.resident if svc.resident is not None and svc.state.on_device(svc.resident) else None
    return OrderingView(
        resident, lambda q: node_rest(jobs[q.job_id], q.node, costs.predict), swap_time,
        lambda q: gap_after(q.job_id, q.node), lambda j: jobs[j].plan.user,
        lambda u: usage.value(u, now), lambda j: projected_slowdown(jobs[j], costs.predict, now),
        lambda: due(svc, jobs, costs.predict, gap_after, now),
        lambda j: job_pace(jobs[j], costs.predict, now),
    )  # fmt: skip


def next_job(
    svc: ServiceRecord,
    ordering: OrderingPolicy,
    now: float,
    use_in: dict[str, float],
    view: OrderingView,
    exclude: set[str],
) -> str | None:
    """The job the service will most likely run after the nodes sent to it (what to prefetch): the ordering's
    pick among the other queued jobs, else the job whose next use is soonest."""
    others = [q for q in svc.queue if q.job_id not in exclude]
    if others:
        return others[ordering.pick(others, now, view)].job_id
    later = [(t, j) for j, t in use_in.items() if j not in exclude and t < math.inf]
    return min(later)[1] if later else None


__all__ = ["next_job", "ordering_view"]
