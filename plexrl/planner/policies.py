"""Pluggable planner policies: placement (where a job lives) and ordering (which ready service node a free
service runs next). Pure functions of the planner's view; no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class QueuedNode:
    """A ready service node waiting for its service."""

    job_id: str
    iteration: int
    node: str
    ready_at: float
    seq: int


class PlacementPolicy(Protocol):
    name: str

    def place(self, job_id: str, jobs_per_service: dict[str, int]) -> str | None:
        """The service to place `job_id` on, or None to keep it queued."""


class OrderingPolicy(Protocol):
    name: str

    def pick(self, service_id: str, queue: list[QueuedNode], now: float) -> int:
        """Index into `queue` (non-empty) of the node the free service runs next."""


class Isolated:
    """Each job gets a service of its own; a job waits while every service is taken."""

    name = "isolated"

    def place(self, job_id: str, jobs_per_service: dict[str, int]) -> str | None:
        free = sorted(s for s, n in jobs_per_service.items() if n == 0)
        return free[0] if free else None


class Pack:
    """Every job is admitted at once, on the service with the fewest jobs (ties: lowest id)."""

    name = "pack"

    def place(self, job_id: str, jobs_per_service: dict[str, int]) -> str | None:
        if not jobs_per_service:
            return None
        return min(sorted(jobs_per_service), key=lambda s: jobs_per_service[s])


class Fifo:
    """First ready, first run."""

    name = "fifo"

    def pick(self, service_id: str, queue: list[QueuedNode], now: float) -> int:
        return min(range(len(queue)), key=lambda i: (queue[i].ready_at, queue[i].seq))


PLACEMENTS: dict[str, type] = {"isolated": Isolated, "pack": Pack}
ORDERINGS: dict[str, type] = {"fifo": Fifo}
