"""`Admission`: which of a user's jobs the server hands to the runner now. Pure: no I/O, no threads, no clock;
the controller calls it under its lock and carries out what it returns.

Jobs are offered in arrival order. A job waits while its user is at a limit, and is handed over, in arrival
order among the waiting, once the user is under it again (a job of theirs ended, or their share fell):
- `limit`: jobs of one user handed over and not ended;
- `max_share`: the user's share of the cluster's accelerator-seconds, as `share(user)` reports it (the
  controller measures it: the planner's decayed service seconds per user over the services' capacity). A
  user with no job running always gets one in, so that a quota never locks a user out of an idle cluster.
So one user's twenty jobs occupy at most `limit` places in the planner, and another user's single job is
handed over at once. Inside the planner, `FairShare` ordering shares each service between the users.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Admission:
    """`limit`: jobs per user handed over at once (None: no limit). `max_share`: the share (0-1] of the
    cluster's accelerator-seconds above which a user's further jobs wait (None: no quota); `share(user)`
    returns the user's current share."""

    limit: int | None = None
    max_share: float | None = None
    share: Callable[[str], float] = lambda user: 0.0
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

    def again(self) -> list[str]:
        """Shares moved (time passed, work was done): the job ids to hand over now."""
        return self._take()

    def reason(self, job_id: str) -> str | None:
        """Why a job waits (None: it does not)."""
        for j, user in self.waiting:
            if j == job_id:
                return self._blocked(user) or "waiting for an earlier job of the same user"
        return None

    def _blocked(self, user: str) -> str | None:
        """Why `user` may not have one more job now (None: they may)."""
        n = len(self.active.get(user, ()))
        who = repr(user or "(none)")
        if self.limit is not None and n >= self.limit:
            return f"waiting: user {who} has {n} job(s) running, the limit is {self.limit}"
        if self.max_share is not None and n > 0:
            share = self.share(user)
            if share >= self.max_share:
                return (
                    f"waiting: user {who} uses {share:.0%} of the accelerator-seconds (recent, decayed), the quota "
                    f"is {self.max_share:.0%}"
                )
        return None

    def _take(self) -> list[str]:
        out, still = [], []
        for job_id, user in self.waiting:
            if self._blocked(user) is None:
                self.active.setdefault(user, set()).add(job_id)
                out.append(job_id)
            else:
                still.append((job_id, user))
        self.waiting = still
        return out


__all__ = ["Admission"]
