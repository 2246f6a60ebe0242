"""`Carrier`: the runner's hands. It carries out the planner's instructions on the executor, through ONE table
(instruction type -> the method that does it), and turns what the executor reports back into the planner's
events, calling the hooks on the way. It keeps the jobs' records (`JobRun`: status, history, artifacts) and
closes them.

It decides nothing: what runs where and when is the planner's (retries and their backoff included: `RetryNode` is
only logged and counted here), when to wait and what to feed the planner is the loop's (`runner.Runner`). Its handle
ledger (`ledger.py`, pure) keeps what is in flight under each handle and each job's current iteration (its nodes'
output handles: the data stays where the executor made it, their small metrics and durations); when the planner
closes an iteration, the carrier assembles the metrics row, calls the hooks and tells the executor to drop the
outputs. A checkpoint is the planner's work too (`RunCheckpoint`, `JobPlan.checkpoint_every`): the carrier asks
`checkpoint_at` where it goes, has the executor write it on the job's service, and reports its end
(`CheckpointFinished`). Anything that goes wrong with one job (its load, a node's submission, a swap) fails that job
only (docs invariant 5): `fail` returns the `JobFailed` event for the planner, and the job's later instructions are
dropped until the planner's `FailJob` comes back. The loop thread's alone: no lock (other threads reach the loop
through its inbox).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plexrl.hooks.base import HookList
from plexrl.job.spec import JobRun
from plexrl.planner import (
    CallArrived,
    CheckpointFinished,
    FailJob,
    IterationDone,
    JobDone,
    JobFailed,
    JobHeld,
    JobSubmitted,
    PlaceJob,
    Planner,
    RetryNode,
    RunCheckpoint,
    RunNode,
    StateMeasured,
)
from plexrl.planner.events import Event, Instruction
from plexrl.runtime.calls import CallBoard
from plexrl.runtime.executor import CheckpointReport, Executor, Finished, LoadReport, NodeTask
from plexrl.runtime.inbox import Inbox
from plexrl.runtime.ledger import Ledger
from plexrl.runtime.records import Iteration, Pending

log = logging.getLogger(__name__)


class Carrier:
    """See the module docstring. `forget_ended`: drop an ended job's record, planner entry and spec once the
    hooks and `on_closed` have seen it (a server's weeks of jobs); `on_closed`: called for every ended job,
    placed or not (the server's journal); `checkpoint_at(run, iteration)`: where a job's checkpoint goes (required
    for a job whose plan has a `checkpoint_every`: the planner sends `RunCheckpoint` after every k-th iteration
    but the last). `calls`: the sessions' calls (`calls.CallBoard`): a session's node takes its call there and
    its report's reply goes back there."""

    def __init__(
        self,
        executor: Executor,
        hooks: HookList,
        planner: Planner,
        inbox: Inbox,
        *,
        forget_ended: bool = False,
        on_closed: Callable[[JobRun], None] | None = None,
        checkpoint_at: Callable[[JobRun, int], Path] | None = None,
        calls: CallBoard | None = None,
    ) -> None:
        self.executor, self.hooks, self.planner, self.inbox = executor, hooks, planner, inbox
        self.clock = executor.clock
        self.forget_ended, self.on_closed, self.checkpoint_at = forget_ended, on_closed, checkpoint_at
        self.calls = calls
        self.runs: dict[str, JobRun] = {}
        self.late: list[JobRun] = []  # records of the jobs that came through `Runner.submit`
        self.ledger = Ledger()  # what is in flight under each handle, and each job's current iteration
        self.failing: set[str] = set()  # reported to the planner, its FailJob not yet received
        self._table: dict[type, Callable[[JobRun, Any], list[Event]]] = {
            PlaceJob: self._place,
            RunNode: self._run_node,
            RetryNode: self._retrying,
            IterationDone: self._iteration_done,
            RunCheckpoint: self._checkpoint,
            JobDone: self._job_done,
            FailJob: self._job_failed,
            JobHeld: self._job_held,
        }

    # -- instructions in ------------------------------------------------------------------------------
    def carry_out(self, ins: Instruction) -> list[Event]:
        """Do one instruction; the events it causes at once (a job that failed to load or to send a node)."""
        if ins.job_id in self.failing and not isinstance(ins, FailJob) and not getattr(ins, "cohort", ()):
            return []  # the job is being failed; do no more of its work (a cohort's other members still run)
        return self._table[type(ins)](self.runs[ins.job_id], ins)

    def _place(self, run: JobRun, ins: PlaceJob) -> list[Event]:
        run.status, run.service, run.started_at = "running", ins.service_id, self.clock()
        self.ledger.iters[run.job_id] = Iteration(self.clock())
        try:
            handle = self.executor.load(run.job_id, ins.service_id, ins.tier)
        except Exception as exc:  # (executors report a failed load; one that raises fails the job alone)
            self.hooks.on_job_start(run)
            return [self.fail(run, f"loading the job on {ins.service_id}", f"{type(exc).__name__}: {exc}")]
        self.ledger.sent(handle, Pending("load", run.job_id, ins.service_id))
        self.hooks.on_job_start(run)  # after the load is on its way: the hooks' set-up overlaps the job's load
        return []

    def _run_node(self, run: JobRun, ins: RunNode) -> list[Event]:
        if ins.cohort:
            return self._run_cohort(ins)
        lane = ins.service_id or "cpu"
        self.hooks.before_node(run, ins.iteration, ins.node, lane, self.clock())
        it = self.ledger.iters[run.job_id]
        outputs = it.outputs
        inputs = {port: outputs[src] for port, src in run.spec.inputs(ins.node).items() if src in outputs}
        last = ins.chunks > 1 and ins.chunk == ins.chunks - 1
        parts = tuple(it.parts.get(ins.node, ())) if last else ()  # the earlier chunks, joined by the last
        found, call = self.calls.call_of(run.job_id, ins.node) if self.calls is not None else (True, None)
        if not found:  # (a session's node runs its next call)
            return [self.fail(run, f"starting call {ins.node!r}", "no such call is waiting (runtime bug)")]
        task = NodeTask(
            run.job_id, ins.iteration, ins.node, ins.service_id, inputs, ins.swaps, ins.prefetch, ins.inline,
            ins.chunk, ins.chunks, parts, call,
        )  # fmt: skip
        try:
            handle = self.executor.submit(task)
        except Exception as exc:  # (executors report a node's errors; one that raises fails the job alone)
            return [self.fail(run, f"sending node {ins.node!r} to {lane}", f"{type(exc).__name__}: {exc}")]
        self.ledger.sent(handle, Pending("node", run.job_id, lane, ins.iteration, ins.node, task, ins.attempt))
        return []

    def _run_cohort(self, ins: RunNode) -> list[Event]:
        """A cohort (`planner/batches.py`): this node and `ins.cohort` go to the executor as one engine call
        (`submit_cohort`), swaps and prefetch with the first, a handle each; jobs being failed are left out."""
        lane = ins.service_id or "cpu"
        keys = [(ins.job_id, ins.iteration, ins.node), *ins.cohort]
        tasks: list[NodeTask] = []
        failed: list[Event] = []
        for job_id, iteration, node in keys:
            if job_id in self.failing:
                continue
            run = self.runs[job_id]
            found, call = self.calls.call_of(job_id, node) if self.calls is not None else (True, None)
            if not found:  # (a session's node runs its next call)
                failed.append(self.fail(run, f"starting call {node!r}", "no such call is waiting (runtime bug)"))
                continue
            self.hooks.before_node(run, iteration, node, lane, self.clock())
            outputs, first = self.ledger.iters[job_id].outputs, not tasks
            inputs = {port: outputs[src] for port, src in run.spec.inputs(node).items() if src in outputs}
            tasks.append(NodeTask(job_id, iteration, node, ins.service_id, inputs, ins.swaps if first else (),
                                  ins.prefetch if first else (), call=call))  # fmt: skip
        if not tasks:
            return failed
        submit_cohort = getattr(self.executor, "submit_cohort", None)
        try:
            if submit_cohort is None:
                raise TypeError(f"{type(self.executor).__name__} cannot run co-scheduled rollouts "
                                "(batch_rollouts); use driver: local or turn batch_rollouts off")  # fmt: skip
            handles = submit_cohort(tasks)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            return failed + [self.fail(self.runs[t.job_id], f"sending cohort {keys} to {lane}", error) for t in tasks]
        for handle, task in zip(handles, tasks, strict=True):
            self.ledger.sent(handle, Pending("node", task.job_id, lane, task.iteration, task.node, task, 1))
        return failed

    def _retrying(self, run: JobRun, ins: RetryNode) -> list[Event]:
        """The planner put a failed cpu node in backoff: log it and count the wait in the iteration's metrics."""
        log.warning(
            "job %s: node %s (iteration %d) failed (run %d of %d), again in %.2fs: %s",
            run.job_id, ins.node, ins.iteration, ins.attempt, ins.attempts, ins.delay, ins.error,
        )  # fmt: skip
        it = self.ledger.iters.get(run.job_id)
        if it is not None:
            it.seconds[f"retry_wait_{ins.node}"] = it.seconds.get(f"retry_wait_{ins.node}", 0.0) + ins.delay
            it.metrics.setdefault("retries", {})[ins.node] = float(ins.attempt)
        return []

    def _iteration_done(self, run: JobRun, ins: IterationDone) -> list[Event]:
        """Assemble the iteration's metrics (iteration -1 is the baseline pass, logged as step 0)."""
        now, iteration = self.clock(), ins.iteration
        it = self.ledger.iters[run.job_id]
        metrics = it.row(now if iteration >= 0 else None)
        if iteration >= 0:
            run.iterations_done += 1
        self.executor.forget(it.handles())
        self.ledger.iters[run.job_id] = Iteration(now)
        run.history.append(metrics)
        self.hooks.on_iteration_end(run, iteration, metrics)
        return []

    def _checkpoint(self, run: JobRun, ins: RunCheckpoint) -> list[Event]:
        """Have the executor write the job's checkpoint after `ins.iteration` where `checkpoint_at` says, on its
        service (`Executor.checkpoint`); one that cannot even be sent ends at once, failed (the job goes on)."""
        assert self.checkpoint_at is not None  # (`ship` refused a plan with checkpoints and nowhere to put them)
        try:
            path = self.checkpoint_at(run, ins.iteration)
            handle = self.executor.checkpoint(run.job_id, ins.service_id, path, {"iteration": ins.iteration})
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.error("job %s: checkpoint after iteration %d failed: %s", run.job_id, ins.iteration, error)
            return [CheckpointFinished(run.job_id, ins.iteration, False, error)]
        self.ledger.sent(handle, Pending("checkpoint", run.job_id, ins.service_id, ins.iteration))
        return []

    def _job_done(self, run: JobRun, ins: JobDone) -> list[Event]:
        self._end_job(run, "done", "", ins.service_id)
        return []

    def _job_held(self, run: JobRun, ins: JobHeld) -> list[Event]:
        run.held = ins.reason
        self.hooks.on_job_held(run, ins.reason)
        return []

    def _job_failed(self, run: JobRun, ins: FailJob) -> list[Event]:
        self.failing.discard(run.job_id)
        run.service_lost, run.again = ins.service_lost, ins.again
        self._end_job(run, "cancelled" if ins.cancelled else "failed", ins.reason, ins.service_id)
        return []

    # -- reports in, events out -----------------------------------------------------------------------
    def collect(self, f: Finished) -> list[Event]:
        """One finished handle: the hooks hear of it, and the planner gets its events."""
        p = self.ledger.take(f.handle)
        if p is None:
            self.executor.forget([f.handle])
            return []  # a lost service's late report, or a dropped job's
        run = self.runs[p.job_id]
        rep = f.report
        if isinstance(rep, LoadReport):
            if rep.error is not None:
                # its nodes sent with the load (none ran on a state that is not there)
                self.executor.forget(self.ledger.drop_nodes(run.job_id))
                return [self.fail(run, f"loading the job on {p.lane}", rep.error)]
            self.hooks.on_load(run, p.lane, rep.start, rep.end, rep.nbytes)
            return [StateMeasured(p.lane, run.job_id, rep.nbytes)]
        if isinstance(rep, CheckpointReport):
            if rep.error is not None:
                log.error("job %s: checkpoint after iteration %d failed: %s", run.job_id, p.iteration, rep.error)
            self.hooks.on_checkpoint(run, p.iteration, Path(rep.path), rep.error)
            return [CheckpointFinished(run.job_id, p.iteration, rep.error is None, rep.error, rep.end - rep.start)]
        events: list[Event] = [StateMeasured(p.lane, job_id, nbytes) for job_id, nbytes in rep.measured.items()]
        it = self.ledger.iters.get(run.job_id)
        if rep.swap_end > rep.swap_start:
            self.hooks.on_swap(run, p.lane, rep.swap_start, rep.swap_end, rep.swap_bytes)
        for move in rep.moves:  # every move the service made since its last report (any of its jobs')
            self.hooks.on_move(self.runs.get(move.job, run), p.lane, move)
        for kind, start, end, nbytes in rep.weight_loads:
            self.hooks.on_weight_load(run, p.lane, kind, start, end, nbytes)
            if it is not None:
                it.seconds[f"weight_{kind}"] = it.seconds.get(f"weight_{kind}", 0.0) + (end - start)
        self.hooks.after_node(run, rep.iteration, rep.node, p.lane, rep.start, rep.end, rep.metrics)
        finished, forget = self.ledger.node_report(f.handle, p, rep)
        if forget:
            self.executor.forget(forget)
        events.append(finished)
        if self.calls is not None and self.calls.has(run.job_id):  # a session: the reply goes to its client
            nxt = self.calls.finished(run.job_id, rep.reply, rep.error)
            if nxt is not None:  # its next call is waiting: announced after this one's end
                events.append(CallArrived(run.job_id, nxt))
        return events

    def fail(self, run: JobRun, what: str, error: str) -> JobFailed:
        """Work of the job outside a node went wrong: the event that tells the planner."""
        log.error("job %s: %s failed: %s", run.job_id, what, error)
        self.failing.add(run.job_id)
        return JobFailed(run.job_id, f"{what}: {error}")

    # -- records --------------------------------------------------------------------------------------
    def new_run(self, spec: Any, late: bool = False) -> JobRun:
        """The record of a job given to `run` (or, `late`, through `submit`: it replaces an earlier attempt's)."""
        if late:
            self.drop_attempt(spec.job_id)
        run = self.runs[spec.job_id] = JobRun(spec)
        if late:
            self.late.append(run)
        self.inbox.name(spec.job_id, True)
        return run

    def ship_all(self, runs: list[JobRun]) -> list[Event]:
        """`ship` the jobs submitted together, their specs sent to the executor at once (a thread each, up to 8: a
        Dask scatter is a round trip and a pickle); everything else on this thread, their events in order."""
        if len(runs) < 2:
            return [e for run in runs for e in self.ship(run)]
        from concurrent.futures import ThreadPoolExecutor

        def send(run: JobRun) -> Exception | None:
            try:
                self.executor.ship(run.spec)
            except Exception as exc:
                return exc
            return None

        plans = {run.job_id: self._plan(run) for run in runs}
        ready = [run for run in runs if plans[run.job_id] is not None]
        with ThreadPoolExecutor(max_workers=min(len(ready), 8) or 1, thread_name_prefix="ship") as pool:
            errors = list(pool.map(send, ready))
        return [e for run, exc in zip(ready, errors, strict=True) for e in self._shipped(run, plans[run.job_id], exc)]

    def ship(self, run: JobRun) -> list[Event]:
        """A job is submitted: ship its spec to the executor, and tell the planner (`JobSubmitted` with the
        spec's own plan). A job that cannot be shipped, or asks for checkpoints with nowhere to put them, fails
        alone."""
        plan = self._plan(run)
        if plan is None:
            return []
        try:
            self.executor.ship(run.spec)
        except Exception as exc:
            return self._shipped(run, plan, exc)
        return self._shipped(run, plan, None)

    def _plan(self, run: JobRun) -> Any:
        """The submitted job's plan; None (the job failed) if it checkpoints with nowhere to put them."""
        run.submitted_at = self.clock()
        plan = run.spec.plan()
        if plan.checkpoint_every and self.checkpoint_at is None:
            why = f"its plan checkpoints every {plan.checkpoint_every} iterations but this runner has no checkpoint_at"
            self.close(run, "failed", f"{why}: give the runner where checkpoints go, or set checkpoint_every: 0")
            return None
        return plan

    def _shipped(self, run: JobRun, plan: Any, exc: Exception | None) -> list[Event]:
        if exc is not None:
            self.close(run, "failed", f"could not ship the job to the executor: {type(exc).__name__}: {exc}")
            return []
        events: list[Event] = [JobSubmitted(run.job_id, plan)]
        first = self.calls.started(run.job_id) if self.calls is not None else None
        if first is not None:  # a session whose first call came before its job did
            events.append(CallArrived(run.job_id, first))
        return events

    def drop_attempt(self, job_id: str) -> None:
        """A job submitted again: forget what its previous attempt still has in flight or waiting."""
        self.executor.forget(self.ledger.drop_job(job_id))
        self.failing.discard(job_id)

    def _end_job(self, run: JobRun, status: str, reason: str, service_id: str | None) -> None:
        model_dir = run.spec.model_dir
        if status == "done" and service_id is not None and model_dir is not None:
            try:
                run.artifacts["model"] = self.executor.save(run.job_id, service_id, model_dir)
            except Exception:
                log.exception("could not save the final model of job %s", run.job_id)
        self.close(run, status, reason)
        if service_id is not None:
            try:
                self.executor.release(run.job_id, service_id)
            except Exception:
                log.exception("could not release job %s on %s", run.job_id, service_id)

    def close(self, run: JobRun, status: str, reason: str) -> None:
        run.status, run.error, run.finished_at = status, reason, self.clock()  # type: ignore[assignment]
        if status in ("failed", "cancelled") and self.runs.get(run.job_id) is run:
            self.inbox.name(run.job_id, False)
        if status == "failed":
            log.error("job %s failed: %s", run.job_id, reason)
        it = self.ledger.iters.pop(run.job_id, None)
        if it is not None:
            self.executor.forget(it.handles())
        if self.calls is not None and self.runs.get(run.job_id) is run:  # a session's calls left fail with it
            self.calls.drop(run.job_id, f"the session {status}" + (f": {reason}" if reason else ""))
        if run.started_at is not None:
            self.hooks.on_job_end(run)
        if self.on_closed is not None:  # every ended job, placed or not (the server's journal)
            self.on_closed(run)
        if self.forget_ended:
            self._forget(run)

    def _forget(self, run: JobRun) -> None:
        """`forget_ended`: drop an ended job from every table once the hooks and `on_closed` have seen it, so
        memory does not grow with the number of jobs ever run."""
        if self.runs.get(run.job_id) is run:
            del self.runs[run.job_id]
            self.inbox.name(run.job_id, False)
        self.late = [r for r in self.late if r is not run]
        self.drop_attempt(run.job_id)  # its work still in flight reports to nobody
        self.planner.forget(run.job_id)  # (a no-op until the planner has ended it too)
        self.executor.unship(run.job_id)

    def stop_open(self, reason: str) -> None:
        """`Runner.stop`: close every job that has not ended and forget the work in flight."""
        for run in list(self.runs.values()):
            if run.status in ("queued", "running"):
                self.close(run, "cancelled", reason)
        self.executor.forget(self.ledger.drop_all())

    def close_open(self, exc: BaseException) -> None:
        """The loop was interrupted (Ctrl-C, a required hook failed, a bug): close the running jobs."""
        for run in list(self.runs.values()):  # (a closed job may be forgotten: `forget_ended`)
            if run.status == "running":
                status = "cancelled" if isinstance(exc, KeyboardInterrupt) else "failed"
                self.close(run, status, f"interrupted: {type(exc).__name__}: {exc}".rstrip(": "))


__all__ = ["Carrier"]
