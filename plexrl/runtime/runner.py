"""`Runner`: the ONE loop that feeds events to the planner and hands its instructions to an executor.

    events --> Planner.handle() --> instructions --> Carrier --> Executor (inline | Dask | simulated)
      ^                                                             |
      +-- NodeFinished / CheckpointFinished / StateMeasured / JobFailed / ServiceLost <-- reports, lost services

The loop and nothing else: it feeds the planner what came in (jobs submitted or arriving, cancels, a stop,
services lost or joined, a `Tick` once the clock reaches `Planner.wake_at`), gives each instruction to its
`Carrier` (`carrier.py`: one table from instruction to executor call; the jobs' records and the hooks), and
waits on the executor for finished work, which the carrier turns into the next events. No scheduling
decision is made here. Everything is given at construction; nothing is set on a runner afterwards.

Threads: the loop runs on ONE thread, the only one that reads or writes the records (`runs`, the ledger).
Other threads (a server's HTTP handlers and preparation pool, a signal handler) talk to it through its inbox
only (`inbox.py`, the only lock): `submit`, `cancel` and `stop` queue a request and wake the loop;
`submit`'s duplicate-name check reads the names the loop keeps there. A job whose load fails is failed
alone: its nodes already sent are dropped (their reports reach nobody) and no more are sent.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from plexrl.hooks.base import Hook, HookList, RunSummary
from plexrl.job.spec import JobRun
from plexrl.planner import JobCancelled, JobFailed, NodeFinished, Planner, ServiceLost, Tick, sessions
from plexrl.planner.events import Event
from plexrl.runtime.calls import CallBoard
from plexrl.runtime.carrier import Carrier
from plexrl.runtime.executor import Executor
from plexrl.runtime.inbox import Arrivals, Inbox
from plexrl.runtime.records import Budgets, RunnableSpec

log = logging.getLogger(__name__)

_RUNNING: weakref.WeakSet[Runner] = weakref.WeakSet()
CALL_POLL = 0.02  # seconds: the longest a session's call waits for the loop while other work runs


def running_runners() -> list[Runner]:
    """The runners inside `run` in this process now (a SIGTERM handler stops them: `plexrl.server.signals`)."""
    return list(_RUNNING)


class Runner:
    """See the module docstring. `planner`: the pure planner it feeds, built whole beforehand (from a runtime
    section: `Planner.from_config`; on the executor's clock). `poll`: how long one `executor.wait` may block
    (the cancel and lost-service checks run at least this often); default: the executor's `poll` attribute if
    it has one (the simulator's is infinite: its clock only moves to the next event), else 0.5 s. `budgets`:
    each service's tiers, given to the planner as the services join. `forget_ended`, `on_closed`,
    `checkpoint_at`: the carrier's (`Carrier`: a server's memory, its journal, where its checkpoints go; how
    often is each job's plan's). `calls`: the sessions' calls (`calls.CallBoard`; a server's Tinker API puts
    them there): while a session is open the loop looks at its inbox at least every `CALL_POLL` seconds, so a
    call waits at most that long for the planner. `bundle_calls`: whether a session's own sample calls sent at once
    run as one engine call (always where the planner batches rollouts); `bundle_window`: how long the first call of
    a session whose client sends its calls at once waits for the rest (`CallBoard.bind`)."""

    def __init__(
        self,
        executor: Executor,
        planner: Planner,
        *,
        hooks: list[Hook] | None = None,
        budgets: Budgets | None = None,
        poll: float | None = None,
        forget_ended: bool = False,
        on_closed: Callable[[JobRun], None] | None = None,
        checkpoint_at: Callable[[JobRun, int], Path] | None = None,
        calls: CallBoard | None = None,
        bundle_calls: bool = False,
        bundle_window: float = 0.0,
    ) -> None:
        self.executor = executor
        self.clock = executor.clock
        self.hooks = HookList(hooks)
        self.budgets = budgets or Budgets()
        self.planner = planner
        self.poll: float = poll if poll is not None else getattr(executor, "poll", 0.5)
        self.services: list[str] = []
        self.service_reports: dict[str, dict[str, Any]] = {}
        self.events_handled, self._arrivals = 0, Arrivals()  # (arrivals: jobs not yet submitted, the loop's alone)
        self._inbox = Inbox(self.clock)  # what other threads ask: submit, cancel, stop (the only lock)
        self.calls = calls
        if calls is not None:
            # a session's own sample calls sent at once run as one (`CallBoard.take`) with `bundle_calls` (a
            # cluster section's, `build_runner`) or where the planner batches rollouts
            bundle = self.planner.batch_rollouts or bundle_calls
            calls.bind(self._inbox.call_arrived, bundle=bundle, window=bundle_window)
        self.carrier = Carrier(executor, self.hooks, self.planner, self._inbox, forget_ended=forget_ended, on_closed=
                               on_closed, checkpoint_at=checkpoint_at, calls=calls)  # fmt: skip
        self.runs: dict[str, JobRun] = self.carrier.runs  # the jobs' records (the carrier keeps them)

    def cancel(self, job_id: str, reason: str = "cancelled by user") -> None:
        """Cancel one job (thread-safe, callable from a hook; takes effect at the next event). Its finished
        iterations stay recorded; the other jobs go on."""
        self._inbox.cancel(job_id, reason)

    def submit(self, spec: Any) -> None:
        """Add a job while the loop runs (thread-safe, callable from a hook or another thread). It is taken at
        the top of the loop's next turn, shipped and handed to the planner like a job given to `run`; its record
        appears in `runs` then. Raises ValueError if this runner already has a job of that name, unless that
        job failed or was cancelled (a lost service failed it, say): then it may come again under its name, its
        new record replaces the old one in `runs`, and nothing of the old attempt reaches it."""
        self._inbox.submit(spec)

    def close_session(self, job_id: str) -> None:
        """A session gets no more calls (thread-safe): it ends (done) once its call in flight, if any, ended
        (`planner/sessions.py`); calls of it still waiting fail."""
        self._inbox.close_session(job_id)

    def stop(self, reason: str = "stopped") -> None:
        """Stop the loop at the top of its next turn (thread-safe; a node already running is not interrupted,
        its result is dropped). Every unfinished job is closed as `cancelled` with `reason` (hooks see
        `on_job_end`, so MLflow runs end KILLED); `run` then returns as usual. Jobs submitted but not yet taken
        are dropped. This is how `run(until_stopped=True)` ends."""
        self._inbox.stop(reason)

    def run(
        self, specs: list[Any], arrivals: Mapping[str, float] | None = None, *, until_stopped: bool = False
    ) -> list[JobRun]:
        """Run the jobs to completion (or failure); returns their records, in the order given. `arrivals`:
        job id -> seconds after the start (on the executor's clock) at which that job is submitted; jobs not
        named there are submitted at the start. A job is shipped to the executor when it is submitted.
        `until_stopped`: do not return when every job has ended; wait for more (`submit`) until `stop` (the
        server's mode). `stop` also ends a run without it, early."""
        runs = []
        for spec in specs:
            if spec.job_id in self.runs:
                raise ValueError(f"two jobs are named {spec.job_id!r}; give each job a unique name")
            runs.append(self.carrier.new_run(spec))
        unknown = sorted(set(arrivals or {}) - set(self.runs))
        if unknown:
            raise ValueError(f"arrivals name jobs that are not in the run: {unknown}")
        bad = sorted(j for j, t in (arrivals or {}).items() if not (t >= 0 and math.isfinite(t)))
        if bad:
            raise ValueError(f"arrival times must be finite and >= 0 (seconds after the start); check {bad}")
        events: deque[Event] = deque()
        start: float | None = None
        interrupted = False
        _RUNNING.add(self)
        try:
            self.services = list(self.executor.start())
            events.extend(self.budgets.joined(s) for s in self.services)
            start = self.clock()
            self._arrivals.start((start + (arrivals or {}).get(r.job_id, 0.0), r.job_id) for r in runs)
            events.extend(self._take_arrivals())
            self.hooks.on_start(start)
            self._loop(events, until_stopped)
        except BaseException as exc:  # interrupted (Ctrl-C), a required hook failed, or a bug: keep records
            interrupted = True
            self.carrier.close_open(exc)
            raise
        finally:
            try:
                self.service_reports = self.executor.close()
            finally:
                end = self.clock()
                summary = RunSummary(runs + self.carrier.late, self.services, self.service_reports, start or end,
                                     end, interrupted)  # fmt: skip
                try:
                    self.hooks.on_end(summary)
                finally:
                    try:
                        self.hooks.close()
                    finally:
                        _RUNNING.discard(self)
        return runs

    # -- the loop -------------------------------------------------------------------------------------
    def _loop(self, events: deque[Event], until_stopped: bool = False) -> None:
        carrier, ledger = self.carrier, self.carrier.ledger
        while True:
            events.extend(self._take_submits())  # before the cancels: a job can be cancelled right after it came
            events.extend(self._take_cancels())
            events.extend(self._inbox.take_calls())  # sessions' calls (after a cancel: one that ended drops it)
            events.extend(self._take_arrivals())
            if (wake := self.planner.wake_at) is not None and wake <= self.clock():
                events.append(Tick())  # a retry's backoff ended: the planner sends the node again
            while events:
                self.events_handled += 1
                for ins in self.planner.handle(events.popleft()):
                    if self.calls is not None:  # replies first: an inline executor runs a node right here, and a
                        # reply held until it ends would keep its client waiting for another user's whole call
                        self.calls.deliver(lambda job_id: self._held(job_id) or _finishing(events, job_id))
                    events.extend(carrier.carry_out(ins))
            if self.calls is not None:  # sessions' replies, once the planner saw their calls end (`calls.py`)
                self.calls.deliver(self._held)
            stopping = self._inbox.stopping
            if stopping is not None:
                carrier.stop_open(stopping)
                self._inbox.drop_submits()
                return
            if not ledger and not self._arrivals and self.planner.wake_at is None:
                if self.planner.finished and until_stopped:
                    self._inbox.wait()  # idle: wait for a submission, a cancel or a stop
                    continue
                if self.planner.finished:
                    return
                if self._inbox.has_cancels():
                    continue
                if self.planner.pending and not any(s.alive for s in self.planner.services.values()):
                    events.extend(self._without_services(until_stopped))
                    continue
                if sessions.only_idle_left(self.planner.jobs.values()):
                    self._inbox.wait()  # sessions wait for their clients' calls (or a close, a cancel, a stop)
                    continue
                raise RuntimeError("nothing is running but jobs are unfinished (runner bug)")
            timeout = self.poll
            if self._arrivals:  # wake up for the next arrival
                timeout = min(timeout, max(self._arrivals.next_time() - self.clock(), 0.0))
            wake = self.planner.wake_at
            if wake is not None:  # and when the planner asks to be woken (the end of a retry's backoff)
                timeout = min(timeout, max(wake - self.clock(), 0.0))
            if self.calls is not None and self.calls.sessions():  # and often enough for a session's next call
                timeout = min(timeout, CALL_POLL)
            finished = self.executor.wait(timeout)
            events.extend(self._services_changed())
            # calls that came while a node ran queue before its end frees the service: cohorts can form
            events.extend(self._inbox.take_calls())
            for f in finished:
                events.extend(carrier.collect(f))

    def _held(self, job_id: str) -> bool:
        """Whether a session is held for the checkpoint after its latest call (its reply waits for it)."""
        job = self.planner.jobs.get(job_id)
        return job is not None and job.status == "running" and job.checkpoint is not None

    def _services_changed(self) -> list[Event]:
        """Services lost (their work in flight is gone) and joined (a replacement) since the last call."""
        events: list[Event] = []
        for service_id, reason in self.executor.lost():
            log.error("service %s lost: %s", service_id, reason)
            self.carrier.ledger.lost(service_id)
            events.append(ServiceLost(service_id, reason))
        for service_id in self.executor.joined():
            log.warning("service %s joined", service_id)
            self.services.append(service_id)
            events.append(self.budgets.joined(service_id))
        return events

    def _without_services(self, until_stopped: bool) -> list[Event]:
        """Jobs wait for a service and every service is lost: a server waits for one to join (`poll`); a run
        fails them."""
        if until_stopped and math.isfinite(self.poll):
            self._inbox.wait(self.poll)
            return self._services_changed()
        why = "every service is lost and none joined to replace them; start a service worker and submit it again"
        return [JobFailed(job_id, why) for job_id in self.planner.pending]

    def _take_arrivals(self) -> list[Event]:
        """Submit (and ship) the jobs whose arrival time has come."""
        return self.carrier.ship_all([self.runs[job_id] for job_id in self._arrivals.due(self.clock())])

    def _take_submits(self) -> list[Event]:
        """Ship and submit the jobs that came through `submit` (a job that cannot be shipped fails alone)."""
        return self.carrier.ship_all([self.carrier.new_run(spec, True) for spec in self._inbox.take_submits()])

    def _take_cancels(self) -> list[JobCancelled]:
        out = self._inbox.take_cancels()
        waiting = self._arrivals.waiting() if out and self._arrivals else set()
        if waiting & {c.job_id for c in out}:  # cancelled before it arrived: never submitted
            gone = {c.job_id: c.reason for c in out if c.job_id in waiting}
            self._arrivals.drop(set(gone))
            for job_id, reason in gone.items():
                self.carrier.close(self.runs[job_id], "cancelled", reason)
            out = [c for c in out if c.job_id not in gone]
        return out


def _finishing(events: deque[Event], job_id: str) -> bool:
    """Whether a node of `job_id` ended and the planner has not handled it yet: its reply waits for that (the
    planner may hold the session for a checkpoint after the call)."""
    return any(type(e) is NodeFinished and e.job_id == job_id for e in events)


__all__ = ["Budgets", "RunnableSpec", "Runner", "running_runners"]
