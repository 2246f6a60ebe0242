"""`Runner`: the ONE loop that feeds events to the planner and hands its instructions to an executor.

    events --> Planner.handle() --> instructions --> Runner --> Executor (inline | Dask | simulated)
      ^                                                             |
      +------- NodeFinished / StateMeasured / JobFailed / ServiceLost <-- Finished reports, lost services

The runner owns each job's record (`JobRun`: status, history, artifacts) and calls the hooks; the spec
(`JobSpec`) is frozen and shipped to the executor once. Its handle ledger (`runtime/ledger.py`, pure) keeps
what is in flight under each handle and, per job, the handles of the current iteration's node outputs (the
data stays where the executor made it), the nodes' small metrics and their durations; when the planner
closes an iteration the runner assembles the metrics row, calls the hooks, and tells the executor to drop
the outputs. Retries, their backoff and when to wake up are the planner's (`RetryNode`, `wake_at`, `Tick`).
Anything that goes wrong with one job (an operator raising, its engine failing to load, a swap failing, its
metrics failing to compute) fails that job only (DESIGN.md invariant 5): the runner reports it to the
planner and the other jobs go on. No scheduling decision is made here.

Threads: the loop runs on ONE thread, the only one that reads or writes the records (`runs`, the pending
handles, the iterations). Other threads (a server's HTTP handlers and preparation pool, a signal handler)
talk to it through its inbox only (`runtime/inbox.py`, the only lock): `submit`, `cancel` and `stop` queue a
request and wake the loop; `submit`'s duplicate-name check reads the names the loop keeps there. A job
whose load fails is failed alone: its nodes already sent are dropped (their reports reach nobody) and no more
are sent.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from plexrl.hooks.base import Hook, HookList, RunSummary
from plexrl.job import JobRun
from plexrl.planner import (
    FailJob,
    IterationDone,
    JobCancelled,
    JobDone,
    JobFailed,
    JobSubmitted,
    PlaceJob,
    Planner,
    RetryNode,
    RetryPlan,
    RunNode,
    ServiceLost,
    StateMeasured,
    Tick,
)
from plexrl.planner.costs import CostModel
from plexrl.planner.events import Event, Instruction, JobPlan
from plexrl.planner.policies import OrderingPolicy, PlacementPolicy
from plexrl.planner.shares import Usage
from plexrl.runtime.executor import CheckpointReport, Executor, Finished, LoadReport, NodeTask
from plexrl.runtime.inbox import Arrivals, Inbox
from plexrl.runtime.ledger import Ledger
from plexrl.runtime.records import Budgets, Iteration, Pending, RunnableSpec

log = logging.getLogger(__name__)

_RUNNING: weakref.WeakSet[Runner] = weakref.WeakSet()


def running_runners() -> list[Runner]:
    """The runners inside `run` in this process now (a SIGTERM handler stops them: `plexrl.server.signals`)."""
    return list(_RUNNING)


class Runner:
    """See the module docstring. `poll`: how long one `executor.wait` may block (the cancel and lost-service
    checks run at least this often); default: the executor's `poll` attribute if it has one (the simulator's
    is infinite: its clock only moves to the next event), else 0.5 s. Everything is given here and nothing is
    set afterwards: `usage` (the planner's fair-share account), `forget_ended` (drop ended jobs' records,
    planner entries and specs: the server's weeks of jobs; their runs are then missing from `runs` and from
    the summary hooks see at the end), `on_closed` (called for every ended job, placed or not: the server's
    journal) and `checkpoint_at` (where to checkpoint a job after an iteration; None: not then)."""

    def __init__(
        self,
        executor: Executor,
        *,
        hooks: list[Hook] | None = None,
        placement: PlacementPolicy | None = None,
        ordering: OrderingPolicy | None = None,
        costs: CostModel | None = None,
        budgets: Budgets | None = None,
        lookahead: bool = False,
        inline_below: float | None = None,
        validate: bool = False,
        poll: float | None = None,
        usage: Usage | None = None,
        forget_ended: bool = False,
        on_closed: Callable[[JobRun], None] | None = None,
        checkpoint_at: Callable[[JobRun, int], Path | None] | None = None,
    ) -> None:
        self.executor = executor
        self.clock = executor.clock
        self.hooks = HookList(hooks)
        self.budgets = budgets or Budgets()
        self.planner = Planner(
            clock=self.clock, placement=placement, ordering=ordering, validate=validate, costs=costs,
            lookahead=lookahead, inline_below=inline_below, usage=usage,
        )  # fmt: skip
        self.poll: float = poll if poll is not None else getattr(executor, "poll", 0.5)
        self.runs: dict[str, JobRun] = {}
        self.services: list[str] = []
        self.service_reports: dict[str, dict[str, Any]] = {}
        self.events_handled = 0
        self._ledger = Ledger()  # what is in flight under each handle, and each job's current iteration
        self._iter = self._ledger.iters
        self._failing: set[str] = set()  # reported to the planner, FailJob not yet received
        self._arrivals = Arrivals()  # jobs not yet submitted (the loop's alone)
        self._inbox = Inbox()  # what other threads ask: submit, cancel, stop (the only lock)
        self._late: list[JobRun] = []  # records of the jobs that came through `submit`
        self.on_closed = on_closed
        self.checkpoint_at = checkpoint_at
        self.forget_ended = forget_ended

    # -- public --------------------------------------------------------------------------------------
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
            self.runs[spec.job_id] = JobRun(spec)
            runs.append(self.runs[spec.job_id])
            self._inbox.name(spec.job_id, True)
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
            self._close_open_jobs(exc)
            raise
        finally:
            try:
                self.service_reports = self.executor.close()
            finally:
                end = self.clock()
                everyone = runs + self._late
                summary = RunSummary(everyone, self.services, self.service_reports, start or end, end, interrupted)
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
        while True:
            events.extend(self._take_submits())  # before the cancels: a job can be cancelled right after it came
            events.extend(self._take_cancels())
            events.extend(self._take_arrivals())
            if self._tick_due():
                events.append(Tick())  # a retry's backoff ended: the planner sends the node again
            while events:
                self.events_handled += 1
                for ins in self.planner.handle(events.popleft()):
                    events.extend(self._carry_out(ins))
            stopping = self._inbox.stopping
            if stopping is not None:
                self._stop_open_jobs(stopping)
                return
            if not self._ledger and not self._arrivals and self.planner.wake_at is None:
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
                raise RuntimeError("nothing is running but jobs are unfinished (runner bug)")
            timeout = self.poll
            if self._arrivals:  # wake up for the next arrival
                timeout = min(timeout, max(self._arrivals.next_time() - self.clock(), 0.0))
            wake = self.planner.wake_at
            if wake is not None:  # and when the planner asks to be woken (the end of a retry's backoff)
                timeout = min(timeout, max(wake - self.clock(), 0.0))
            finished = self.executor.wait(timeout)
            events.extend(self._services_changed())
            for f in finished:
                events.extend(self._collect(f))

    def _services_changed(self) -> list[Event]:
        """Services lost (their work in flight is gone) and services that joined (a replacement) since the
        last call."""
        events: list[Event] = []
        for service_id, reason in self.executor.lost():
            log.error("service %s lost: %s", service_id, reason)
            self._ledger.lost(service_id)
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

    def _take_arrivals(self) -> list[JobSubmitted]:
        """Submit (and ship) the jobs whose arrival time has come."""
        out = []
        now = self.clock()
        for job_id in self._arrivals.due(now):
            run = self.runs[job_id]
            run.submitted_at = now
            self.executor.ship(run.spec)
            out.append(JobSubmitted(job_id, plan_of(run.spec)))
        return out

    def _take_submits(self) -> list[JobSubmitted]:
        """Ship and submit the jobs that came through `submit`; a job that cannot be shipped fails alone."""
        out = []
        for spec in self._inbox.take_submits():
            self._drop_attempt(spec.job_id)
            run = self.runs[spec.job_id] = JobRun(spec)
            self._late.append(run)
            self._inbox.name(spec.job_id, True)
            run.submitted_at = self.clock()
            try:
                self.executor.ship(spec)
            except Exception as exc:
                self._close(run, "failed", f"could not ship the job to the executor: {type(exc).__name__}: {exc}")
                continue
            out.append(JobSubmitted(spec.job_id, plan_of(spec)))
        return out

    def _drop_attempt(self, job_id: str) -> None:
        """A job submitted again: forget what its previous attempt still has in flight or waiting."""
        self.executor.forget(self._ledger.drop_job(job_id))
        self._failing.discard(job_id)

    def _tick_due(self) -> bool:
        wake = self.planner.wake_at
        return wake is not None and wake <= self.clock()

    def _take_cancels(self) -> list[JobCancelled]:
        out = self._inbox.take_cancels()
        waiting = self._arrivals.waiting() if out and self._arrivals else set()
        if waiting & {c.job_id for c in out}:  # cancelled before it arrived: never submitted
            gone = {c.job_id: c.reason for c in out if c.job_id in waiting}
            self._arrivals.drop(set(gone))
            for job_id, reason in gone.items():
                self._close(self.runs[job_id], "cancelled", reason)
            out = [c for c in out if c.job_id not in gone]
        return out

    # -- instructions ---------------------------------------------------------------------------------
    def _carry_out(self, ins: Instruction) -> list[Event]:
        if ins.job_id in self._failing and not isinstance(ins, FailJob):
            return []  # the job is being failed; do no more of its work
        run = self.runs[ins.job_id]
        if isinstance(ins, RunNode):
            return self._submit(run, ins)
        elif isinstance(ins, RetryNode):
            self._retrying(run, ins)
        elif isinstance(ins, PlaceJob):
            run.status, run.service, run.started_at = "running", ins.service_id, self.clock()
            self._iter[run.job_id] = Iteration(self.clock())
            self.hooks.on_job_start(run)
            try:
                handle = self.executor.load(run.job_id, ins.service_id, ins.tier)
            except Exception as exc:  # (executors report a failed load; one that raises fails the job alone)
                return [self._fail(run, f"loading the job on {ins.service_id}", f"{type(exc).__name__}: {exc}")]
            self._ledger.sent(handle, Pending("load", run.job_id, ins.service_id))
        elif isinstance(ins, IterationDone):
            self._end_iteration(run, ins.iteration)
        elif isinstance(ins, JobDone):
            self._end_job(run, "done", "", ins.service_id)
        elif isinstance(ins, FailJob):
            self._failing.discard(run.job_id)
            run.service_lost = ins.service_lost
            self._end_job(run, "cancelled" if ins.cancelled else "failed", ins.reason, ins.service_id)
        return []

    def _submit(self, run: JobRun, ins: RunNode) -> list[Event]:
        lane = ins.service_id or "cpu"
        self.hooks.before_node(run, ins.iteration, ins.node, lane, self.clock())
        it = self._iter[run.job_id]
        outputs = it.outputs
        inputs = {port: outputs[src] for port, src in run.spec.inputs(ins.node).items() if src in outputs}
        last = ins.chunks > 1 and ins.chunk == ins.chunks - 1
        parts = tuple(it.parts.get(ins.node, ())) if last else ()  # the earlier chunks, joined by the last
        task = NodeTask(
            run.job_id, ins.iteration, ins.node, ins.service_id, inputs, ins.swaps, ins.prefetch, ins.inline,
            ins.chunk, ins.chunks, parts,
        )  # fmt: skip
        try:
            handle = self.executor.submit(task)
        except Exception as exc:  # (executors report a node's errors; one that raises fails the job alone)
            return [self._fail(run, f"sending node {ins.node!r} to {lane}", f"{type(exc).__name__}: {exc}")]
        self._ledger.sent(handle, Pending("node", run.job_id, lane, ins.iteration, ins.node, task, ins.attempt))
        return []

    def _retrying(self, run: JobRun, ins: RetryNode) -> None:
        """The planner put a failed cpu node in backoff: log it and count the wait in the iteration's metrics."""
        log.warning(
            "job %s: node %s (iteration %d) failed (run %d of %d), again in %.2fs: %s",
            run.job_id, ins.node, ins.iteration, ins.attempt, ins.attempts, ins.delay, ins.error,
        )  # fmt: skip
        it = self._iter.get(run.job_id)
        if it is not None:
            it.seconds[f"retry_wait_{ins.node}"] = it.seconds.get(f"retry_wait_{ins.node}", 0.0) + ins.delay
            it.metrics.setdefault("retries", {})[ins.node] = float(ins.attempt)

    # -- results --------------------------------------------------------------------------------------
    def _collect(self, f: Finished) -> list[Event]:
        p = self._ledger.take(f.handle)
        if p is None:
            self.executor.forget([f.handle])
            return []  # a lost service's late report
        run = self.runs[p.job_id]
        rep = f.report
        if isinstance(rep, LoadReport):
            if rep.error is not None:
                # its nodes sent with the load (none ran on a state that is not there)
                self.executor.forget(self._ledger.drop_nodes(run.job_id))
                return [self._fail(run, f"loading the job on {p.lane}", rep.error)]
            self.hooks.on_load(run, p.lane, rep.start, rep.end, rep.nbytes)
            return [StateMeasured(p.lane, run.job_id, rep.nbytes)]
        if isinstance(rep, CheckpointReport):
            if rep.error is not None:
                log.error("job %s: checkpoint after iteration %d failed: %s", run.job_id, p.iteration, rep.error)
            self.hooks.on_checkpoint(run, p.iteration, Path(rep.path), rep.error)
            return []
        events: list[Event] = [StateMeasured(p.lane, job_id, nbytes) for job_id, nbytes in rep.measured.items()]
        it = self._iter.get(run.job_id)
        if rep.swap_end > rep.swap_start:
            self.hooks.on_swap(run, p.lane, rep.swap_start, rep.swap_end, rep.swap_bytes)
        for kind, start, end, nbytes in rep.weight_loads:
            self.hooks.on_weight_load(run, p.lane, kind, start, end, nbytes)
            if it is not None:
                it.seconds[f"weight_{kind}"] = it.seconds.get(f"weight_{kind}", 0.0) + (end - start)
        self.hooks.after_node(run, rep.iteration, rep.node, p.lane, rep.start, rep.end, rep.metrics)
        finished, forget = self._ledger.node_report(f.handle, p, rep)
        if forget:
            self.executor.forget(forget)
        events.append(finished)
        return events

    def _fail(self, run: JobRun, what: str, error: str) -> JobFailed:
        log.error("job %s: %s failed: %s", run.job_id, what, error)
        self._failing.add(run.job_id)
        return JobFailed(run.job_id, f"{what}: {error}")

    def _end_iteration(self, run: JobRun, iteration: int) -> None:
        """Assemble the iteration's metrics (iteration -1 is the baseline pass, logged as step 0)."""
        now = self.clock()
        it = self._iter[run.job_id]
        metrics = it.row(now if iteration >= 0 else None)
        if iteration >= 0:
            run.iterations_done += 1
        self.executor.forget(it.handles())
        self._iter[run.job_id] = Iteration(now)
        run.history.append(metrics)
        self.hooks.on_iteration_end(run, iteration, metrics)
        path = self.checkpoint_at(run, iteration) if self.checkpoint_at is not None and iteration >= 0 else None
        if path is not None and run.service is not None:
            # runs on the service after the job's last node and before its next one (`Executor.checkpoint`)
            handle = self.executor.checkpoint(run.job_id, run.service, path, {"iteration": iteration})
            self._ledger.sent(handle, Pending("checkpoint", run.job_id, run.service, iteration))

    def _end_job(self, run: JobRun, status: str, reason: str, service_id: str | None) -> None:
        model_dir = run.spec.model_dir
        if status == "done" and service_id is not None and model_dir is not None:
            try:
                run.artifacts["model"] = self.executor.save(run.job_id, service_id, model_dir)
            except Exception:
                log.exception("could not save the final model of job %s", run.job_id)
        self._close(run, status, reason)
        if service_id is not None:
            try:
                self.executor.release(run.job_id, service_id)
            except Exception:
                log.exception("could not release job %s on %s", run.job_id, service_id)

    def _close(self, run: JobRun, status: str, reason: str) -> None:
        run.status, run.error, run.finished_at = status, reason, self.clock()  # type: ignore[assignment]
        if status in ("failed", "cancelled") and self.runs.get(run.job_id) is run:
            self._inbox.name(run.job_id, False)
        if status == "failed":
            log.error("job %s failed: %s", run.job_id, reason)
        it = self._iter.pop(run.job_id, None)
        if it is not None:
            self.executor.forget(it.handles())
        if run.started_at is not None:
            self.hooks.on_job_end(run)
        if self.on_closed is not None:  # every ended job, placed or not (the server's journal)
            self.on_closed(run)
        if self.forget_ended:
            self._forget(run)

    def _forget(self, run: JobRun) -> None:
        """A long-running loop (`forget_ended`): drop an ended job from every table once the hooks and
        `on_closed` have seen it, so memory does not grow with the number of jobs ever run."""
        if self.runs.get(run.job_id) is run:
            del self.runs[run.job_id]
            self._inbox.name(run.job_id, False)
        self._late = [r for r in self._late if r is not run]
        self._drop_attempt(run.job_id)  # its work still in flight reports to nobody
        self.planner.forget(run.job_id)  # (a no-op until the planner has ended it too)
        self.executor.unship(run.job_id)

    def _stop_open_jobs(self, reason: str) -> None:
        """`stop`: close every job that has not ended, forget the work in flight, and drop late submissions."""
        for run in list(self.runs.values()):
            if run.status in ("pending", "running"):
                self._close(run, "cancelled", reason)
        self.executor.forget(self._ledger.drop_all())
        self._inbox.drop_submits()

    def _close_open_jobs(self, exc: BaseException) -> None:
        for run in list(self.runs.values()):  # (a closed job may be forgotten: `forget_ended`)
            if run.status == "running":
                status = "cancelled" if isinstance(exc, KeyboardInterrupt) else "failed"
                self._close(run, status, f"interrupted: {type(exc).__name__}: {exc}".rstrip(": "))


def plan_of(spec: Any) -> JobPlan:
    """The job's plan as the planner gets it: `spec.plan()` with the retry policy of its config (`retry`), as
    the delays after each failed run; a spec without a config (the simulator's) has none."""
    plan: JobPlan = spec.plan()
    policy = getattr(getattr(spec, "config", None), "retry", None)
    if policy is None or plan.retry is not None:
        return plan
    delays = tuple(policy.delay(k) for k in range(1, policy.attempts))
    return dataclasses.replace(plan, retry=RetryPlan(policy.attempts, delays))


__all__ = ["Budgets", "RunnableSpec", "Runner", "plan_of", "running_runners"]
