"""Pluggable placement policies: where a job lives (which ready service node a free service runs next is
`policies.py`). Pure functions of the view the planner hands them; no I/O, no clock of their own.

Placement sees each alive service as a `ServiceView`: how many jobs it holds, their predicted busy fraction
(`load`, from the cost model) and whether the new job's state fits its memory budgets now (`fits`).
A policy returns a service id, or None to keep the job queued (it is retried after any event that can
change the answer: a service joined or was lost, a job arrived or ended, a state was measured smaller, and,
for a policy whose answer depends on predicted loads (`uses_load`), an iteration ended).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ServiceView:
    service_id: str
    jobs: int
    load: float
    fits: bool


class PlacementPolicy(Protocol):
    name: str
    # whether `place` can return None for one load and a service for another with the same views (then
    # queued jobs are retried whenever predicted loads move, i.e. after every iteration)
    uses_load: bool

    def place(self, job_id: str, job_load: float, services: list[ServiceView]) -> str | None:
        """The service to place `job_id` (predicted busy fraction `job_load`) on, or None to keep it queued."""


class Isolated:
    """Each job gets a service of its own; a job waits while every service is taken."""

    name = "isolated"
    uses_load = False

    def place(self, job_id: str, job_load: float, services: list[ServiceView]) -> str | None:
        free = [s.service_id for s in services if s.jobs == 0 and s.fits]
        return min(free) if free else None


class Pack:
    """Concentrate, up to a load cap: the fitting service with the highest predicted load that still has room
    for the job (load + job_load <= `max_load`; ties: more jobs, lowest id), an empty service when none has
    room, else the job waits. Keeps other services free for jobs that need one alone. `max_load=inf` is
    the uncapped form (every job on the fullest service that fits in memory): it overloads one service
    while others idle, which no sensible operator would run, so it is not the default."""

    name = "pack"

    def __init__(self, max_load: float = 1.0) -> None:
        self.max_load = max_load
        self.uses_load = math.isfinite(max_load)

    def place(self, job_id: str, job_load: float, services: list[ServiceView]) -> str | None:
        cap = self.max_load + 1e-9
        room = [s for s in services if s.fits and (s.jobs == 0 or s.load + job_load <= cap)]
        return min(room, key=lambda s: (-s.load, -s.jobs, s.service_id)).service_id if room else None


class Spread:
    """Balance: the fitting service with the lowest predicted load (ties: fewer jobs, lowest id)."""

    name = "spread"
    uses_load = False

    def place(self, job_id: str, job_load: float, services: list[ServiceView]) -> str | None:
        fit = [s for s in services if s.fits]
        return min(fit, key=lambda s: (s.load, s.jobs, s.service_id)).service_id if fit else None


class SpreadBackfill:
    """Spread, but admit a job only where the predicted load leaves room for it (load + job_load <=
    `max_load`); an empty service always admits. Queued jobs are backfilled as predictions settle and
    jobs end."""

    name = "spread+backfill"
    uses_load = True

    def __init__(self, max_load: float = 1.0) -> None:
        self.max_load = max_load

    def place(self, job_id: str, job_load: float, services: list[ServiceView]) -> str | None:
        room = [s for s in services if s.fits and (s.jobs == 0 or s.load + job_load <= self.max_load + 1e-9)]
        return min(room, key=lambda s: (s.load, s.jobs, s.service_id)).service_id if room else None


PLACEMENTS: dict[str, Callable[[], PlacementPolicy]] = {
    "isolated": Isolated,
    "pack": Pack,
    "spread": Spread,
    "spread+backfill": SpreadBackfill,
}


def placement_policy(name: str, max_load: float = 1.0) -> PlacementPolicy:
    """The named placement policy; `max_load` caps the load-aware ones (pack, spread+backfill)."""
    if name == "pack":
        return Pack(max_load)
    if name == "spread+backfill":
        return SpreadBackfill(max_load)
    return PLACEMENTS[name]()


__all__ = [
    "PLACEMENTS", "Isolated", "Pack", "PlacementPolicy", "ServiceView", "Spread", "SpreadBackfill", "placement_policy",
]  # fmt: skip
