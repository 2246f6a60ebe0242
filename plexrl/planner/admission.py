"""Per-user admission, as planner state (pure: no clock of its own, no thread, no I/O): which queued jobs the
placement may weigh now, in which order, and when a held job may go in without any other event.

A queued job is HELD while its user is at a limit (`UserLimits`):
- `max_jobs`: the user's jobs placed on services (running) and not ended;
- `max_share`: the user's share of the cluster's accelerator-seconds (`share`: their jobs' service seconds as
  the planner's `Usage` decays them, over the alive services' capacity in the same window). A user with no job
  running is never held by the quota, so a quota never locks a user out of an idle cluster.
A held job's reason is the planner's (`Planner.view`, and a `JobHeld` instruction whenever it changes); a job
held by the quota goes in at the time its user's share will have decayed under it (`release_at`, the planner's
`wake_at`): no one polls.

With `fair` (the fair-share setting), the queued jobs are weighed users first (`order`): the jobs of a user
with no job running, then those of the users with the least decayed service time, each user's in arrival
order; and a job of a user with no job running is placed even where the placement's load cap says no, on the
least loaded service that holds its state, while another user runs more than one job (`squeeze`): one user's
many jobs cannot keep another's single job out.

An idle session's predicted load falls while its client stays away (`sessions.busy_fraction`), with no event: a
job that waits for room under a load-aware placement's `max_load` goes in at the time the idle sessions' loads
leave it room (`room_at`, the planner's `wake_at` too), so sessions whose clients went quiet (or never came back
after a restart) cannot keep a service full for good.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from plexrl.planner import sessions
from plexrl.planner.events import Instruction, JobHeld
from plexrl.planner.placement import PlacementPolicy
from plexrl.planner.placing import admissions
from plexrl.planner.records import InvalidTransition, JobRecord, ServiceRecord
from plexrl.planner.shares import Usage
from plexrl.planner.state import Tier


@dataclass(frozen=True, slots=True)
class UserLimits:
    """`max_jobs`: jobs of one user running at once (None: no limit); `max_share`: the share (0-1] of the
    cluster's accelerator-seconds above which a user's further jobs wait (None: no quota)."""

    max_jobs: int | None = None
    max_share: float | None = None


def running_by_user(jobs: Mapping[str, JobRecord]) -> Counter[str]:
    """Each user's jobs placed and not ended."""
    return Counter(j.plan.user for j in jobs.values() if j.status == "running")


def share(usage: Usage, user: str, now: float, services: int) -> float:
    """`user`'s share of the accelerator-seconds: their decayed service seconds over `services` accelerators'
    capacity in the same window (half-life / ln 2 seconds, the mean age of a decayed second)."""
    window = usage.half_life / math.log(2)
    return usage.value(user, now) / (window * max(services, 1))


def held(user: str, running: Counter[str], limits: UserLimits, usage: Usage, now: float, services: int) -> str | None:
    """Why a queued job of `user` may not be placed now (None: it may)."""
    n = running[user]
    who = repr(user or "(none)")
    if limits.max_jobs is not None and n >= limits.max_jobs:
        return f"waiting: user {who} has {n} job(s) running, the limit is {limits.max_jobs}"
    if limits.max_share is not None and n > 0:
        used = share(usage, user, now, services)
        if used >= limits.max_share:
            return (
                f"waiting: user {who} uses {used:.0%} of the accelerator-seconds (recent, decayed), the quota "
                f"is {limits.max_share:.0%}"
            )
    return None


def release_at(user: str, limits: UserLimits, usage: Usage, now: float, services: int) -> float | None:
    """When `user`'s share will have decayed under the quota (None: no quota, or it is under it already).

    >>> u = Usage(half_life=10.0)
    >>> u.add("ann", 100.0, now=0.0)
    >>> t = release_at("ann", UserLimits(max_share=0.5), u, 0.0, 1)
    >>> round(share(u, "ann", t, 1), 6), share(u, "ann", t, 1) < 0.5
    (0.5, True)
    """
    if limits.max_share is None:
        return None
    used = share(usage, user, now, services)
    if used < limits.max_share:
        return None
    # a hair later than the exact solution: at that time the share is under the quota despite rounding
    return now + usage.half_life * math.log2(used / limits.max_share) * (1 + 1e-9) + 1e-9


