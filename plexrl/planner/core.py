"""The global planner: ONE pure state machine for all jobs and services.

`Planner.handle(event)` is the only mutator: it takes an event (service joined or lost, job submitted, node
or checkpoint finished, a state measured, job cancelled or failed, a tick) and returns the instructions a
runner must carry out (place job, run node with the swaps that make its job resident and a prefetch of the
next job's state, retry node, iteration done, run checkpoint, job done, fail job). `wake_at` says when it next
needs a `Tick` (a node's backoff ends), so the driver never decides when anything runs. Time comes from an
injected clock; nothing here sleeps, awaits, or imports Dask, torch or mlflow.

Each service has a pure `StateManager` (tiers device/host/disk with byte budgets); the planner asks it for
the moves before every service node. A `CostModel` fitted online to node durations and swap bandwidth
feeds the policies: predicted busy fraction for placement, predicted node and swap time for HRRS, and
predicted next use for choosing which state to evict or prefetch.

States and their one table: `records.py`; backoffs: `retries.py`; slices: `slices.py`; co-scheduled rollouts:
`batches.py`; checkpoints: `checkpoints.py`. Invariants (`validate()`, after every event in the runner and the
tests): `checks.py`; a job's service is fixed once placed (DESIGN.md invariant 2: `_admit` is the only place
that sets it).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from plexrl.planner import ahead, checkpoints, sessions
from plexrl.planner.batches import advance, gather, grouped_jobs, member_finished, start_group
from plexrl.planner.checks import any_violation, history
from plexrl.planner.costs import CostModel
from plexrl.planner.events import (
    CallArrived,
    CheckpointFinished,
    Event,
    FailJob,
    Instruction,
    IterationDone,
    JobCancelled,
    JobDone,
    JobFailed,
    JobSubmitted,
    NodeFinished,
    PlaceJob,
    RunNode,
    ServiceJoined,
    ServiceLost,
    SessionClosing,
    StateMeasured,
    Tick,
    Transition,
)
from plexrl.planner.gaps import busy_fraction, gap_after, next_use
from plexrl.planner.placing import admissions, emptied, leave
from plexrl.planner.policies import (
    Fifo,
    OrderingPolicy,
    OrderingView,
    PlacementPolicy,
    QueuedNode,
    Spread,
)
from plexrl.planner.records import (
    JOB_TRANSITIONS,
    NODE_TRANSITIONS,
    TERMINAL,
    InvalidTransition,
    JobRecord,
    JobStatus,
    NodeStatus,
    ServiceRecord,
)
from plexrl.planner.retries import Backoffs
from plexrl.planner.shares import Usage
from plexrl.planner.slices import paused_jobs, record_slice, slices_done
from plexrl.planner.state import Move, NoRoom, StateManager
from plexrl.planner.views import next_job, ordering_view


class Planner:
    """Events in, instructions out. See the module docstring."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        placement: PlacementPolicy | None = None,
        ordering: OrderingPolicy | None = None,
        validate: bool = False,
        costs: CostModel | None = None,
        lookahead: bool = False,
        hold_ahead: bool | None = None,
        inline_below: float | None = None,
        usage: Usage | None = None,
        batch_rollouts: bool = False,
        log_size: int = 200,
        max_instructions_per_event: int = 100_000,
    ) -> None:
        self.clock = clock
        self.placement: PlacementPolicy = placement or Spread()
        self.ordering: OrderingPolicy = ordering or Fifo()
        self.costs = costs or CostModel()
        # lookahead: while a service runs a node, the next one (of another job) is already chosen and sent,
        # so a driver whose round trip is not free (Dask) can start it the moment the first one ends
        self.lookahead = lookahead
        self.sent_ahead = 0  # nodes sent by lookahead (a statistic)
        # lookahead holds a pick back when a node the ordering prefers is due before the running one ends
        # (`ahead.hold`); None: as the ordering says (its `hold_ahead`: io-first's job classes gain from it, HRRS's
        # per-node ratios lose its early swaps and gain nothing)
        self.hold_ahead = hold_ahead if hold_ahead is not None else bool(getattr(self.ordering, "hold_ahead", False))
        self.held_ahead = 0  # times it did (a statistic)
        # a cpu node observed to take less than this (seconds) is marked `inline`: an executor whose pool
        # round trip costs more than the node itself may run it next to its inputs (None: never)
        self.inline_below = inline_below
        self.jobs: dict[str, JobRecord] = {}
        self.services: dict[str, ServiceRecord] = {}
        self.pending: list[str] = []  # queued job ids, in submission order
        self.log: deque[Transition] = deque(maxlen=log_size)
        self.validate_each_step = validate
        self.max_instructions = max_instructions_per_event
        self._seq = itertools.count()
        # admission is retried only after something that can change a placement: a service joined or was
        # lost, a job was submitted or ended, a state was measured smaller, or (load-aware placements) a job
        # finished an iteration (its predicted load settled)
        self._admission_due = True
        # services whose queue, running node, jobs or states an event may have changed: only these are
        # offered a dispatch (a service nothing happened to would make the same choice as before)
        self._dirty: set[str] = set()
        self._gaps: dict[str, dict[str, float]] = {}  # job -> node -> gap_after (see there)
        self._backing = Backoffs()  # jobs with a cpu node in backoff (`wake_at`)
        self.usage = usage or Usage()  # service seconds per user (fair-share ordering)
        # co-scheduled rollouts (`batches.py`): several jobs' batchable nodes in one engine call
        self.batch_rollouts = batch_rollouts
        self.groups_sent = self.grouped_nodes = 0  # groups sent, and their members, leads included (statistics)
        self._handlers: dict[type, Callable[[Any, list[Instruction]], None]] = {
            NodeFinished: self._node_finished,  # by far the most frequent
            ServiceJoined: self._service_joined,
            ServiceLost: self._service_lost,
            JobSubmitted: self._job_submitted,
            StateMeasured: lambda ev, out: self._state_measured(ev),
            JobCancelled: lambda ev, out: self._end_job(ev.job_id, "cancelled", ev.reason, out),
            JobFailed: lambda ev, out: self._end_job(ev.job_id, "failed", ev.reason, out),
            CheckpointFinished: self._checkpoint_finished,
            CallArrived: self._call_arrived,
            SessionClosing: self._session_closing,
            Tick: lambda ev, out: self._tick(out),
        }

    # -- the one entry point -----------------------------------------------------------------------
    def handle(self, event: Event) -> list[Instruction]:
        out: list[Instruction] = []
        self.log.append(Transition(self.clock(), event, out))
        kind = type(event)
        handler = self._handlers.get(kind)
        if handler is None:
            raise TypeError(f"unknown event {event!r}")
        handler(event, out)
        # the service this event concerns is offered a dispatch
        if kind is ServiceJoined:
            self._dirty.add(event.service_id)  # type: ignore[union-attr]
        elif kind is not ServiceLost and kind is not JobSubmitted and kind is not Tick:
            job = self.jobs.get(event.job_id)  # type: ignore[union-attr]
            if job is not None and job.service is not None:
                self._dirty.add(job.service)
        self._admit(out)
        self._dispatch(out)
        if len(out) > self.max_instructions:
            raise InvalidTransition(self._history(f"loop guard: {len(out)} instructions for one event"))
        if self.validate_each_step:
            self.validate()
        return out

    # -- handlers ------------------------------------------------------------------------------------
    def _service_joined(self, ev: ServiceJoined, out: list[Instruction]) -> None:
        if ev.service_id in self.services and self.services[ev.service_id].alive:
            raise InvalidTransition(self._history(f"service {ev.service_id!r} joined twice"))
        self._admission_due = True
        budgets = {"device": ev.device_bytes, "host": ev.host_bytes, "disk": ev.disk_bytes}
        self.services[ev.service_id] = ServiceRecord(ev.service_id, state=StateManager(ev.service_id, budgets))  # type: ignore[arg-type]

    def _service_lost(self, ev: ServiceLost, out: list[Instruction]) -> None:
        svc = self.services.get(ev.service_id)
        if svc is None or not svc.alive:
            return
        svc.alive = False
        self._admission_due = True
        for job_id in sorted(svc.jobs):
            self._end_job(job_id, "failed", f"service {ev.service_id!r} lost: {ev.reason}", out, lost=True)
        emptied(svc)

    def _state_measured(self, ev: StateMeasured) -> None:
        svc = self.services.get(ev.service_id)
        job = self.jobs.get(ev.job_id)
        if svc is None or job is None or job.service != ev.service_id or job.status in TERMINAL:
            return  # a late report
        if svc.state.measured(ev.job_id, ev.nbytes):
            self._admission_due = True  # a smaller state may leave room for a queued job

    def _job_submitted(self, ev: JobSubmitted, out: list[Instruction]) -> None:
        if ev.job_id in self.jobs and self.jobs[ev.job_id].status not in TERMINAL:  # an ended job may come again
            raise InvalidTransition(self._history(f"job {ev.job_id!r} submitted twice"))
        if ev.plan.iterations <= ev.plan.first_iteration or not ev.plan.nodes:
            self.jobs[ev.job_id] = JobRecord(ev.job_id, ev.plan, submitted_at=self.clock())
            self._end_job(ev.job_id, "failed", "a job needs at least one iteration and one node", out)
            return
        self.jobs[ev.job_id] = JobRecord.of(ev.job_id, ev.plan, self.clock())
        for learned, seconds in ev.plan.costs:
            if learned in ev.plan.nodes and seconds >= 0:
                self.costs.observe(ev.job_id, learned, seconds)
        self.pending.append(ev.job_id)
        self._admission_due = True

    def _node_finished(self, ev: NodeFinished, out: list[Instruction]) -> None:
        job = self.jobs.get(ev.job_id)
        if job is None or job.status in TERMINAL:
            return  # a late report of a job that already ended
        if ev.iteration != job.iteration or job.nodes.get(ev.node) != "running":
            raise InvalidTransition(self._history(f"unexpected finish of {ev.job_id}/{ev.iteration}/{ev.node}"))
        plan = job.plan.nodes[ev.node]
        job.cpu_started.pop(ev.node, None)
        runs = job.runs.pop(ev.node, 1)
        if ev.paused and (not ev.ok or plan.placement != "service"):
            raise InvalidTransition(self._history(f"{ev.node} of {ev.job_id} paused, but only a service node can"))
        if ev.ok:
            job.work_done += ev.duration
            seconds = record_slice(job, ev.node, ev.duration, ev.paused)  # a sliced node's: all its slices
            if not ev.paused:
                self.costs.observe(ev.job_id, ev.node, seconds)
                if job.plan.open:
                    sessions.observe_call(job, self.costs, seconds)
            self._gaps.pop(ev.job_id, None)
            self.costs.observe_swap(ev.swap_bytes, ev.swap_seconds)
        if plan.placement == "service":
            svc = self.services[job.service] if job.service else None
            key = (ev.job_id, ev.iteration, ev.node)
            if svc is None or (svc.running != key and key not in svc.group):
                raise InvalidTransition(self._history(f"{ev.node} of {ev.job_id} finished but was not running"))
            if not svc.group or member_finished(svc, key):
                advance(svc, self.clock())
            self.usage.add(job.plan.user, ev.duration + ev.swap_seconds, self.clock())
        if not ev.ok:
            retry = job.plan.retry
            if plan.placement == "cpu" and retry is not None and runs < retry.attempts:
                out.append(self._backing.back_off(job, ev, runs, self.clock(), self._set_node))
                return
            after = f" (after {runs} runs)" if runs > 1 else ""
            self._end_job(ev.job_id, "failed", f"node {ev.node!r} (iteration {ev.iteration}): {ev.error}{after}", out)
            return
        if ev.paused:  # a slice ended before its node: the next slice waits for the service like any node
            self._set_node(job, ev.node, "paused")
            self._queue(job, ev.node)
            return
        if plan.chunks > 1 and job.chunk.get(ev.node, 0) + 1 < plan.chunks:  # more chunks: queue the next
            job.chunk[ev.node] = job.chunk.get(ev.node, 0) + 1
            self._set_node(job, ev.node, "ready")
            self._queue(job, ev.node)
            return
        job.chunk.pop(ev.node, None)
        self._set_node(job, ev.node, "done")
        self._advance(job, out)

    # -- retries (`retries.Backoffs`) ------------------------------------------------------------------
    @property
    def wake_at(self) -> float | None:
        """When the planner next needs a `Tick` (the earliest end of a backoff); None: no event is due."""
        return self._backing.wake_at(self.jobs)

    def _tick(self, out: list[Instruction]) -> None:
        """Send again the cpu nodes whose backoff has ended, in job and node order."""
        for job, node, runs in self._backing.due(self.jobs, self.clock(), self._set_node):
            inline = self._tiny(job, node)
            out.append(RunNode(job.job_id, job.iteration, node, "cpu", None, inline=inline, attempt=runs))

    # -- job progress --------------------------------------------------------------------------------
    def _admit(self, out: list[Instruction]) -> None:
        if not self.pending or not self._admission_due:
            return
        self._admission_due = False
        alive = [s for s in self.services.values() if s.alive]
        if not alive:
            return
        still: list[str] = []
        for a in admissions(self.pending, self.jobs, alive, self.placement, self.job_load):
            if a.problem:
                self._end_job(a.job_id, "failed", a.problem, out, keep_pending=True)
                continue
            if a.target is None:
                still.append(a.job_id)
                continue
            if a.tier is None:
                raise InvalidTransition(self._history(f"placement chose {a.target} for {a.job_id} but it does not fit"))
            job, svc = self.jobs[a.job_id], self.services[a.target]
            self._set_job(job, "placed")
            job.service, job.placed_at = a.target, self.clock()
            svc.jobs.add(a.job_id)
            self._dirty.add(a.target)
            out.append(PlaceJob(a.job_id, a.target, a.tier))
            first = job.plan.first_iteration
            job.iteration = first - 1 if job.plan.open else -1 if job.plan.baseline else first
            self._reset_nodes(job)
            self._advance(job, out)
        self.pending = still

    def job_load(self, job_id: str) -> float:
        """Predicted busy fraction of a job on its service (`gaps.busy_fraction`)."""
        return busy_fraction(self.jobs[job_id], self.costs.predict)

    def _reset_nodes(self, job: JobRecord) -> None:
        """Node states for `job.iteration`: the baseline pass (-1) has only the baseline nodes, without their
        deps; a normal iteration has every node, those inactive this iteration already done; a session's has the
        node of its announced call, or none (`sessions.reset`)."""
        if job.plan.open:
            sessions.reset(job, self.clock())
            return
        if job.iteration < 0:
            job.nodes = {name: "waiting" for name in job.plan.baseline}
            job.remaining = len(job.nodes)
            return
        job.nodes = {name: "waiting" for name in job.plan.nodes}
        job.remaining = len(job.nodes)
        job.runs.clear()
        for name, node in job.plan.nodes.items():
            if not node.active(job.iteration, job.plan.iterations):
                self._set_node(job, name, "done")

    def _advance(self, job: JobRecord, out: list[Instruction]) -> None:
        """Make ready every waiting node whose deps are done; close iterations whose nodes are all done
        (a loop, not recursion: many iterations in a row may have nothing to run)."""
        while True:
            # one pass is enough: a node made ready here is not done, so it cannot unblock another
            nodes, plan = job.nodes, job.plan.nodes
            baseline = job.iteration < 0 and not job.plan.open
            names = job.plan.baseline if baseline else tuple(nodes) if job.plan.open else job.plan.order or tuple(plan)
            for name in names:
                if nodes[name] == "waiting" and (baseline or all(nodes[d] == "done" for d in plan[name].deps)):
                    self._make_ready(job, name, out)
            if job.remaining or (job.plan.open and not nodes):  # (an idle session: no call, no iteration)
                return
            out.append(IterationDone(job.job_id, job.iteration))
            if getattr(self.placement, "uses_load", True):
                self._admission_due = True  # its predicted load settled: a load-aware placement may change
            due = sessions.checkpoint_due(job) if job.plan.open else checkpoints.due(job.plan, job.iteration)
            if due:  # held until `CheckpointFinished` (`checkpoints.py`)
                checkpoints.hold(job, self.services[job.service])  # type: ignore[index]  # (placed)
                self._dirty.add(job.service)  # type: ignore[arg-type]
                return
            if not self._next_iteration(job, out):
                return

    def _next_iteration(self, job: JobRecord, out: list[Instruction]) -> bool:
        """Move a job whose iteration ended to its next one; False if that was its last (the job is done). A
        session runs its announced call next, else it closes (when asked) or waits for one."""
        if job.plan.open:
            if job.call is None and job.closing:
                self._end_job(job.job_id, "done", "", out)
                return False
            self._reset_nodes(job)
            return True
        job.iteration = job.plan.first_iteration if job.iteration < 0 else job.iteration + 1
        if job.iteration >= job.plan.iterations:
            self._end_job(job.job_id, "done", "", out)
            return False
        self._reset_nodes(job)
        return True

    def _checkpoint_finished(self, ev: CheckpointFinished, out: list[Instruction]) -> None:
        """A checkpoint ended (failed ones too: the job goes on): the service is free, the job goes on."""
        job = self.jobs.get(ev.job_id)
        if job is None or job.status in TERMINAL:
            return  # a late report of a job that already ended
        problem = checkpoints.finish(self.services[job.service], job, ev.iteration)  # type: ignore[index]
        if problem is not None:
            raise InvalidTransition(self._history(problem))
        self.usage.add(job.plan.user, ev.duration, self.clock())
        if self._next_iteration(job, out):
            self._advance(job, out)

    # -- sessions (`sessions.py`) ----------------------------------------------------------------------
    def _call_arrived(self, ev: CallArrived, out: list[Instruction]) -> None:
        job = self.jobs.get(ev.job_id)
        if job is None or job.status in TERMINAL:
            return  # a late call of a session that already ended (the runtime fails it)
        problem = sessions.call_arrived(job, ev.node, self.costs, self.clock())
        if problem is not None:
            raise InvalidTransition(self._history(problem))
        if job.status == "placed" and job.checkpoint is None:  # (queued, or held: it starts when that ends)
            self._reset_nodes(job)
            self._advance(job, out)

    def _session_closing(self, ev: SessionClosing, out: list[Instruction]) -> None:
        job = self.jobs.get(ev.job_id)
        if job is None or job.status in TERMINAL:
            return
        if not job.plan.open:
            raise InvalidTransition(self._history(f"{ev.job_id} is not a session; it cannot close"))
        job.closing = True
        if job.status == "queued":
            self._end_job(job.job_id, "cancelled", "the session closed before it was placed", out)
        elif sessions.idle(job):
            self._end_job(job.job_id, "done", "", out)

    def _make_ready(self, job: JobRecord, name: str, out: list[Instruction]) -> None:
        self._set_node(job, name, "ready")
        if job.plan.nodes[name].placement == "cpu":
            self._set_node(job, name, "running")
            job.cpu_started[name] = self.clock()
            out.append(RunNode(job.job_id, job.iteration, name, "cpu", None, inline=self._tiny(job, name)))
        else:
            self._queue(job, name)

    def _queue(self, job: JobRecord, name: str) -> None:
        q = QueuedNode(job.job_id, job.iteration, name, self.clock(), next(self._seq))
        self.services[job.service].queue.append(q)  # type: ignore[index]  # (a placed job has a service)

    def _tiny(self, job: JobRecord, name: str) -> bool:
        """Whether a cpu node is predicted to take less than `inline_below` (and may run inline at all)."""
        if self.inline_below is None or not job.plan.nodes[name].inline:
            return False
        return self.costs.observed(job.job_id, name) and self.costs.predict(job.job_id, name) < self.inline_below

    def _dispatch(self, out: list[Instruction]) -> None:
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, set()
        for service_id in sorted(dirty):  # services are offered dispatches in id order
            svc = self.services[service_id]
            if not svc.alive:
                continue
            if svc.checkpoints or svc.checkpointing is not None:  # it goes next, alone (`checkpoints.py`)
                started = checkpoints.start(svc)
                if started is not None:
                    out.append(started)
                continue
            if not svc.queue:
                continue
            if svc.running is None:
                self._dispatch_one(svc, out)
            if self.lookahead and svc.running is not None and svc.next is None and svc.queue:
                self._dispatch_one(svc, out)

    def _dispatch_one(self, svc: ServiceRecord, out: list[Instruction]) -> None:
        """Send the ordering policy's pick to `svc`: to run now, or (lookahead) right after the running node.
        A job has at most one service node sent at a time, and sent jobs' states are never evicted."""
        now = self.clock()
        busy = {key[0] for key in (svc.running, svc.next) if key is not None} | grouped_jobs(svc)
        candidates = [i for i, q in enumerate(svc.queue) if q.job_id not in busy]
        if not candidates:
            return
        view = self._ordering_view(svc)
        use_in = next_use(svc, self.jobs, self.costs.predict, now)
        pinned = busy | paused_jobs(svc, self.jobs)  # never evicted: jobs sent, paused generations (slices)
        while candidates:
            pick = self.ordering.pick([svc.queue[i] for i in candidates], now, view)
            if pick < 0:
                return  # the ordering waits for a job about to be ready (`Slowdown.hold_s`): the next event decides
            index = candidates[pick]
            q = svc.queue[index]
            why = ahead.waits(svc, self.jobs, q, busy, pinned, view, now, self.costs.predict, self.ordering,
                              partner=self.batch_rollouts, preferred=self.hold_ahead) if busy else None  # fmt: skip
            if why is not None:  # a partner (the group forms when the service frees) or a preferred node is due
                self.held_ahead += why == "preferred"
                return
            try:
                swaps = svc.state.make_resident(q.job_id, use_in, pinned)
                break
            except NoRoom as exc:
                if busy:  # lookahead: the device cannot hold it beside the running job; send it later
                    return
                if pinned <= {q.job_id}:  # budgets are validated at submission
                    raise InvalidTransition(self._history(str(exc))) from None
                candidates.remove(index)  # it cannot run beside a paused generation (kept resident); another may
        else:
            return
        job = self.jobs[q.job_id]
        members, more = gather(svc, self.jobs, q, self.ordering, view, now, lambda j, keep: svc.state.make_resident(
            j, use_in, keep), pinned) if self.batch_rollouts else ([], [])  # fmt: skip
        swaps += more
        svc.queue.pop(index)
        taken = start_group(svc, q, members, ahead=svc.running is not None)
        svc.prefetching, svc.resident = None, q.job_id
        for entry in (q, *members):
            self._set_node(self.jobs[entry.job_id], entry.node, "running")
        if members:
            self.groups_sent, self.grouped_nodes = self.groups_sent + 1, self.grouped_nodes + len(taken)
        if svc.running is None:
            svc.running, svc.running_since = (q.job_id, q.iteration, q.node), now
        else:
            svc.next = (q.job_id, q.iteration, q.node)
            self.sent_ahead += 1
        prefetch: list[Move] = []
        nxt = next_job(svc, self.ordering, now, use_in, view, exclude=busy | taken)
        if nxt is not None:
            prefetch = svc.state.prefetch(nxt, use_in, pinned | taken)
            if prefetch:
                svc.prefetching = nxt
        chunks = job.plan.nodes[q.node].chunks
        out.append(RunNode(q.job_id, q.iteration, q.node, "service", svc.service_id, tuple(swaps), tuple(prefetch),
                           chunk=job.chunk.get(q.node, 0), chunks=chunks,
                           slice=slices_done(job, q.node),
                           group=tuple((m.job_id, m.iteration, m.node) for m in members)))  # fmt: skip

    def _ordering_view(self, svc: ServiceRecord) -> OrderingView:
        return ordering_view(svc, self.jobs, self.costs, self.usage, self.gap_after, self.clock())

    def gap_after(self, job_id: str, node: str) -> float:
        """Predicted seconds from the end of `node` until its job can next use a service (`gaps.gap_after`).
        Cached per job until the job's next node finishes (its own observations move its predictions)."""
        cached = self._gaps.setdefault(job_id, {})
        gap = cached.get(node)
        if gap is None:
            gap = cached[node] = gap_after(self.jobs[job_id], node, self.costs.predict)
        return gap

    def _end_job(self, job_id: str, status: JobStatus, reason: str, out: list[Instruction], keep_pending: bool = False,
                 lost: bool = False) -> None:  # fmt: skip
        job = self.jobs.get(job_id)
        if job is None or job.status in TERMINAL:
            return
        self._set_job(job, status)
        self._admission_due = True
        self._gaps.pop(job_id, None)
        self._backing.discard(job_id)
        job.backoff.clear()  # (a job cancelled during a backoff: its node never runs again)
        job.reason, job.finished_at = reason, self.clock()
        if job_id in self.pending and not keep_pending:
            self.pending.remove(job_id)
        if job.service is not None:
            leave(self.services[job.service], job_id, self.clock())
        if status == "done":
            out.append(JobDone(job_id, job.service))
        else:
            out.append(FailJob(job_id, reason or status, job.service, status == "cancelled", lost))

    def forget(self, job_id: str) -> None:
        """Drop an ended job's record and its cost observations (a long-running server's memory). No-op for a
        job that has not ended."""
        job = self.jobs.get(job_id)
        if job is not None and job.status in TERMINAL:
            del self.jobs[job_id]
            self._gaps.pop(job_id, None)
            self.costs.forget(job_id)

    # -- state table ---------------------------------------------------------------------------------
    def _set_job(self, job: JobRecord, new: JobStatus) -> None:
        if (job.status, new) not in JOB_TRANSITIONS:
            raise InvalidTransition(self._history(f"job {job.job_id}: illegal {job.status} -> {new}"))
        job.status = new

    def _set_node(self, job: JobRecord, name: str, new: NodeStatus) -> None:
        old = job.nodes[name]
        if (old, new) not in NODE_TRANSITIONS:
            raise InvalidTransition(self._history(f"node {job.job_id}/{name}: illegal {old} -> {new}"))
        job.nodes[name] = new
        if new == "done":
            job.remaining -= 1

    # -- checks --------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every invariant (`checks.any_violation`); raise `InvalidTransition` with history on the first
        violation."""
        problem = any_violation(self.jobs, self.services)
        if problem is not None:
            raise InvalidTransition(self._history(problem))

    def _history(self, message: str) -> str:
        return history(self.log, message)

    @property
    def finished(self) -> bool:
        return all(j.status in TERMINAL for j in self.jobs.values())

    def idle_sessions(self) -> bool:
        """Whether the only jobs left are idle sessions waiting for their clients' calls (and queued jobs)."""
        left = [j for j in self.jobs.values() if j.status not in TERMINAL]
        idle = [j for j in left if j.status == "placed" and sessions.idle(j)]
        return bool(idle) and all(j.status == "queued" or j in idle for j in left)
