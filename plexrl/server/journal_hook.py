"""`JournalHook`: the runner's placements, iteration ends, held reasons and checkpoints written to the server's
`Journal`, and `DurableJournal`, the journal as the runner's thread writes it (a full disk waits for room instead
of stopping the runner). The controller builds the hook with the steps it calls back (the runner's `cancel`, the
planner's node costs) and its lock, and adds it to the runner's hooks; the hook imports neither.

What it does NOT do: decide anything (the planner decides when a job is checkpointed and whether it runs
again), or end a job in the journal (the controller's `Runner.on_closed` callback does).
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plexrl.hooks.base import Hook
from plexrl.job.spec import JobRun
from plexrl.server.journal import Journal

log = logging.getLogger(__name__)


class JournalHook(Hook):
    """Placements, iteration ends and checkpoints into the journal, and where a job is checkpointed
    (`checkpoint_path`, the runner's `checkpoint_at`: the planner checkpoints every job every `checkpoint_every`
    iterations, as work on the job's service, `planner/checkpoints.py`). Required: a journal that
    cannot be written stops the runner rather than letting it run jobs whose progress nobody would know about
    after a restart. Comes after the MLflow hook, whose run id it records. Iterations carry their real numbers
    (a resumed job's first is the one after its checkpoint: `JobPlan.first_iteration`).

    A checkpoint is written to a new file `<dir>/<job>/after-<iteration>.pt` (atomically), THEN journalled
    (`on_checkpoint`), THEN the previous file is removed: a crash at any point leaves the journal naming a
    complete file. A checkpoint that cannot be written (disk full) is journalled as `checkpoint_failed`; the
    job goes on and the previous checkpoint stays the one to resume from.

    A journal write that fails because the disk is full (`disk_full`) does not stop the runner: the hook waits
    (the runner's thread, so every job waits with it) and writes again every `DISK_RETRY_S` seconds until it
    succeeds (someone freed space; the retention sweep removed old checkpoints) or the server stops (`stopping`);
    meanwhile /health answers 503 (`housekeeping.DiskCheck`) and the server stays up. Nothing goes unjournalled."""

    required = True

    def __init__(
        self,
        journal: Journal,
        cancel: Callable[[str, str], None],
        costs: Callable[[str], dict[str, float]],
        checkpoint_every: int | None = None,
        checkpoint_dir: Path | None = None,
        lock: threading.Lock | None = None,
        stopping: threading.Event | None = None,
    ) -> None:
        # `cancel(job, reason)`: the runner's; `costs(job)`: the planner's node times, kept with a checkpoint
        self.journal: Any = DurableJournal(journal, stopping or threading.Event())
        self.cancel, self.costs = cancel, costs
        self.checkpoint_every, self.checkpoint_dir = checkpoint_every, checkpoint_dir
        # the controller's: a cancel (journal: cancelled) cannot come between the check and `placed`
        self.lock = lock or threading.Lock()

    def on_job_start(self, run: JobRun) -> None:
        tracking: dict[str, Any] = {k: str(run.tracking[k]) for k in ("uri", "run_id") if k in run.tracking}
        with self.lock:
            entry = self.journal.get(run.job_id)
            if entry is None or not entry.finished:
                self.journal.placed(run.job_id, run.service, tracking)
                return
        self.cancel(run.job_id, entry.reason or "cancelled")  # cancelled while it was being handed over

    def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        self.journal.iteration(run.job_id, iteration, metrics)

    def on_job_held(self, run: JobRun, reason: str) -> None:
        """The planner holds the job for its user's limits, or no longer does: its reason in the journal."""
        entry = self.journal.get(run.job_id)
        if entry is not None and not entry.finished:
            self.journal.set_reason(run.job_id, reason)

    def checkpoint_path(self, run: JobRun, iteration: int) -> Path:
        """Where the checkpoint of `run` after iteration `iteration` goes."""
        assert self.checkpoint_dir is not None
        return self.checkpoint_dir / run.job_id / f"after-{iteration}.pt"

    def on_checkpoint(self, run: JobRun, iteration: int, path: Path, error: str | None) -> None:
        if error is not None:
            self.journal.note(run.job_id, "checkpoint_failed", {"iteration": iteration, "error": error})
            return
        entry = self.journal.get(run.job_id)
        if entry is None or entry.finished:
            return  # ended meanwhile (done, cancelled): nothing will resume from it
        previous = entry.checkpoint
        self.journal.checkpoint(run.job_id, iteration, str(path), self.costs(run.job_id))
        if previous and previous != str(path):
            Path(previous).unlink(missing_ok=True)


DISK_RETRY_S = 5.0


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` says the disk (or the user's quota) is full: ENOSPC, EDQUOT, sqlite's SQLITE_FULL."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(exc, sqlite3.Error) and "full" in str(exc).lower()


class DurableJournal:
    """The journal as `JournalHook` writes it: every call that fails because the disk is full is made again every
    `DISK_RETRY_S` seconds until it succeeds or `stopping` is set (then it raises, as before)."""

    def __init__(self, journal: Journal, stopping: threading.Event) -> None:
        self._journal, self._stopping = journal, stopping

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._journal, name)
        if not callable(attr):
            return attr

        def durably(*args: Any, **kwargs: Any) -> Any:
            told = False
            while True:
                try:
                    return attr(*args, **kwargs)
                except (OSError, sqlite3.Error) as exc:
                    if not disk_full(exc) or self._stopping.is_set():
                        raise
                    if not told:
                        log.error("the journal cannot be written (%s): every job waits until the disk has room", exc)
                        told = True
                    self._stopping.wait(DISK_RETRY_S)

        return durably


__all__ = ["DISK_RETRY_S", "DurableJournal", "JournalHook", "disk_full"]