def order(pending: Sequence[str], jobs: Mapping[str, JobRecord], running: Counter[str], usage: Usage,
          now: float) -> list[str]:  # fmt: skip
    """The queued jobs users first (see the module docstring); stable: each user's in arrival order."""
    rank = {job_id: i for i, job_id in enumerate(pending)}

    def key(job_id: str) -> tuple[bool, float, int]:
        user = jobs[job_id].plan.user
        return running[user] > 0, usage.value(user, now), rank[job_id]

    return sorted(pending, key=key)


def weigh(
    pending: Sequence[str], jobs: Mapping[str, JobRecord], limits: UserLimits, usage: Usage, now: float,
    services: int, *, fair: bool,
) -> tuple[list[str], Counter[str], Callable[[str], str | None], Callable[[str], bool]]:  # fmt: skip
    """What `placing.admissions` needs to weigh `pending` now: the order (users first with `fair`), the users'
    running counts (the caller adds each job it places), why a job is held, and whether it is squeezed in."""
    running = running_by_user(jobs)

    def user(job_id: str) -> str:
        return jobs[job_id].plan.user

    ordered = order(pending, jobs, running, usage, now) if fair else list(pending)
    return (
        ordered, running, lambda j: held(user(j), running, limits, usage, now, services),
        lambda j: fair and squeeze(user(j), running),
    )  # fmt: skip


def room_at(
    waiting: float, alive: Sequence[ServiceRecord], jobs: Mapping[str, JobRecord], cap: float,
    load_at: Callable[[str, float], float], now: float,
) -> float | None:  # fmt: skip
    """The first time after `now` at which a service's load leaves room under `cap` for a job of load `waiting`
    because its idle sessions' loads fell (`sessions.away`); None when that never comes (no idle session, or the
    other jobs' loads alone leave no room) or there is room already (the job waits for something else).

    >>> from plexrl.planner.events import JobPlan, NodePlan
    >>> idle = JobRecord("i", JobPlan({"call": NodePlan("service")}, 9, ("call",), open=True), status="running")
    >>> idle.cpu_started[sessions.CLIENT] = 0.0
    >>> svc = ServiceRecord("s0", jobs={"i"})
    >>> load = lambda job, t: 1.0 / (1.0 + max(t, 1.0))  # a call 1 s, its client away since 0 (predicted 1 s)
    >>> t = room_at(0.6, [svc], {"i": idle}, 1.0, load, now=0.0)
    >>> round(t, 3), load("i", t) + 0.6 <= 1.0 + 1e-9
    (1.5, True)
    """
    best: float | None = None
    for svc in alive:
        idle = [j for j in sorted(svc.jobs) if sessions.away(jobs[j])]
        if not idle:
            continue
        fixed = sum(load_at(j, now) for j in svc.jobs if j not in idle)

        def fits(t: float, idle: list[str] = idle, fixed: float = fixed) -> bool:
            return fixed + sum(load_at(j, t) for j in idle) + waiting <= cap + 1e-9

        if fixed + waiting >= cap or fits(now):
            continue
        span = 1.0
        while not fits(now + span):
            span *= 2.0
            if span > 1e9:  # (a room only in decades: no wake at all)
                break
        else:
            low = 0.0
            for _ in range(40):  # (to about span / 1e12)
                mid = (low + span) / 2.0
                low, span = (low, mid) if fits(now + mid) else (mid, span)
            best = now + span if best is None else min(best, now + span)
    return best


def changed(before: Mapping[str, str], after: Mapping[str, str]) -> list[tuple[str, str]]:
    """(job, reason) for each job whose held reason changed ("" : no longer held), in job order."""
    return [(j, after.get(j, "")) for j in sorted(set(before) | set(after)) if after.get(j, "") != before.get(j, "")]


def squeeze(user: str, running: Counter[str]) -> bool:
    """Whether a job of `user` goes in past the placement's load cap: they run nothing, another runs more than
    one job."""
    return running[user] == 0 and any(n > 1 for n in running.values())


