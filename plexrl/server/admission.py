"""`Admission`: how many jobs of one user the server hands to the runner at once. Pure: no I/O, no threads,
no clock; the controller calls it under its lock and carries out what it returns.

Jobs are offered in arrival order; a job whose user already has `limit` jobs handed over (and not ended)
waits, and is handed over, in arrival order among the waiting, as soon as one of that user's jobs ends.
So one user's twenty jobs occupy at most `limit` places in the planner, and another user's single job is
handed over at once. What it does NOT do: shares of accelerator-seconds, or any ordering inside the
planner (the planner's `ordering` policy orders the ready nodes of the jobs it has).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Admission:
    """`limit`: jobs per user handed over at once (None: no limit)."""

    limit: int | None = None
    waiting: list[tuple[str, str]] = field(default_factory=list)  # (job id, user), arrival order
    active: dict[str, set[str]] = field(default_factory=dict)  # user -> job ids handed over, not ended

    def offer(self, job_id: str, user: str) -> list[str]:
        """A prepared job arrives; returns the job ids to hand over now (in order)."""
        if any(j == job_id for j, _ in self.waiting) or any(job_id in s for s in self.active.values()):
            raise ValueError(f"job {job_id!r} was offered twice")
        self.waiting.append((job_id, user))
        return self._take()

    def ended(self, job_id: str) -> list[str]:
        """A job ended, or was withdrawn while waiting; returns the job ids to hand over now."""
        self.waiting = [(j, u) for j, u in self.waiting if j != job_id]
        for jobs in self.active.values():
            jobs.discard(job_id)
        return self._take()

    def reason(self, job_id: str) -> str | None:
        """Why a job waits (None: it does not)."""
        for j, user in self.waiting:
            if j == job_id:
                n = len(self.active.get(user, ()))
                return f"waiting: user {user or '(none)'!r} has {n} job(s) running, the limit is {self.limit}"
        return None

    def _take(self) -> list[str]:
        out, still = [], []
        for job_id, user in self.waiting:
            mine = self.active.setdefault(user, set())
            if self.limit is None or len(mine) < self.limit:
                mine.add(job_id)
                out.append(job_id)
            else:
                still.append((job_id, user))
        self.waiting = still
        return out


__all__ = ["Admission"]
