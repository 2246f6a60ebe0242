"""A job joining and leaving its service, as pure helpers of `core.Planner`:

- `admissions`: for each queued job in order, whether it is held by its user's limits (`admission.py`), can
  never be placed (its state and engine exceed every service's device budget), stays queued (the placement
  policy said no), or goes to a service, whose `StateManager` has admitted its state (the tier it landed in).
  A generator: the planner places each job before the next one is weighed, so later views (and the users'
  running counts) see the jobs, loads and free memory that placement changed;
- `leave`: drop an ended job from its service's queue, running, cohort and sent-ahead slots, states and pointers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from plexrl.planner import checkpoints
from plexrl.planner.batches import advance, leave_cohorts
from plexrl.planner.placement import PlacementPolicy, ServiceView
from plexrl.planner.records import JobRecord, ServiceRecord
from plexrl.planner.state import Tier


@dataclass(frozen=True, slots=True)
class Admission:
    job_id: str
    target: str | None = None  # None: stays queued (or `problem`)
    tier: Tier | None = None  # where the target's StateManager put its state (None there: it did not fit)
    problem: str = ""  # why it can never be placed (it fails)
    held: str = ""  # why its user's limits hold it (it stays queued, `admission.held`)
    reason: str = ""  # why it stays queued: the services, their loads, what would let it in


def admissions(
    pending: Sequence[str],
    jobs: Mapping[str, JobRecord],
    alive: Sequence[ServiceRecord],
    placement: PlacementPolicy,
    job_load: Callable[[str], float],
    hold: Callable[[str], str | None] = lambda job_id: None,
    squeeze: Callable[[str], bool] = lambda job_id: False,
) -> Iterator[Admission]:
    """Weigh every job of `pending` in order (see the module docstring); `alive` is not empty. `hold(job)`: why
    its user's limits hold it now (None: they do not); `squeeze(job)`: the placement's no does not keep it out,
    it goes to the least loaded service that holds its state (`admission.squeeze`)."""
    load = {s.service_id: sum(job_load(j) for j in s.jobs) for s in alive}
    by_id = {s.service_id: s for s in alive}
    views: dict[tuple[int, tuple[str, int] | None], list[ServiceView]] = {}  # `fits` depends only on these
    largest = max(math.inf if s.state.budgets["device"] is None else s.state.budgets["device"] for s in alive)
    for job_id in pending:
        why = hold(job_id)
        if why is not None:
            yield Admission(job_id, held=why)
            continue
        job = jobs[job_id]
        nbytes, engine = job.plan.state_bytes, job.plan.engine
        need = nbytes + (engine[1] if engine else 0)
        if need > largest:
            yield Admission(
                job_id,
                problem=f"its state ({nbytes} bytes"
                + (f", plus {engine[1]} for its generation engine" if engine else "")
                + f") exceeds the device budget of every service (largest {largest}); "
                "raise device_bytes or use a smaller model",
            )
            continue
        if (nbytes, engine) not in views:
            views[nbytes, engine] = [
                ServiceView(s.service_id, len(s.jobs), load[s.service_id], s.state.fits(nbytes, engine)) for s in alive
            ]
        mine = job_load(job_id)
        target = placement.place(job_id, mine, views[nbytes, engine])
        if target is None and squeeze(job_id):
            room = [v for v in views[nbytes, engine] if v.fits]
            target = min(room, key=lambda v: (v.load, v.jobs, v.service_id)).service_id if room else None
        if target is None:
            yield Admission(job_id, reason=waiting_reason(mine, views[nbytes, engine], placement))
            continue
        tier = by_id[target].state.admit(job_id, nbytes, engine)
        yield Admission(job_id, target, tier)
        load[target] += mine
        views.clear()  # the target's jobs, load and free memory changed


def waiting_reason(job_load: float, views: Sequence[ServiceView], placement: PlacementPolicy) -> str:
    """Why a job the placement kept queued waits, in words: each service, its jobs and predicted load (busy
    fraction), and the condition that lets the job in.

    >>> from plexrl.planner.placement import SpreadBackfill
    >>> why = waiting_reason(0.4, [ServiceView("service-0", 2, 0.93, True)], SpreadBackfill(1.0))
    >>> "service-0 holds 2 jobs at a predicted load of 0.93; this job adds 0.40" in why
    True
    >>> "admits up to max_load 1.00: it goes in when that load falls to 0.60 or below" in why
    True
    """
    max_load = getattr(placement, "max_load", None)
    uses_load = bool(getattr(placement, "uses_load", False)) and max_load is not None
    held = []
    for v in views:
        jobs = f"{v.jobs} job{'s' if v.jobs != 1 else ''}"
        held.append(
            f"{v.service_id} holds {jobs} at a predicted load of {v.load:.2f}"
            + ("" if v.fits else " and has no device memory left for this job's state")
        )
    shown = "; ".join(held[:4]) + (f"; and {len(held) - 4} more services" if len(held) > 4 else "")
    if uses_load and any(v.fits for v in views):
        room = max(float(max_load) - job_load, 0.0)  # type: ignore[arg-type]
        when = (
            f"this job adds {job_load:.2f} and {placement.name} admits up to max_load {max_load:.2f}: it goes in "
            f"when that load falls to {room:.2f} or below (a job there ends, or its prediction settles lower), "
            "or a service joins"
        )
    elif not any(v.fits for v in views):
        when = "it goes in when a job ends and frees device memory, or a service joins"
    else:
        when = f"{placement.name} places one job per service: it goes in when a job ends, or a service joins"
    return f"waiting for room: {shown}; {when}"


def leave(svc: ServiceRecord, job_id: str, now: float) -> None:
    """Drop an ended job from `svc`: its queued nodes, its running or sent-ahead node (the driver abandons
    their results; the service runs `next` once an abandoned running node ends), its state and pointers."""
    svc.queue = [q for q in svc.queue if q.job_id != job_id]
    if svc.next is not None and svc.next[0] == job_id and not svc.next_cohort:
        svc.next = None
    leave_cohorts(svc, job_id, now)  # a member of a co-scheduled cohort, running or sent ahead
    if svc.running is not None and svc.running[0] == job_id:
        advance(svc, now)
    checkpoints.leave(svc, job_id)
    svc.jobs.discard(job_id)
    svc.state.release(job_id)
    if svc.resident == job_id:
        svc.resident = None
    if svc.prefetching == job_id:
        svc.prefetching = None


def emptied(svc: ServiceRecord) -> None:
    """A lost service, its jobs ended: it queues, runs, holds and points at nothing."""
    svc.queue.clear()
    svc.checkpoints.clear()
    svc.running = svc.next = svc.checkpointing = None
    svc.cohort, svc.next_cohort = set(), set()
    svc.resident = svc.prefetching = None


__all__ = ["Admission", "admissions", "emptied", "leave"]
