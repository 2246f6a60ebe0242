"""The global planner: ONE pure state machine for all jobs and services.

`Planner.handle(event)` is the only mutator: it takes an event (service joined or lost, job submitted, node
or checkpoint finished, a state measured, job cancelled or failed, a tick) and returns the instructions a
runner must carry out (place job, run node with the swaps that make its job resident and a prefetch of the
next job's state, retry node, iteration done, run checkpoint, job done, fail job with whether it is placed
again, job held by its user's limits). `wake_at` says when it next needs a `Tick` (a node's backoff ends, a
quota lets a held job in), so the driver never decides when anything runs. Time comes from an injected clock;
nothing here sleeps, awaits, or imports Dask, torch or mlflow (invariant 1).

Each service has a pure `StateManager` (tiers device/host/disk with byte budgets); the planner asks it for
the moves before every service node. A `CostModel` fitted online to node durations and swap bandwidth
feeds the policies: predicted busy fraction for placement, predicted node and swap time for HRRS, and
predicted next use for choosing which state to evict or prefetch.

States and their one table: `records.py`; backoffs: `retries.py`; slices: `slices.py`; co-scheduled rollouts:
`batches.py`; checkpoints: `checkpoints.py`. Invariants (`validate()`, after every event in the runner and the
tests): `checks.py`; a job's service is fixed once placed (invariant 2, docs/architecture.md: `_place` is the
only place that sets it). The planner's parts, each given the records it shares and the few steps of the
planner it calls back (none imports this module): per-user admission and the queue, `admission.Admitter`; a
placed job's way through its iterations, `progress.Progress`; which node a service runs next,
`dispatch.Dispatcher`; the session events, `sessions.Sessions`. The read API for everything outside (`view`,
`node_costs`, `counts`): `views.py`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from plexrl.planner import checkpoints, sessions
from plexrl.planner.admission import Admitter, UserLimits
from plexrl.planner.batches import advance, member_finished
from plexrl.planner.checks import any_violation, history
from plexrl.planner.costs import CostModel
from plexrl.planner.dispatch import Dispatcher
from plexrl.planner.events import (
    CheckpointFinished,
    Event,
    FailJob,
    Instruction,
    JobCancelled,
    JobDone,
    JobFailed,
    JobSubmitted,
    NodeFinished,
    PlaceJob,
    RunNode,
    ServiceJoined,
    ServiceLost,
    StateMeasured,
    Tick,
    Transition,
)
from plexrl.planner.gaps import busy_fraction, gap_after
from plexrl.planner.placement import PlacementPolicy, Spread
from plexrl.planner.placing import emptied, leave
from plexrl.planner.policies import Fifo, OrderingPolicy, OrderingView
from plexrl.planner.progress import Progress
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
from plexrl.planner.sessions import Sessions
from plexrl.planner.settings import PlannerSettings, policies_of
from plexrl.planner.shares import Usage
from plexrl.planner.slices import record_slice
from plexrl.planner.state import StateManager, Tier
from plexrl.planner.views import PlannerView, ordering_view, planner_view


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
        batch_window: float = 0.0,
        phase_window: float = 0.0,
        user_limits: UserLimits | None = None,
        fair_admission: bool = False,
        exclusive: bool = False,
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
        self.exclusive = exclusive  # whole states out and in at each hand-over, no prefetch (`StateManager.exclusive`)
        # lookahead holds a pick back when a node the ordering prefers is due before the running one ends
        # (`ahead.hold`); None: as the ordering says (io-first's `hold_ahead`; HRRS loses its early swaps with it)
        self.hold_ahead = hold_ahead if hold_ahead is not None else bool(getattr(self.ordering, "hold_ahead", False))
        # a cpu node observed to take less than this (seconds) is marked `inline`: an executor whose pool
        # round trip costs more than the node itself may run it next to its inputs (None: never)
        self.inline_below = inline_below
        self.jobs: dict[str, JobRecord] = {}
        self.services: dict[str, ServiceRecord] = {}
        self.log: deque[Transition] = deque(maxlen=log_size)
        self.validate_each_step = validate
        self.max_instructions = max_instructions_per_event
        # services whose queue, running node, jobs or states an event may have changed: only these are
        # offered a dispatch (a service nothing happened to would make the same choice as before)
        self._dirty: set[str] = set()
        self._gaps: dict[str, dict[str, float]] = {}  # job -> node -> gap_after (see there)
        self._backing = Backoffs()  # jobs with a cpu node in backoff (`wake_at`)
        self.usage = usage or Usage()  # service seconds per user (fair-share ordering)
        # co-scheduled rollouts (`batches.py`): several jobs' batchable nodes in one engine call
        self.batch_rollouts = batch_rollouts
        # per-user admission (`admission.Admitter`): the queue, limits, users-first weighing, why a job is held
        self.user_limits = user_limits or UserLimits()
        self.fair_admission = fair_admission
        self._admission = Admitter(
            self.jobs, self.services, self.placement, self.user_limits, self.usage, fair_admission, clock,
            self.job_load, self._place, lambda job_id, why, out: self._end_job(job_id, "failed", why, out, True),
            self._history,
        )  # fmt: skip
        self._progress = Progress(self.services, self.costs, self.placement, self._admission, clock, inline_below,
                                  self._dirty, self._set_node, self._end_job)  # fmt: skip
        self._dispatcher = Dispatcher(
            self.jobs, self.services, self.costs, self.ordering, self.lookahead, self.hold_ahead, batch_rollouts,
            clock, self._set_node, self._ordering_view, self._history, batch_window, phase_window,
        )  # fmt: skip
        self._sessions = Sessions(self.jobs, self.costs, clock, self._progress.advance, self._end_job, self._history)
        self._handlers: dict[type, Callable[[Any, list[Instruction]], None]] = {
            NodeFinished: self._node_finished,  # by far the most frequent
            ServiceJoined: self._service_joined,
            ServiceLost: self._service_lost,
            JobSubmitted: self._job_submitted,
            StateMeasured: lambda ev, out: self._state_measured(ev),
            JobCancelled: lambda ev, out: self._end_job(ev.job_id, "cancelled", ev.reason, out),
            JobFailed: lambda ev, out: self._end_job(ev.job_id, "failed", ev.reason, out),
            CheckpointFinished: self._checkpoint_finished,
            **self._sessions.handlers(),  # CallArrived, SessionClosing (`sessions.Sessions`)
            Tick: lambda ev, out: self._tick(out),
        }

    @classmethod
    def from_config(
        cls, section: PlannerSettings, clock: Callable[[], float], costs: CostModel | None = None
    ) -> Planner:
        """The planner of a runtime section (`plexrl.runtime.config.RuntimeConfig`: its policies, resolved by
        `settings.policies_of`), on `clock` (the executor's)."""
        return cls(clock=clock, costs=costs, **policies_of(section))

    # -- the read API: frozen copies (`views.PlannerView`) and counters; never the records themselves ------------
    def view(self) -> PlannerView:
        """The services' queues and the jobs' states, copied (read by a controller, a page: `views.py`)."""
        return planner_view(self.jobs, self.services, self.held)

    def node_costs(self, job_id: str) -> dict[str, float]:
        """The cost model's predicted seconds per node of `job_id` (kept with a checkpoint: a resumed job's
        `JobPlan.costs`)."""
        return self.costs.of_job(job_id)

    def counts(self) -> dict[str, int]:
        """Nodes sent ahead (lookahead), times a pick was held back, co-scheduled cohorts sent and their members."""
        return self._dispatcher.counts()

    @property
    def pending(self) -> list[str]:
        """The queued jobs' ids, in submission order (`admission.Admitter`)."""
        return self._admission.pending

    @property
    def held(self) -> dict[str, str]:
        """Queued job -> why its user's limits hold it."""
        return self._admission.held

    sent_ahead = property(lambda self: self._dispatcher.sent_ahead, doc="Nodes sent ahead (`counts`).")

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
        self._admission.admit(out)
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
        self._admission.due = True
        budgets = {"device": ev.device_bytes, "host": ev.host_bytes, "disk": ev.disk_bytes}
        state = StateManager(ev.service_id, budgets, exclusive=self.exclusive,  # type: ignore[arg-type]
                             copy_engine=ev.copy_engine)  # fmt: skip
        self.services[ev.service_id] = ServiceRecord(ev.service_id, state=state)

    def _service_lost(self, ev: ServiceLost, out: list[Instruction]) -> None:
        svc = self.services.get(ev.service_id)
        if svc is None or not svc.alive:
            return
        svc.alive = False
        self._admission.due = True
        for job_id in sorted(svc.jobs):
            self._end_job(job_id, "failed", f"service {ev.service_id!r} lost: {ev.reason}", out, lost=True)
        emptied(svc)

    def _state_measured(self, ev: StateMeasured) -> None:
        svc = self.services.get(ev.service_id)
        job = self.jobs.get(ev.job_id)
        if svc is None or job is None or job.service != ev.service_id or job.status in TERMINAL:
            return  # a late report
        if svc.state.measured(ev.job_id, ev.nbytes):
            self._admission.due = True  # a smaller state may leave room for a queued job

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
        self._admission.pending.append(ev.job_id)
        self._admission.due = True

    def _node_finished(self, ev: NodeFinished, out: list[Instruction]) -> None:
        job = self.jobs.get(ev.job_id)
        if job is None or job.status in TERMINAL:
            return  # a late report of a job that already ended
        if ev.iteration != job.iteration or job.nodes.get(ev.node) != "running":
            raise InvalidTransition(self._history(f"unexpected finish of {ev.job_id}/{ev.iteration}/{ev.node}"))
        plan = job.plan.nodes[ev.node]
        job.cpu_started.pop(ev.node, None)
        runs = job.runs.pop(ev.node, 1)
        if ev.paused and (not ev.ok or plan.runs_on != "service"):
            raise InvalidTransition(self._history(f"{ev.node} of {ev.job_id} paused, but only a service node can"))
        if ev.ok:
            job.work_done += ev.duration
            seconds = record_slice(job, ev.node, ev.duration, ev.paused)  # a sliced node's: all its slices
            if not ev.paused:
                self.costs.observe(ev.job_id, ev.node, seconds)
                sessions.observe_call(job, self.costs, seconds)
            self._gaps.pop(ev.job_id, None)
            self.costs.observe_swap(ev.swap_bytes, ev.swap_seconds)
        if plan.runs_on == "service":
            svc = self.services[job.service] if job.service else None
            key = (ev.job_id, ev.iteration, ev.node)
            if svc is None or (svc.running != key and key not in svc.cohort):
                raise InvalidTransition(self._history(f"{ev.node} of {ev.job_id} finished but was not running"))
            if not svc.cohort or member_finished(svc, key):
                advance(svc, self.clock())
            self.usage.add(job.plan.user, ev.duration + ev.swap_seconds, self.clock())
        if not ev.ok:
            retry = job.plan.retry
            if plan.runs_on == "cpu" and retry is not None and runs < retry.attempts:
                out.append(self._backing.back_off(job, ev, runs, self.clock(), self._set_node))
                return
            after = f" (after {runs} runs)" if runs > 1 else ""
            self._end_job(ev.job_id, "failed", f"node {ev.node!r} (iteration {ev.iteration}): {ev.error}{after}", out)
            return
        if ev.paused:  # a slice ended before its node: the next slice waits for the service like any node
            self._set_node(job, ev.node, "paused")
            self._progress.queue(job, ev.node)
            return
        if plan.chunks > 1 and job.chunk.get(ev.node, 0) + 1 < plan.chunks:  # more chunks: queue the next
            job.chunk[ev.node] = job.chunk.get(ev.node, 0) + 1
            self._set_node(job, ev.node, "ready")
            self._progress.queue(job, ev.node)
            return
        job.chunk.pop(ev.node, None)
        self._set_node(job, ev.node, "done")
        self._progress.advance(job, out)

    # -- retries (`retries.Backoffs`) ------------------------------------------------------------------
    @property
    def wake_at(self) -> float | None:
        """When the planner next needs a `Tick` (a backoff's end, a quota-held job's way in, idle sessions' loads
        leaving room for a queued job, a session's sample call done waiting for partners); None: none due."""
        times = (self._backing.wake_at(self.jobs), self._admission.release_at, self._dispatcher.wake_at())
        due = [t for t in times if t is not None]
        return min(due) if due else None

    def _tick(self, out: list[Instruction]) -> None:
        """Send again the cpu nodes whose backoff has ended, in job and node order; weigh the held jobs again
        once a quota's release time has come; offer again the services done waiting for a cohort's partners."""
        self._admission.wake(self.clock())
        self._dirty.update(self._dispatcher.waited(self.clock()))
        for job, node, runs in self._backing.due(self.jobs, self.clock(), self._set_node):
            inline = self._progress.tiny(job, node)
            out.append(RunNode(job.job_id, job.iteration, node, "cpu", None, inline=inline, attempt=runs))

    # -- job progress --------------------------------------------------------------------------------
    def _place(self, job: JobRecord, service_id: str, tier: Tier, now: float, out: list[Instruction]) -> None:
        """Admission placed `job` on `service_id` (its state at `tier`): the only place a job's service is set."""
        self._set_job(job, "running")
        job.service, job.placed_at, job.reason = service_id, now, ""
        self.services[service_id].jobs.add(job.job_id)
        self._dirty.add(service_id)
        out.append(PlaceJob(job.job_id, service_id, tier))
        job.iteration = -1 if job.plan.baseline else job.plan.first_iteration
        job.start_iteration(now)
        self._progress.advance(job, out)

    def job_load(self, job_id: str, at: float | None = None) -> float:
        """Predicted busy fraction of a job on its service at time `at` (default now; `gaps.busy_fraction`: an
        idle session's falls while its client stays away)."""
        return busy_fraction(self.jobs[job_id], self.costs.predict, self.clock() if at is None else at)

    def _checkpoint_finished(self, ev: CheckpointFinished, out: list[Instruction]) -> None:
        """A checkpoint ended (failed ones too: the job goes on): the service is free, the job goes on."""
        job = self.jobs.get(ev.job_id)
        if job is None or job.status in TERMINAL:
            return  # a late report of a job that already ended
        problem = checkpoints.finish(self.services[job.service], job, ev.iteration)  # type: ignore[index]
        if problem is not None:
            raise InvalidTransition(self._history(problem))
        self.usage.add(job.plan.user, ev.duration, self.clock())
        if self._progress.next_iteration(job, out):
            self._progress.advance(job, out)

    def _dispatch(self, out: list[Instruction]) -> None:
        """Offer the services an event concerned their next work (`dispatch.Dispatcher`)."""
        if self._dirty:
            dirty = set(self._dirty)  # (shared with `progress.Progress`: emptied, not replaced)
            self._dirty.clear()
            self._dispatcher.dispatch(dirty, out)

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
        self._admission.due = True
        self._gaps.pop(job_id, None)
        self._backing.discard(job_id)
        job.backoff.clear()  # (a job cancelled during a backoff: its node never runs again)
        job.reason, job.finished_at = reason, self.clock()
        if job.service is not None:
            leave(self.services[job.service], job_id, self.clock())
        self._admission.drop(job_id, out, keep_pending)
        if status == "done":
            out.append(JobDone(job_id, job.service))
            return
        plan = job.plan
        again = lost and plan.attempt < plan.attempts  # placed again, from its latest checkpoint
        if lost and not again and plan.attempts > 1:
            reason += f" (attempt {plan.attempt} of at most {plan.attempts}: not placed again)"
            job.reason = reason
        out.append(FailJob(job_id, reason or status, job.service, status == "cancelled", lost, again))

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
        """Check every invariant (`checks.any_violation`); raise `InvalidTransition` with history on the first."""
        problem = any_violation(self.jobs, self.services)
        if problem is not None:
            raise InvalidTransition(self._history(problem))

    def _history(self, message: str) -> str:
        return history(self.log, message)

    @property
    def finished(self) -> bool:
        return all(j.status in TERMINAL for j in self.jobs.values())
