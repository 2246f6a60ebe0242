"""The server's durable journal: every job's submission, placement, iteration ends and terminal state, in one
sqlite file in WAL mode.

Contract:
- Every method that records something commits before it returns (`synchronous=FULL`: the WAL is fsynced on
  each commit, so a returned write survives a crash of the process and of the machine). The server answers a
  client only after the write returned: what a client was told is in the journal.
- A job's status moves along `TRANSITIONS` only; an illegal move raises `JournalError` with the job's recent
  events. Reaching a terminal status twice is not an error: the first one wins and the second is ignored
  (`finish` returns False), because a user's cancel is recorded at once while the runner closes the job a
  moment later.
- `recover()` (at server start) turns every unfinished job back into `queued`, counting one more attempt.
  A job resumes from its latest checkpoint (`checkpoint`, written by the server every `checkpoint_every`
  iterations) or, without one, from scratch; the iterations of an earlier attempt stay in `events` (with
  their attempt number), and those after the checkpoint are run again.
- Thread-safe: one connection guarded by a lock (the HTTP handlers, the runner thread and the preparation
  thread all write). Reads take the same lock; a read is a few indexed rows.
- One owner: a `Journal` holds an exclusive `flock` on `<journal>.lock` (next to the file, which records the
  owner's pid, host and start time) from opening to `close()`; the kernel releases it when the process dies,
  even by kill -9. A second `Journal` on the same file, in this process or another, raises `JournalError`
  naming the owner: two servers on one journal would each recover and run the other's jobs.
- A file that is not a readable journal (not sqlite, truncated or damaged, another program's tables, a
  newer version) raises `JournalError` at opening, with what to do; nothing is written to it.
- `done` means every iteration is recorded: `finish(job, "done")` checks that the current attempt journalled
  iterations `start..iterations-1` (`start`: 0, or the iteration after the checkpoint that attempt resumed
  from, i.e. the latest checkpoint journalled by an earlier attempt). If any is missing, the job is recorded
  `failed` instead, with a reason naming the missing iterations (and `finish` still returns True). It is
  not raised: `finish` runs on the runner thread, where an exception stops the whole server for every job,
  while a failed job is consistent (terminal, with its recorded iterations) and its user can resubmit it.

What it does NOT do: it keeps no model weights or optimizer state (a checkpoint is a file; the journal keeps
its path once it is written and fsynced), and no MLflow data (the journal keeps the run id).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plexrl.server.journal_records import (
    COLUMNS,
    SCHEMA,
    TERMINAL,
    TRANSITIONS,
    VERSION,
    JobEntry,
    JobStatus,
    JournalError,
    JournalEvent,
)

log = logging.getLogger(__name__)


class Journal:
    """See the module docstring. `path`: the sqlite file (created with its directory); `clock`: wall time."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self._lock = threading.Lock()
        self._owner = self._own()  # before sqlite touches the file: a second owner never reads or writes it
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except sqlite3.Error as exc:
            self._disown()
            raise JournalError(
                f"{self.path}: cannot open the journal ({exc}); check the path and its permissions"
            ) from None
        self._db.row_factory = sqlite3.Row
        try:
            self._open()
        except (sqlite3.DatabaseError, JournalError) as exc:
            self._db.close()
            self._disown()
            if isinstance(exc, JournalError):
                raise
            raise JournalError(
                f"{self.path} is not a readable PlexRL journal ({exc}): it is damaged (truncated, overwritten) or "
                "another program's file. Nothing was written to it. Restore it from a backup, or move it away to "
                "start with an empty journal (its jobs are then forgotten; `sqlite3 FILE .recover` may save rows)"
            ) from None

    def _open(self) -> None:
        """Check what is there (reading only), then WAL mode, durable commits, and the schema: created in a new
        file, checked in an existing one."""
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, VERSION):
            raise JournalError(
                f"{self.path}: journal version {version}, this server reads version {VERSION}; run the plexrl "
                "version that wrote it, or give this server another journal"
            )
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        foreign = tables - set(COLUMNS) - {"sqlite_sequence"}
        if version == 0 and foreign:
            raise JournalError(
                f"{self.path} is not a PlexRL journal (it holds the tables {', '.join(sorted(foreign))}); point "
                "`journal` at a new file, or at the journal.db a PlexRL server wrote"
            )
        check = self._db.execute("PRAGMA quick_check(1)").fetchone()[0]  # reads every page once
        if check != "ok":
            raise sqlite3.DatabaseError(check)
        if version == VERSION:
            self._check_columns()
        mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise JournalError(f"{self.path}: sqlite refused WAL mode (got {mode!r}); put the journal on a local disk")
        self._db.execute("PRAGMA synchronous=FULL")
        if version == 0:  # a new journal (IF NOT EXISTS: a crash half-way through is repaired next time)
            self._db.executescript(SCHEMA + f"PRAGMA user_version={VERSION};")
            self._check_columns()  # (tables of ours left by such a crash, or by another program)

    def _check_columns(self) -> None:
        for table, needed in COLUMNS.items():
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            if not needed <= have:
                missing = ", ".join(sorted(needed - have))
                raise JournalError(
                    f"{self.path}: the table {table!r} lacks {missing}: not a journal of this version "
                    f"({VERSION}); restore it from a backup or give this server another journal"
                )

    def _own(self) -> int:
        """Take the journal's lock file (see the module docstring); returns its descriptor."""
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise JournalError(
                f"{self.path}: cannot create its lock file {lock} ({exc}); check the permissions"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if not isinstance(exc, BlockingIOError):
                os.close(fd)
                raise JournalError(
                    f"{self.path}: cannot lock {lock} ({exc}); put the journal on a local disk"
                ) from None
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "a process that did not say"
            os.close(fd)
            raise JournalError(
                f"the journal {self.path} is in use by another PlexRL server ({holder}); a journal has one owner. "
                "Stop that server first (SIGTERM or Ctrl-C; the new one then resumes its unfinished jobs), or give "
                "this one another journal (--set journal=PATH)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}\n".encode(), 0)
        return fd

    def _disown(self) -> None:
        if self._owner >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(self._owner, fcntl.LOCK_UN)
            os.close(self._owner)
            self._owner = -1

    # -- writes (each one transaction, committed before returning) --------------------------------------
    def submit(self, name: str, config: dict[str, Any], iterations: int, user: str = "") -> JobEntry:
        """Record a new job as `queued`; its id is `<name>-<seq>` (unique in this journal)."""
        with self._lock, self._tx():
            now = self.clock()
            cur = self._db.execute(
                "INSERT INTO jobs (job_id, name, user, config, status, iterations, submitted_at) "
                "VALUES (?, ?, ?, ?, 'queued', ?, ?)",
                ("", name, user, json.dumps(config), iterations, now),
            )
            seq = int(cur.lastrowid or 0)
            job_id = f"{name}-{seq}"
            self._db.execute("UPDATE jobs SET job_id = ? WHERE seq = ?", (job_id, seq))
            self._event(job_id, now, 1, "submitted", {"user": user})
            return self._get(job_id)

    def placed(self, job_id: str, service: str | None, tracking: dict[str, Any] | None = None) -> JobEntry:
        """The planner placed the job on `service` (`tracking`: its MLflow run, if any)."""
        with self._lock, self._tx():
            entry = self._move(job_id, "running", {"service": service})
            now = self.clock()
            self._db.execute(
                "UPDATE jobs SET service = ?, started_at = ?, tracking = ? WHERE job_id = ?",
                (service, now, json.dumps(tracking or {}), job_id),
            )
            return self._get(entry.job_id)

    def iteration(self, job_id: str, iteration: int, metrics: dict[str, float]) -> None:
        """An iteration ended (`iteration` -1: the baseline evaluation before training)."""
        with self._lock, self._tx():
            entry = self._get(job_id)
            if entry.status != "running":
                return  # a late report of a job already closed (cancelled by its user)
            done = entry.iterations_done + (1 if iteration >= 0 else 0)
            self._db.execute("UPDATE jobs SET iterations_done = ? WHERE job_id = ?", (done, job_id))
            data = {"iteration": iteration, "metrics": {k: float(v) for k, v in metrics.items()}}
            self._event(job_id, self.clock(), entry.attempt, "iteration", data)

    def checkpoint(self, job_id: str, iteration: int, path: str, costs: dict[str, float] | None = None) -> None:
        """The job's state after `iteration` is saved (durably) at `path`: a restart resumes from it. `costs`:
        the planner's predicted seconds per node of the job then (a resumed job's cost model starts there)."""
        with self._lock, self._tx():
            entry = self._get(job_id)
            self._db.execute(
                "UPDATE jobs SET checkpoint = ?, checkpoint_iteration = ? WHERE job_id = ?", (path, iteration, job_id)
            )
            data = {"iteration": iteration, "path": path, "costs": costs or {}}
            self._event(job_id, self.clock(), entry.attempt, "checkpoint", data)

    def checkpoint_costs(self, job_id: str) -> dict[str, float]:
        """The `costs` journalled with the job's latest checkpoint ({} without one)."""
        with self._lock:
            row = self._db.execute(
                "SELECT data FROM events WHERE job_id = ? AND kind = 'checkpoint' ORDER BY seq DESC LIMIT 1", (job_id,)
            ).fetchone()
        costs = json.loads(row["data"]).get("costs", {}) if row is not None else {}
        return {str(k): float(v) for k, v in costs.items()}

    def note(self, job_id: str, kind: str, data: dict[str, Any]) -> None:
        """Record an event that changes no status (e.g. `checkpoint_failed`)."""
        with self._lock, self._tx():
            self._event(job_id, self.clock(), self._get(job_id).attempt, kind, data)

    def set_reason(self, job_id: str, reason: str) -> None:
        """Why a queued job waits (shown by `status`; cleared with ""). No event: it changes nothing durable."""
        with self._lock, self._tx():
            self._db.execute("UPDATE jobs SET reason = ? WHERE job_id = ? AND status = 'queued'", (reason, job_id))

    def finish(self, job_id: str, status: JobStatus, reason: str = "") -> bool:
        """Record a terminal status; False (nothing written) if the job had already ended. `done` with an
        iteration of the current attempt missing is recorded as `failed` (see the module docstring)."""
        if status not in TERMINAL:
            raise JournalError(f"finish({job_id!r}, {status!r}): not a terminal status ({sorted(TERMINAL)})")
        with self._lock, self._tx():
            entry = self._get(job_id)
            if entry.finished:
                return False
            if status == "done":
                missing = self._missing(entry)
                if missing:
                    status = "failed"
                    reason = (
                        f"reported done, but iteration(s) {_spans(missing)} of attempt {entry.attempt} are not in "
                        "the journal, so it is not recorded done; resubmit it"
                    ) + (f" ({reason})" if reason else "")
                    log.error("job %s: %s", job_id, reason)
            self._move(job_id, status, {"reason": reason})
            self._db.execute(
                "UPDATE jobs SET reason = ?, finished_at = ? WHERE job_id = ?", (reason, self.clock(), job_id)
            )
            return True

    def interrupt(self, job_id: str, reason: str) -> bool:
        """The server stops while the job is unfinished: back to `queued` (it runs again at the next start).
        False if the job had already ended."""
        with self._lock, self._tx():
            entry = self._get(job_id)
            if entry.finished or entry.status == "queued":
                return False
            self._move(job_id, "queued", {"reason": reason})
            self._db.execute("UPDATE jobs SET service = NULL WHERE job_id = ?", (job_id,))
            return True

    def recover(self) -> list[JobEntry]:
        """At server start: every unfinished job becomes `queued` again with one more attempt, to resume from
        its latest checkpoint (its progress set back to that iteration), or from scratch if it has none;
        returns them in submission order, to be submitted again."""
        with self._lock, self._tx():
            rows = self._db.execute("SELECT job_id FROM jobs WHERE status IN ('queued', 'running') ORDER BY seq")
            return [self._again(job_id, {}) for (job_id,) in rows.fetchall()]

    def requeue(self, job_id: str, reason: str) -> JobEntry | None:
        """A running job lost its service: `queued` again with one more attempt, to resume (elsewhere) from its
        latest checkpoint or from scratch, like a recovered job. None (nothing written) if it is not running."""
        with self._lock, self._tx():
            if self._get(job_id).status != "running":
                return None
            return self._again(job_id, {"reason": reason})

    def _again(self, job_id: str, data: dict[str, Any]) -> JobEntry:
        """Back to `queued` with one more attempt, progress set back to the latest checkpoint (lock held)."""
        entry = self._get(job_id)
        done = 0 if entry.checkpoint_iteration is None else entry.checkpoint_iteration + 1
        self._db.execute(
            "UPDATE jobs SET attempt = ?, iterations_done = ?, service = NULL, started_at = NULL WHERE job_id = ?",
            (entry.attempt + 1, done, job_id),
        )
        resume = "from scratch (no checkpoint)" if not done else f"from the checkpoint after iteration {done - 1}"
        self._move(job_id, "queued", {"from": entry.status, "resume": resume, **data})
        return self._get(job_id)

    # -- reads ------------------------------------------------------------------------------------------
    def get(self, job_id: str) -> JobEntry | None:
        with self._lock:
            try:
                return self._get(job_id)
            except JournalError:
                return None

    def jobs(self, status: str | None = None, limit: int = 1000) -> list[JobEntry]:
        """The most recent `limit` jobs (optionally of one status), oldest first."""
        with self._lock:
            if status is None:
                rows = self._db.execute("SELECT * FROM jobs ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()
            else:
                q = "SELECT * FROM jobs WHERE status = ? ORDER BY seq DESC LIMIT ?"
                rows = self._db.execute(q, (status, limit)).fetchall()
            return [self._entry(r) for r in reversed(rows)]

    def events(self, job_id: str, after: int = 0, limit: int = 1000) -> list[JournalEvent]:
        """The job's events with `seq > after`, oldest first (for `plexrl logs --follow`)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?", (job_id, after, limit)
            ).fetchall()
        return [
            JournalEvent(r["seq"], r["job_id"], r["time"], r["attempt"], r["kind"], json.loads(r["data"])) for r in rows
        ]

    def close(self) -> None:
        """Close the database, then release the lock file: another server may open the journal now."""
        with self._lock:
            self._db.close()
            self._disown()

    # -- internals (called with the lock held) ----------------------------------------------------------
    def _tx(self) -> Any:
        return _Transaction(self._db)

    def _get(self, job_id: str) -> JobEntry:
        row = self._db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise JournalError(f"no job {job_id!r} in the journal {self.path}")
        return self._entry(row)

    @staticmethod
    def _entry(r: sqlite3.Row) -> JobEntry:
        return JobEntry(
            r["seq"], r["job_id"], r["name"], r["user"], json.loads(r["config"]), r["status"], r["reason"],
            r["service"], r["iterations"], r["iterations_done"], r["attempt"], r["submitted_at"], r["started_at"],
            r["finished_at"], json.loads(r["tracking"]), r["checkpoint"], r["checkpoint_iteration"],
        )  # fmt: skip

    def _missing(self, entry: JobEntry) -> list[int]:
        """Iterations the current attempt should have journalled and did not: from 0, or after the checkpoint
        it resumed from (the latest one journalled by an earlier attempt), to `iterations - 1`."""
        row = self._db.execute(
            "SELECT data FROM events WHERE job_id = ? AND kind = 'checkpoint' AND attempt < ? "
            "ORDER BY seq DESC LIMIT 1",
            (entry.job_id, entry.attempt),
        ).fetchone()
        start = 0 if row is None else int(json.loads(row["data"])["iteration"]) + 1
        rows = self._db.execute(
            "SELECT data FROM events WHERE job_id = ? AND kind = 'iteration' AND attempt = ?",
            (entry.job_id, entry.attempt),
        ).fetchall()
        recorded = {int(json.loads(r["data"])["iteration"]) for r in rows}
        return [i for i in range(start, entry.iterations) if i not in recorded]

    def _move(self, job_id: str, new: str, data: dict[str, Any]) -> JobEntry:
        entry = self._get(job_id)
        kind = TRANSITIONS.get((entry.status, new))
        if kind is None:
            recent = self._db.execute(
                "SELECT time, kind, data FROM events WHERE job_id = ? ORDER BY seq DESC LIMIT 5", (job_id,)
            ).fetchall()
            history = "; ".join(f"t={r['time']:.3f} {r['kind']} {r['data']}" for r in reversed(recent))
            raise JournalError(f"job {job_id}: illegal move {entry.status} -> {new}; recent events: {history}")
        self._db.execute("UPDATE jobs SET status = ? WHERE job_id = ?", (new, job_id))
        self._event(job_id, self.clock(), entry.attempt, kind, data)
        return entry

    def _event(self, job_id: str, now: float, attempt: int, kind: str, data: dict[str, Any]) -> None:
        self._db.execute(
            "INSERT INTO events (job_id, time, attempt, kind, data) VALUES (?, ?, ?, ?, ?)",
            (job_id, now, attempt, kind, json.dumps(data)),
        )


def _spans(numbers: list[int]) -> str:
    """Sorted integers as spans: [0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an exception): one durable unit of the journal."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if kind is not None:
            self.db.execute("ROLLBACK")
            return
        try:
            self.db.execute("COMMIT")
        except sqlite3.Error:  # (a disk that filled up): nothing of it is kept, and the next BEGIN can start
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise


__all__ = ["TERMINAL", "TRANSITIONS", "JobEntry", "Journal", "JournalError", "JournalEvent"]
