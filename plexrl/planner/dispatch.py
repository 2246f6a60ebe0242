"""Which queued node each service runs next (`Dispatcher`), a part of `core.Planner` with its own counters:
the ordering policy's pick, sent to run now or (lookahead) right after the running node, with the swaps that
make its job resident, the prefetch of the job most likely next, and (co-scheduled rollouts) the members of
its cohort (a session's sample call on an idle service may first wait, a bounded time, for the sample calls of
its partners: `batches.gather_until`; `holding` says until when, `wake_at` the earliest; one picked while other
work could run lets that work go first while its partners are busy there: `batches.keep_phase`). A job has at
most one service node sent at a time, and sent jobs' states are never evicted.

Pure: it changes the planner's records and appends `RunNode`s; the planner calls it once per event, for the
services that event concerned (`dirty`), and owns everything it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from plexrl.planner import ahead, checkpoints
from plexrl.planner.batches import cohort_jobs, gather, gather_until, keep_phase, start_cohort
from plexrl.planner.costs import CostModel
from plexrl.planner.events import Instruction, RunNode
from plexrl.planner.gaps import Lazy, next_use
from plexrl.planner.policies import OrderingPolicy, OrderingView
from plexrl.planner.records import InvalidTransition, JobRecord, NodeStatus, ServiceRecord
from plexrl.planner.slices import paused_jobs, slices_done
from plexrl.planner.state import Move, NoRoom
from plexrl.planner.views import next_job


@dataclass(slots=True)
class Dispatcher:
    """The planner's records and policies it dispatches with (shared, not copied), the state table's setter
    (`set_node`), the ordering view of a service, the history for an error, and its counters: nodes sent ahead
    (lookahead), times a pick was held back (`hold_ahead`), cohorts sent and their members, times an idle
    service waited for a cohort's partners (`batch_window` seconds at most: `batches.gather_until`), calls that
    let other work go first so that their partners catch up (`phase_window` at most: `batches.keep_phase`)."""

    jobs: dict[str, JobRecord]
    services: dict[str, ServiceRecord]
    costs: CostModel
    ordering: OrderingPolicy
    lookahead: bool
    hold_ahead: bool
    batch_rollouts: bool
    clock: Callable[[], float]
    set_node: Callable[[JobRecord, str, NodeStatus], None]
    view_of: Callable[[ServiceRecord], OrderingView]
    history: Callable[[str], str]
    batch_window: float = 0.0
    phase_window: float = 0.0
    holding: dict[str, float] = field(default_factory=dict)  # service -> until when it waits for partners
    keeping: dict[str, set[tuple[str, int, str]]] = field(default_factory=dict)  # service -> calls last held
    sent_ahead: int = 0
    held_ahead: int = 0
    cohorts_sent: int = 0
    cohort_members: int = 0
    partner_waits: int = 0
    phase_defers: int = 0

    def counts(self) -> dict[str, int]:
        """Its counters, by name."""
        names = ("sent_ahead", "held_ahead", "cohorts_sent", "cohort_members", "partner_waits", "phase_defers")
        return {name: getattr(self, name) for name in names}

    def wake_at(self) -> float | None:
        """When a service that waits for a cohort's partners stops waiting (the earliest); None: none waits."""
        return min(self.holding.values()) if self.holding else None

    def waited(self, now: float) -> set[str]:
        """The services whose wait for partners has ended by `now` (no longer waiting: dispatch them)."""
        over = {s for s, until in self.holding.items() if until <= now}
        for service_id in over:
            del self.holding[service_id]
        return over

    def dispatch(self, dirty: set[str], out: list[Instruction]) -> None:
        """Offer each service of `dirty` (in id order) its next work: a checkpoint first, alone
        (`checkpoints.py`), else a node when it runs none, and (lookahead) one more to run right after."""
        for service_id in sorted(dirty):
            before = self.holding.pop(service_id, None)  # (asked again: `one`)
            self.offer(self.services[service_id], out)
            after = self.holding.get(service_id)
            self.partner_waits += after is not None and after != before

    def offer(self, svc: ServiceRecord, out: list[Instruction]) -> None:
        """`dispatch` for one service."""
        if not svc.alive:
            return
        if svc.checkpoints or svc.checkpointing is not None:  # it goes next, alone (`checkpoints.py`)
            started = checkpoints.start(svc)
            if started is not None:
                out.append(started)
            return
        if not svc.queue:
            return
        if svc.running is None:
            self.one(svc, out)
        if self.lookahead and svc.running is not None and svc.next is None and svc.queue:
            self.one(svc, out)

    def in_phase(self, svc: ServiceRecord, candidates: list[int], now: float) -> tuple[list[int], list[int]]:
        """The candidates (queue indices) that may go now, and those held so that their partners catch up
        (`batches.keep_phase`), held only while something else may go. Counts the calls newly held."""
        if not self.batch_rollouts or self.phase_window <= 0.0:
            return candidates, []
        held = [i for i in candidates if keep_phase(svc, self.jobs, svc.queue[i], now, self.phase_window)]
        if not held or len(held) == len(candidates):
            return candidates, []
        keys = {(q.job_id, q.iteration, q.node) for q in (svc.queue[i] for i in held)}
        self.phase_defers += len(keys - self.keeping.get(svc.service_id, set()))
        self.keeping[svc.service_id] = keys
        return [i for i in candidates if i not in held], held

    def one(self, svc: ServiceRecord, out: list[Instruction]) -> None:
        """Send the ordering policy's pick to `svc`: to run now, or (lookahead) right after the running node."""
        now = self.clock()
        busy = {key[0] for key in (svc.running, svc.next) if key is not None} | cohort_jobs(svc)
        candidates = [i for i, q in enumerate(svc.queue) if q.job_id not in busy]
        if not candidates:
            return
        candidates, held = self.in_phase(svc, candidates, now)
        view = self.view_of(svc)
        use_in = Lazy(lambda: next_use(svc, self.jobs, self.costs.predict, now, self.ordering, view))
        pinned = busy | paused_jobs(svc, self.jobs)  # never evicted: jobs sent, paused generations (slices)
        while candidates:
            pick = self.ordering.pick([svc.queue[i] for i in candidates], now, view)
            if pick < 0:
                return  # the ordering waits for a job about to be ready (`Slowdown.hold_s`): the next event decides
            index = candidates[pick]
            q = svc.queue[index]
            why = ahead.waits(svc, self.jobs, q, busy, pinned, view, now, self.costs.predict, self.ordering,
                              partner=self.batch_rollouts, preferred=self.hold_ahead) if busy else None  # fmt: skip
            if why is not None:  # a partner (the cohort forms when the service frees) or a preferred node is due
                self.held_ahead += why == "preferred"
                return
            until = gather_until(svc, self.jobs, q, now, self.batch_window) if self.batch_rollouts else None
            if until is not None:  # idle sessions of its base may send their samples: wait for them, bounded
                self.holding[svc.service_id] = until
                return
            try:
                swaps = svc.state.make_resident(q.job_id, use_in, pinned)
                break
            except NoRoom as exc:
                if busy:  # lookahead: the device cannot hold it beside the running job; send it later
                    return
                if pinned <= {q.job_id}:  # budgets are validated at submission
                    raise InvalidTransition(self.history(str(exc))) from None
                candidates.remove(index)  # it cannot run beside a paused generation (kept resident); another may
                if not candidates:  # (what was kept in phase runs rather than nothing)
                    candidates, held = held, []
        else:
            return
        job = self.jobs[q.job_id]
        members, more = gather(svc, self.jobs, q, self.ordering, view, now, lambda j, keep: svc.state.make_resident(
            j, use_in, keep), pinned) if self.batch_rollouts else ([], [])  # fmt: skip
        swaps += more
        svc.queue.pop(index)
        taken = start_cohort(svc, q, members, ahead=svc.running is not None)
        svc.prefetching, svc.resident = None, q.job_id
        for entry in (q, *members):
            self.set_node(self.jobs[entry.job_id], entry.node, "running")
        if members:
            self.cohorts_sent, self.cohort_members = self.cohorts_sent + 1, self.cohort_members + len(taken)
        if svc.running is None:
            svc.running, svc.running_since = (q.job_id, q.iteration, q.node), now
        else:
            svc.next = (q.job_id, q.iteration, q.node)
            self.sent_ahead += 1
        prefetch: list[Move] = []
        after = self.view_of(svc)  # with q sent: its return counts
        use_in = Lazy(lambda: next_use(svc, self.jobs, self.costs.predict, now, self.ordering, after))
        nxt = next_job(svc, self.ordering, now, use_in, view, exclude=busy | taken)
        if nxt is not None:
            prefetch = svc.state.prefetch(nxt, use_in, pinned | taken)
            if prefetch:
                svc.prefetching = nxt
        chunks = job.plan.nodes[q.node].chunks
        out.append(RunNode(q.job_id, q.iteration, q.node, "service", svc.service_id, tuple(swaps), tuple(prefetch),
                           chunk=job.chunk.get(q.node, 0), chunks=chunks,
                           slice=slices_done(job, q.node),
                           cohort=tuple((m.job_id, m.iteration, m.node) for m in members)))  # fmt: skip


__all__ = ["Dispatcher"]
