"""`Controller`: the server's core. It keeps ONE `Runner` looping in a thread (`run(until_stopped=True)`), turns
accepted submissions into job specs on a small pool of preparation threads (`prepare_workers`; a warm start
may take a while: the runner never waits for it, and one user's cannot hold up another's), and writes every
transition to the `Journal` before anyone is told about it.

    HTTP handler --submit--> Journal (queued, committed) --> ack;  prepare pool: spec --> Runner.submit
    Runner thread: placement, iteration ends (JournalHook, journal_hook.py) and closes (Runner.on_closed) --> Journal

Contract:
- `submit` returns only after the job is in the journal; `cancel` records the cancel in the journal before it
  returns (the user's intent survives a crash), then asks the runner to stop the job at its next event.
- A job is handed to the runner at most once per server start; a cancelled job is never handed over. The
  controller's lock orders a cancel and a hand-over of the same job, so that the runner sees them in order.
- `stop` (SIGTERM): the runner closes every open job (its MLflow run ends KILLED) and the journal puts it back
  to `queued`; `start` of the next server on the same journal submits those jobs again, with one more
  `attempt`: from their latest checkpoint (`checkpoint_every`; the same MLflow run continues) or from
  scratch (a new MLflow run). Jobs whose MLflow run was left RUNNING by a crash (kill -9)
  get that run marked KILLED at the next start.
- The runner thread dying (a bug, or the journal failing to write: `JournalHook` is `required`) makes the
  controller unhealthy (`failure`); it accepts no more submissions.
- Preparation: queued jobs are prepared in arrival order by `prepare_workers` threads, and one user holds at
  most `prepare_workers - 1` of them (at least one): another user's job always finds a free thread, whatever
  the first user queued. Each preparation has a cancellation event, set by `cancel` (the journal says
  `cancelled`; nothing else is recorded) and by `stop` (the job stays `queued`; the next server prepares it
  again). A `prepare` that takes a `cancel` keyword gets the event and should raise soon after it is set
  (`prepare_entry`: between warm-start steps, `plexrl.job.models.PreparationCancelled`); whatever a cancelled
  preparation raises is not recorded as a failure. `stop` waits for every thread within ONE deadline.

Every job-level decision is the planner's, taken from the runner's thread and carried out here: per-user
admission and quotas (`cluster.max_jobs_per_user`, `max_share_per_user`: the planner holds a user's further
jobs queued, `planner/admission.py`; its reason reaches the journal through `JournalHook.on_job_held`), and
whether a job of a lost service is placed again (`FailJob.again`, from the job's `attempt` and `attempts`, which
the controller puts in its spec): then the controller requeues it in the journal and prepares it again, from its
latest checkpoint. The controller reads the planner only through its read API, on the runner's thread
(`Planner.node_costs` for a checkpoint); no thread reads another's state.

What it does NOT do: authentication (`user` is what the client says), or decide anything about placement.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from plexrl.hooks.base import Hook
from plexrl.job.spec import JobRun
from plexrl.planner import Planner
from plexrl.runtime.runner import Runner
from plexrl.server.journal import JobEntry, Journal
from plexrl.server.journal_hook import DurableJournal, JournalHook

log = logging.getLogger(__name__)

STOP_REASON = "the server stopped; the job runs again when it restarts (from its latest checkpoint, if any)"


RunnerFactory = Callable[..., Runner]
"""Builds the server's runner, whole: the controller calls it once, as `factory(more_hooks=[...],
on_closed=..., checkpoint_at=...)` (the last with checkpoints only; how often is each job's plan's), and gets a
`Runner` with those hooks after its own and those callbacks (`api.server_runner` is the server's; `runner_of`
makes one from `Runner`'s arguments)."""


def runner_of(
    executor: Any, *, planner: dict[str, Any] | None = None, hooks: list[Hook] | None = None, **options: Any
) -> RunnerFactory:
    """The factory of `Runner(executor, Planner(clock=executor.clock, **planner), hooks=[*hooks, *more_hooks],
    **options, on_closed=..., checkpoint_at=...)` (tests: a runner over any executor with any policies)."""

    def build(more_hooks: Sequence[Hook] = (), **parts: Any) -> Runner:
        plan = Planner(clock=executor.clock, **(planner or {}))
        return Runner(executor, plan, hooks=[*(hooks or []), *more_hooks], **options, **parts)

    return build


class Controller:
    """See the module docstring. `runner`: builds the server's runner (`RunnerFactory`): the controller adds its
    journal hook and callbacks at construction, nothing afterwards. `prepare(entry)` (or `prepare(entry,
    cancel=event)`) builds the runner's spec of a journal entry (its `job_id` must be `entry.job_id`); it runs on
    the preparation pool, `prepare_workers` jobs at a time."""

    def __init__(
        self,
        runner: RunnerFactory,
        journal: Journal,
        prepare: Callable[..., Any],
        *,
        checkpoint_every: int | None = None,
        checkpoint_dir: Path | None = None,
        max_attempts: int = 3,
        prepare_workers: int = 2,
    ) -> None:
        if prepare_workers < 1:
            raise ValueError(f"prepare_workers={prepare_workers}: give at least 1 preparation thread")
        self.journal, self.prepare = journal, prepare
        self.max_attempts = max_attempts  # every job's plan gets it (`JobSpec.attempts`): the planner decides
        self.prepare_workers = prepare_workers
        self._takes_cancel = _takes_cancel(prepare)
        self.checkpoint_dir = checkpoint_dir
        self._lock = threading.Lock()  # orders a cancel and a hand-over (or a placement) of the same job
        self.stopping = threading.Event()  # set once `stop` has asked the runner to stop
        hook = JournalHook(journal, self._cancel_in_runner, self._costs, checkpoint_every, checkpoint_dir, self._lock,
                           self.stopping)  # fmt: skip
        self.checkpoint_every = checkpoint_every or 0  # every job's plan gets it (`JobSpec.checkpoint_every`)
        ckpt: dict[str, Any] = {"checkpoint_at": hook.checkpoint_path} if checkpoint_every else {}
        self.runner = runner(more_hooks=[hook], on_closed=self._closed, **ckpt)
        self.failure: BaseException | None = None
        self.recovered: list[JobEntry] = []
        self._wake = threading.Condition(self._lock)  # the preparation threads wait on it for work
        self._todo: list[tuple[str, str]] = []  # (job id, user) to prepare, arrival order; guarded by _lock
        self._preparing: dict[str, tuple[threading.Event, str]] = {}  # job id -> (cancel, user); by _lock
        self._stopping = False
        self.on_end: Callable[[], None] = lambda: None  # told when a job ends (the housekeeping's wake)
        self._durable: Any = DurableJournal(journal, self.stopping)  # the runner's and preparations' writes
        self._threads: list[threading.Thread] = []

    def _cancel_in_runner(self, job_id: str, reason: str) -> None:
        self.runner.cancel(job_id, reason)

    def _costs(self, job_id: str) -> dict[str, float]:
        return self.runner.planner.node_costs(job_id)  # (the journal hook's: on the runner's thread)

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> list[JobEntry]:
        """Recover the journal's unfinished jobs (queued again), start the runner and preparation threads, and
        queue the recovered jobs; returns them."""
        self.recovered = self.journal.recover()
        for entry in self.recovered:
            close_stale_mlflow_run(entry)
        self._threads = [threading.Thread(target=self._run, name="plexrl-runner", daemon=True)]
        self._threads += [
            threading.Thread(target=self._prepare_loop, name=f"plexrl-prepare-{i}", daemon=True)
            for i in range(self.prepare_workers)
        ]
        for t in self._threads:
            t.start()
        for entry in self.recovered:
            after = entry.checkpoint_iteration
            how = "from scratch" if after is None else f"from the checkpoint after iteration {after}"
            log.info("job %s resubmitted (attempt %d, %s)", entry.job_id, entry.attempt, how)
            self._enqueue(entry.job_id, entry.user)
        return self.recovered

    def stop(self, timeout: float = 120.0) -> bool:
        """Graceful stop: no more hand-overs, every preparation is told to stop (its job stays `queued`), the
        runner closes every open job (journal: back to `queued`) and returns, its hooks close the MLflow runs.
        True if every thread ended within `timeout` seconds (one deadline for all of them)."""
        deadline = time.monotonic() + timeout
        with self._wake:
            self._stopping = True
            for cancel, _ in self._preparing.values():
                cancel.set()
            self._wake.notify_all()
        self.stopping.set()  # (first: a journal write waiting for disk space gives up)
        self.runner.stop(STOP_REASON)
        for t in self._threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        return not any(t.is_alive() for t in self._threads)

    @property
    def healthy(self) -> bool:
        return self.failure is None and bool(self._threads) and all(t.is_alive() for t in self._threads)

    # -- requests --------------------------------------------------------------------------------------
    def submit(self, name: str, config: dict[str, Any], iterations: int, user: str = "") -> JobEntry:
        """Record a validated job (durably) and queue it for preparation; returns its journal entry."""
        if self._stopping or self.failure is not None:
            raise RuntimeError("the server is stopping or has failed; it accepts no new jobs")
        entry = self.journal.submit(name, config, iterations, user)
        self._enqueue(entry.job_id, user)
        return entry

    def cancel(self, job_id: str, reason: str = "cancelled by user") -> JobEntry | None:
        """Cancel a job: recorded at once (None: no such job); the runner stops it at its next event. A job
        that already ended is left as it is."""
        with self._lock:
            entry = self.journal.get(job_id)
            if entry is None:
                return None
            if not entry.finished:
                self.journal.finish(job_id, "cancelled", reason)
                preparing = self._preparing.get(job_id)
                if preparing is not None:  # its preparation stops at its next check
                    preparing[0].set()
                self.runner.cancel(job_id, reason)
        self.on_end()
        return self.journal.get(job_id)

    def fail(self, job_id: str, reason: str) -> None:
        """End an open job as `failed` with `reason` (a server limit: `housekeeping`): recorded first, then the
        runner (or its preparation) stops it, as `cancel` does."""
        with self._lock:
            entry = self.journal.get(job_id)
            if entry is None or entry.finished:
                return
            self.journal.finish(job_id, "failed", reason)
            preparing = self._preparing.get(job_id)
            if preparing is not None:
                preparing[0].set()
            self.runner.cancel(job_id, reason)
        self.on_end()

    # -- threads ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.runner.run([], until_stopped=True)
        except BaseException as exc:
            log.exception("the runner stopped with an error; the server accepts no more jobs")
            self.failure = exc
            with self._wake:
                for cancel, _ in self._preparing.values():
                    cancel.set()
                self._wake.notify_all()

    def _enqueue(self, job_id: str, user: str) -> None:
        """Queue a job for preparation (any thread)."""
        with self._wake:
            self._todo.append((job_id, user))
            self._wake.notify()

    def _next_job(self) -> tuple[JobEntry, threading.Event] | None:
        """The next job to prepare (called with `_lock` held): the earliest queued job whose user holds fewer
        than `prepare_workers - 1` preparation threads (at least 1); None if none may start now. Marks it
        preparing, with its cancellation event."""
        cap = max(1, self.prepare_workers - 1)
        busy = Counter(user for _, user in self._preparing.values())
        i = 0
        while i < len(self._todo):
            job_id, user = self._todo[i]
            if busy[user] >= cap or job_id in self._preparing:
                i += 1
                continue
            del self._todo[i]
            entry = self.journal.get(job_id)
            if entry is None or entry.finished:
                continue  # cancelled while it waited: dropped
            cancel = threading.Event()
            self._preparing[job_id] = (cancel, entry.user)
            return entry, cancel
        return None

    def _prepare_loop(self) -> None:
        """One thread of the preparation pool: take the next job (`_next_job`), prepare it, hand it over."""
        while True:
            with self._wake:
                while True:
                    if self._stopping or self.failure is not None:
                        return
                    job = self._next_job()
                    if job is not None:
                        break
                    self._wake.wait()  # (notified by a new job, a preparation's end, a stop or a failure)
            entry, cancel = job
            try:
                self._prepare_one(entry, cancel)
            finally:
                with self._wake:
                    self._preparing.pop(entry.job_id, None)
                    self._wake.notify_all()  # its user may start another preparation now

    def _prepare_one(self, entry: JobEntry, cancel: threading.Event) -> None:
        job_id = entry.job_id
        try:
            spec = self.prepare(entry, cancel=cancel) if self._takes_cancel else self.prepare(entry)
            fields = getattr(spec, "__dataclass_fields__", {})
            if self.checkpoint_every and "checkpoint_every" in fields:  # the server's cadence, in the job's plan
                spec = dataclasses.replace(spec, checkpoint_every=self.checkpoint_every)
            if "attempts" in fields:  # which placement this is, of how many: the planner decides on a loss
                spec = dataclasses.replace(spec, attempt=entry.attempt, attempts=self.max_attempts)
            if entry.checkpoint is not None and "resume_costs" in fields:
                spec = dataclasses.replace(spec, resume_costs=self.journal.checkpoint_costs(job_id))
        except Exception as exc:
            if cancel.is_set():  # cancelled (the journal says so) or the server stops (the job stays queued)
                log.info("job %s: preparation stopped: %s: %s", job_id, type(exc).__name__, exc)
                return
            log.exception("preparing job %s failed", job_id)
            self._durable.finish(job_id, "failed", f"preparing the job failed: {type(exc).__name__}: {exc}")
            return
        with self._lock:  # a cancel (journal: cancelled) cannot come between this check and the hand-over
            now = self.journal.get(job_id)
            if now is None or now.finished or self._stopping:
                return
            self.runner.submit(spec)  # thread-safe; the planner holds it for its user's limits if it must

    def _closed(self, run: JobRun) -> None:
        """Runner.on_closed (runner thread): a job ended, placed or not. The planner decided whether a job of a
        lost service is placed again (`run.again`): then it is requeued here and prepared again."""
        if run.status == "cancelled" and run.error == STOP_REASON:
            self._durable.interrupt(run.job_id, STOP_REASON)
            return
        if run.status == "failed" and run.service_lost and run.again and not self._stopping:
            again = self._durable.requeue(run.job_id, run.error)
            if again is not None:
                after = again.checkpoint_iteration
                how = "from scratch" if after is None else f"from the checkpoint after iteration {after}"
                log.warning("job %s: %s; placed again %s (attempt %d)", run.job_id, run.error, how, again.attempt)
                self._enqueue(run.job_id, again.user)
                return
        self._durable.finish(run.job_id, run.status, run.error)
        if run.status == "done" and self.checkpoint_dir is not None:  # kept after a failure (for a post-mortem)
            shutil.rmtree(self.checkpoint_dir / run.job_id, ignore_errors=True)  # until the retention removes them
        self.on_end()


def _takes_cancel(prepare: Callable[..., Any]) -> bool:
    """Whether `prepare` accepts a `cancel` keyword (then it gets the job's cancellation event)."""
    try:
        return "cancel" in inspect.signature(prepare).parameters
    except (TypeError, ValueError):  # (a callable without a signature: called with the entry only)
        return False


def close_stale_mlflow_run(entry: JobEntry) -> None:
    """A job recovered from a crash may have left its MLflow run RUNNING: mark it KILLED (best effort)."""
    uri, run_id = entry.tracking.get("uri"), entry.tracking.get("run_id")
    if not uri or not run_id:
        return
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        if client.get_run(run_id).info.status == "RUNNING":
            how = "from scratch" if entry.checkpoint is None else "from its latest checkpoint"
            client.set_tag(run_id, "plexrl.error", f"the server died; the job was resubmitted {how}")
            client.set_terminated(run_id, status="KILLED")
    except Exception:
        log.exception("could not close the stale MLflow run %s of job %s", run_id, entry.job_id)


__all__ = ["STOP_REASON", "Controller", "JournalHook", "RunnerFactory", "close_stale_mlflow_run", "runner_of"]
