"""A job joining and leaving its service, as pure helpers of `core.Planner`:

- `admissions`: for each queued job in order, whether it is held by its user's limits (`admission.py`), can
  never be placed (its state and engine exceed every service's device budget), stays queued (the placement
  policy said no), or goes to a service, whose `StateManager` has admitted its state (the tier it landed in).
  A generator: the planner places each job before the next one is weighed, so later views (and the users'
  running counts) see the jobs, loads and free memory that placement changed;
- `leave`: drop an ended job from its service's queue, running, group and sent-ahead slots, states and pointers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from plexrl.planner import checkpoints
from plexrl.planner.batches import advance, leave_groups
from plexrl.planner.policies import PlacementPolicy, ServiceView
from plexrl.planner.records import JobRecord, ServiceRecord
from plexrl.planner.state import Tier


@dataclass(frozen=True, slots=True)
class Admission:
    job_id: str
    target: str | None = None  # None: stays queued (or `problem`)
    tier: Tier | None = None  # where the target's StateManager put its state (None there: it did not fit)
    problem: str = ""  # why it can never be placed (it fails)
    held: str = ""  # why its user's limits hold it (it stays queued, `admission.held`)


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
            yield Admission(job_id)
            continue
        tier = by_id[target].state.admit(job_id, nbytes, engine)
        yield Admission(job_id, target, tier)
        load[target] += mine
        views.clear()  # the target's jobs, load and free memory changed


def leave(svc: ServiceRecord, job_id: str, now: float) -> None:
    """Drop an ended job from `svc`: its queued nodes, its running or sent-ahead node (the driver abandons
    their results; the service runs `next` once an abandoned running node ends), its state and pointers."""
    svc.queue = [q for q in svc.queue if q.job_id != job_id]
    if svc.next is not None and svc.next[0] == job_id and not svc.next_group:
        svc.next = None
    leave_groups(svc, job_id, now)  # a member of a co-scheduled group, running or sent ahead
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
    svc.group, svc.next_group = set(), set()
    svc.resident = svc.prefetching = None


__all__ = ["Admission", "admissions", "emptied", "leave"]
