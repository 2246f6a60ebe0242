"""The `critical-path` ordering: serve the job whose remaining chain sets the makespan, and fill its gaps only
with nodes predicted to end before it returns. Pure: a function of the `OrderingView` the planner hands it.

A job's chain is the seconds until its next service node is ready (0 when one is queued; `OrderingView.due`
otherwise: the gap the end of its running node opens, or the rest of its CPU, tool or verifier node in flight)
plus the rest of its work at its solo pace (`Pace.rest`: service, CPU, tool and verifier seconds, in series).
No schedule ends the mix sooner than the longest chain, nor sooner than the service's own work: every job's
predicted service seconds (`Pace.rest_service`), summed (S). When no chain reaches S the service bounds the
makespan, and `inner` (HRRS in the registry) picks, work-conserving. When one does, that job (C) is critical:
- C has a node queued: it runs (`inner` among C's nodes);
- C is due in d seconds: `inner` picks among the nodes predicted to end by then (the node's time plus its job's
  swap-in <= d), so C's node never waits behind one that overruns its return;
- none fits: the service may idle for C. Idling costs the mix nothing while the idle fits in C's slack over the
  service's work (budget = C's chain - S): the service waits (-1). Past it, idling d seconds ends the mix d -
  budget later, and a node that overruns C's return by less than that is the cheaper delay: `inner` picks
  among those; with none, the service waits.

HRRS alone fills a tool-bound job's waits with whatever node ranks highest, and a node that overruns the job's
return delays its whole chain; this is the rule that the agentic mix (`configs/multiplex_agentic.yaml`) asks
for, where the agent's chain of turns and tool calls sets the makespan.

No hold deadlocks or starves: the service waits only for a job with work in flight (it is in `due`), not
overdue (d >= 0: a late prediction ends the wait at the next event, which asks again), and the planner asks
again at every event of a job on the service (its node ready, any node ended); a node that has waited `age` x
its predicted time is always a candidate, beside C's node or as a filler, and the service never waits while
one is queued. With lookahead, `ahead.hold` keeps another job's node from being sent ahead of C's when C is
due before the running node ends (`hold_ahead`, as `IoFirst`).

What it does NOT see: how long the running node has left, so a node sent ahead (lookahead) of a running one
is judged from now, not from that node's end; and a job's progress inside its current iteration (`Pace.rest`
counts whole iterations). Chains and S are this service's jobs' only.

It imports nothing of the planner: `policies.ORDERINGS` registers it, so it names what it reads of a queued
node, a view, a pace and its inner ordering by the small Protocols below (as `policies._JobProgress` does)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol


class _Queued(Protocol):  # what it reads of a `policies.QueuedNode`
    @property
    def job_id(self) -> str: ...
    @property
    def ready_at(self) -> float: ...


class _Rest(Protocol):  # of a `policies.Pace`
    @property
    def rest(self) -> float: ...
    @property
    def rest_service(self) -> float: ...


class _View(Protocol):  # of a `policies.OrderingView`
    @property
    def service_time(self) -> Callable[[Any], float]: ...
    @property
    def swap_time(self) -> Callable[[str], float]: ...
    @property
    def due(self) -> Callable[[], Mapping[str, float]]: ...
    @property
    def pace(self) -> Callable[[str], _Rest]: ...


class _Ordering(Protocol):  # a `policies.OrderingPolicy`
    @property
    def name(self) -> str: ...
    def pick(self, queue: list[Any], now: float, view: Any) -> int: ...


class CriticalPath:
    """The critical job's node first, its gaps filled only with nodes that end before it returns, the service
    held for it while the idle costs the mix nothing; `inner` picks among the candidates, and alone when no
    job's chain reaches the service's work (see the module). `age`: a node that has waited `age` x its
    predicted time is a candidate whatever the rule says."""

    hold_ahead = True  # the planner's lookahead hold by default (`ahead.hold`), as with `IoFirst`

    def __init__(self, inner: _Ordering, age: float = 20.0) -> None:
        self.inner, self.age = inner, age
        self.name = "critical-path" if inner.name == "hrrs" else f"critical-path-{inner.name}"

    def pick(self, queue: Sequence[_Queued], now: float, view: _View) -> int:
        critical = self.critical(queue, view)
        if critical is None:
            return self.inner.pick(list(queue), now, view)
        job, d, budget = critical
        if any(q.job_id == job for q in queue):  # its node runs (a node that has waited too long may go first)
            return self._among(queue, now, view, lambda q, cost: q.job_id == job)
        if d < 0.0:  # overdue: when it returns is not predicted, so nothing is held for it
            return self.inner.pick(list(queue), now, view)
        fit = self._among(queue, now, view, lambda q, cost: cost <= d)
        if fit >= 0:
            return fit
        # nothing ends before it returns: idling d seconds lengthens the mix by d - budget (when positive); a node
        # that overruns its return by less is the cheaper delay
        return self._among(queue, now, view, lambda q, cost: cost - d < d - budget)

    def critical(self, queue: Sequence[_Queued], view: _View) -> tuple[str, float, float] | None:
        """The critical job, the seconds until its next service node is ready (0 when queued; negative: its
        CPU node is overdue) and its slack over the service's work (its chain - S, >= 0); None when no job's
        chain reaches the service's work (ties: the lowest job id)."""
        ready_in = dict.fromkeys((q.job_id for q in queue), 0.0)
        for job_id, rest in view.due().items():
            ready_in.setdefault(job_id, rest)
        service = 0.0
        best: tuple[float, str] | None = None
        for job_id in sorted(ready_in):
            pace = view.pace(job_id)
            service += pace.rest_service
            chain = max(ready_in[job_id], 0.0) + pace.rest
            if best is None or chain > best[0]:
                best = (chain, job_id)
        if best is None or best[0] < service:
            return None
        return best[1], ready_in[best[1]], best[0] - service

    def _among(self, queue: Sequence[_Queued], now: float, view: _View, keep: Callable[[_Queued, float], bool]) -> int:
        """`inner`'s pick among the nodes `keep` accepts (given the node and its predicted time + its job's
        swap-in) and the nodes that have waited `age` x their time; -1 when there are none."""
        mine = []
        for i, q in enumerate(queue):
            sec = view.service_time(q)
            if keep(q, sec + view.swap_time(q.job_id)) or now - q.ready_at > self.age * max(sec, 1e-3):
                mine.append(i)
        if not mine:
            return -1
        i = self.inner.pick([queue[i] for i in mine], now, view)
        return mine[i] if i >= 0 else -1


__all__ = ["CriticalPath"]