@dataclass(slots=True)
class Admitter:
    """The admission part of `core.Planner`, like `dispatch.Dispatcher`: the planner's records, placement,
    limits and usage (shared, not copied), its clock and `job_load`, and the steps of the planner it calls
    back: `place` a job on a service (at a tier, now) and `fail` one that can never be placed. It owns the
    queue: `pending` (job ids, in submission order), `held` (job -> why its user's limits hold it), whether
    admission is `due` (only after something that can change a placement: a service joined or was lost, a job
    was submitted or ended, a state was measured smaller, or with a load-aware placement a job finished an
    iteration), and when a quota-held job, or one waiting for idle sessions' loads to fall, may go in without
    any other event (`release_at`)."""

    jobs: dict[str, JobRecord]
    services: dict[str, ServiceRecord]
    placement: PlacementPolicy
    limits: UserLimits
    usage: Usage
    fair: bool
    clock: Callable[[], float]
    job_load: Callable[[str, float], float]  # (job, at time)
    place: Callable[[JobRecord, str, Tier, float, list[Instruction]], None]
    fail: Callable[[str, str, list[Instruction]], None]
    history: Callable[[str], str]
    pending: list[str] = field(default_factory=list)
    held: dict[str, str] = field(default_factory=dict)
    due: bool = True
    release_at: float | None = None  # (a quota's release, or idle sessions' loads leaving room: `room_at`)

    def admit(self, out: list[Instruction]) -> None:
        """Weigh the queued jobs (when due): place those the placement takes, in order, fail those that can
        never be placed, keep the others queued with their reason; announce held reasons that changed."""
        if not self.pending or not self.due:
            return
        self.due = False
        alive = [s for s in self.services.values() if s.alive]
        if not alive:
            return
        now = self.clock()
        pending, running, hold, squeezed = weigh(self.pending, self.jobs, self.limits, self.usage, now, len(alive),
                                                 fair=self.fair)  # fmt: skip
        still, held, roomless = set(), {}, []

        def load(job_id: str) -> float:
            return self.job_load(job_id, now)

        for a in admissions(pending, self.jobs, alive, self.placement, load, hold, squeezed):
            if a.held or (a.target is None and not a.problem):
                still.add(a.job_id)
                if not a.held:
                    roomless.append(load(a.job_id))
                self.jobs[a.job_id].reason = a.held or a.reason  # (shown to users: the server's page and status)
                if a.held:
                    held[a.job_id] = a.held
            elif a.problem:
                self.fail(a.job_id, a.problem, out)
            elif a.tier is None:
                raise InvalidTransition(self.history(f"placement chose {a.target} for {a.job_id} but it does not fit"))
            else:
                job = self.jobs[a.job_id]
                running[job.plan.user] += 1
                self.place(job, a.target, a.tier, now, out)  # type: ignore[arg-type]  # (a target with a tier)
        self.pending = [j for j in self.pending if j in still]  # arrival order kept
        out += [JobHeld(j, why) for j, why in changed(self.held, held)]
        self.held = held
        times = [release_at(self.jobs[j].plan.user, self.limits, self.usage, now, len(alive)) for j in held]
        cap = getattr(self.placement, "max_load", None)
        if roomless and getattr(self.placement, "uses_load", False) and cap is not None:
            times.append(room_at(min(roomless), alive, self.jobs, float(cap), self.job_load, now))
        self.release_at = min((t for t in times if t is not None), default=None)

    def drop(self, job_id: str, out: list[Instruction], keep_pending: bool = False) -> None:
        """A job ended: it leaves the queue (unless `keep_pending`: `admit` rebuilds it) and the held jobs."""
        if job_id in self.pending and not keep_pending:
            self.pending.remove(job_id)
        if job_id in self.held:  # it no longer waits for its user's limits
            del self.held[job_id]
            out.append(JobHeld(job_id, ""))

    def wake(self, now: float) -> None:
        """A tick: once a quota's release time has come, the held jobs are weighed again."""
        if self.release_at is not None and now >= self.release_at:
            self.release_at, self.due = None, True


__all__ = [
    "Admitter",
    "UserLimits",
    "changed",
    "held",
    "order",
    "release_at",
    "room_at",
    "running_by_user",
    "share",
    "squeeze",
    "weigh",
]
