"""Views of the planner's records, pure functions of them and its cost model: what the ordering policy sees of
a service (`ordering_view`), whom a service will most likely run next (`next_job`: what to prefetch), and the
planner's read API for everything outside it (`PlannerView`, `planner_view`: frozen copies, so a controller or
a page reads them without the planner's records, on any thread, once copied on the runner's)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

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
        lambda q: q.job_id == resident and continues_phase(jobs[q.job_id], q.node),
    )  # fmt: skip


def continues_phase(job: JobRecord, node: str) -> bool:
    """Whether `node` of `job` continues the job's phase on its service (`OrderingView.continues`, asked of the
    job that ran last there): the next chunk or slice of a node under way, or a node whose dependencies are all
    service nodes (it became ready as the job's previous service node ended, with no off-service work between)."""
    if job.chunk.get(node, 0) > 0 or job.nodes.get(node) == "paused":
        return True
    plan = job.plan.nodes
    deps = plan[node].deps
    return bool(deps) and all(plan[d].runs_on == "service" for d in deps)


def next_job(
    svc: ServiceRecord,
    ordering: OrderingPolicy,
    now: float,
    use_in: Mapping[str, float],
    view: OrderingView,
    exclude: set[str],
) -> str | None:
    """The job the service will most likely run after the nodes sent to it (what to prefetch): the ordering's
    pick among the other queued jobs, else the job whose next use is soonest; None when every other job is on
    device already."""
    others = [q for q in svc.queue if q.job_id not in exclude]
    if others:
        return others[ordering.pick(others, now, view)].job_id
    rest = [j for j in svc.jobs if j not in exclude]
    if all(svc.state.where.get(j, "device") == "device" for j in rest):
        return None  # nothing to prefetch (and `use_in`, a simulation, is not computed)
    later = [(t, j) for j, t in use_in.items() if j not in exclude and t < math.inf]
    return min(later)[1] if later else None


@dataclass(frozen=True, slots=True)
class QueueView:
    """A service as the planner sees it: alive, the node it runs, the nodes waiting for it (job, node)."""

    service_id: str
    alive: bool
    running: tuple[str, str] | None
    waiting: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class JobView:
    """A job as the planner sees it: its user, status (`records.JobStatus`), service, iteration, why it ended
    (while queued: why it waits), and why its user's limits hold it (`held`, "" when they do not)."""

    job_id: str
    user: str
    status: str
    service: str | None
    iteration: int
    reason: str
    held: str


@dataclass(frozen=True, slots=True)
class PlannerView:
    """The planner's read API: a frozen copy of its services and jobs (`Planner.view`)."""

    services: tuple[QueueView, ...]
    jobs: tuple[JobView, ...]

    def waiting(self) -> dict[str, tuple[tuple[str, str], ...]]:
        """Service -> the (job, node) waiting for it."""
        return {s.service_id: s.waiting for s in self.services}

    def unplaced(self) -> dict[str, str]:
        """The jobs waiting for a service (queued: no room yet, or held by their user's limits) -> why, in words
        (the services, their predicted loads and what would let the job in; or the limit that holds it)."""
        return {j.job_id: j.reason for j in self.jobs if j.status == "queued"}


def planner_view(
    jobs: Mapping[str, JobRecord], services: Mapping[str, ServiceRecord], held: Mapping[str, str]
) -> PlannerView:
    """The frozen copy of the planner's records (`PlannerView`)."""
    queues = tuple(
        QueueView(
            sid,
            svc.alive,
            (svc.running[0], svc.running[2]) if svc.running else None,
            tuple((q.job_id, q.node) for q in svc.queue),
        )
        for sid, svc in sorted(services.items())
    )
    views = tuple(
        JobView(j.job_id, j.plan.user, j.status, j.service, j.iteration, j.reason, held.get(j.job_id, ""))
        for j in jobs.values()
    )
    return PlannerView(queues, views)


__all__ = ["JobView", "PlannerView", "QueueView", "continues_phase", "next_job", "ordering_view", "planner_view"]
