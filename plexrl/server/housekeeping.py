"""The server's upkeep, on one thread of its own (`Housekeeping`), and its disk check (`DiskCheck`):

- **time limit**: a running job placed more than `limits.max_run_s` seconds ago fails with the reason (its
  journal entry first, then the runner stops it at its next event, as a cancel does);
- **checkpoint retention**: the checkpoints of a cancelled or failed job are removed `checkpoint_retention_s`
  after it ended (a done job's are removed when it ends, by the controller); a directory of the checkpoint
  folder that no journalled job owns is left alone;
- **disk**: `DiskCheck.problem()` says why the disk of the journal and checkpoints is too full (free bytes under
  `min_free_disk`): /health answers 503 with it and submissions are refused (503), the server stays up.

It wakes every `every` seconds, and when `wake()` is called (a job ended); `stop()` ends it. Every pass reads the
journal (the truth) rather than memory, so a restart loses nothing: retention counts from the journalled end.
What it does NOT do: stop a job for its memory (a job's preparation and CPU nodes run in processes with their
own limits), or free space other than expired checkpoints.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class DiskCheck:
    """Free space of the disks holding `paths` (the nearest existing parent of each) against `min_free` bytes.
    `usage`: `shutil.disk_usage` (tests may give another)."""

    def __init__(self, paths: list[Path], min_free: int, usage: Callable[[str], Any] = shutil.disk_usage) -> None:
        self.paths, self.min_free, self.usage = paths, min_free, usage

    def problem(self) -> str | None:
        """Why the disk is too full now (free bytes under `min_free`), or None."""
        for path in self.paths:
            where = path
            while not where.exists() and where != where.parent:
                where = where.parent
            try:
                free = int(self.usage(str(where)).free)
            except OSError as exc:
                return f"cannot read the free space of {where}: {exc.strerror}"
            if free < self.min_free:
                return (
                    f"the disk of {path} has {free / 2**20:.1f} MiB free, under min_free_disk "
                    f"({self.min_free / 2**20:.1f} MiB): free some space (old checkpoints, runs); the server "
                    "accepts jobs again once there is room"
                )
        return None


class Housekeeping:
    """See the module docstring. `journal`, `controller`: the server's; `checkpoints`: the checkpoint folder;
    `max_run_s`, `retention_s`: the limits (None: no time limit)."""

    def __init__(
        self,
        journal: Any,
        controller: Any,
        checkpoints: Path,
        *,
        max_run_s: float | None,
        retention_s: float,
        every: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.journal, self.controller, self.checkpoints = journal, controller, checkpoints
        self.max_run_s, self.retention_s, self.every, self.clock = max_run_s, retention_s, every, clock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="plexrl-housekeeping", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def wake(self) -> None:
        """Run a pass soon (a job ended)."""
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except Exception:
                log.exception("housekeeping pass failed; trying again at the next")
            self._wake.wait(self.every)
            self._wake.clear()

    def sweep(self) -> None:
        """One pass: time limits, then expired checkpoints."""
        now = self.clock()
        if self.max_run_s is not None:
            for entry in self.journal.jobs("running", 100_000):
                if entry.started_at is not None and now - entry.started_at > self.max_run_s:
                    why = (
                        f"ran for more than this server's limit of {self.max_run_s:g} s per placement "
                        "(limits.max_run_s): stopped; lower its iterations, or ask the owner to raise the limit"
                    )
                    log.warning("job %s: %s", entry.job_id, why)
                    self.controller.fail(entry.job_id, why)
        if not self.checkpoints.is_dir():
            return
        for folder in self.checkpoints.iterdir():
            entry = self.journal.get(folder.name) if folder.is_dir() else None
            if entry is None or not entry.finished:
                continue  # not a job's, or still open: kept
            ended = entry.finished_at or 0.0
            if entry.status == "done" or now - ended >= self.retention_s:
                shutil.rmtree(folder, ignore_errors=True)
                log.info("job %s (%s): checkpoints removed", entry.job_id, entry.status)


__all__ = ["DiskCheck", "Housekeeping"]
