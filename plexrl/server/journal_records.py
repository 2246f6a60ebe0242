"""The journal's records and its table of moves: a job's status (`JobStatus`, the planner's vocabulary) and every
legal move between them (`TRANSITIONS`), the sqlite schema and the columns this version reads, and the rows as
records (`JobEntry`, `JournalEvent`). Data only; `journal.Journal` is the one thing that writes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plexrl.planner.records import TERMINAL, JobStatus  # THE job status vocabulary (the planner's, the record's)

# (from, to) -> the event kind recorded for that move; the only legal moves
TRANSITIONS: dict[tuple[str, str], str] = {
    ("queued", "running"): "placed",
    ("running", "queued"): "interrupted",  # the server stopped or died; the job runs again at the next start
    ("queued", "queued"): "resubmitted",  # recovered at a start (it had not been placed yet)
    ("queued", "done"): "done",  # (not reached by the runner; kept for completeness of terminal moves)
    ("queued", "failed"): "failed",
    ("queued", "cancelled"): "cancelled",
    ("running", "done"): "done",
    ("running", "failed"): "failed",
    ("running", "cancelled"): "cancelled",
}

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    user TEXT NOT NULL,
    config TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    service TEXT,
    iterations INTEGER NOT NULL,
    iterations_done INTEGER NOT NULL DEFAULT 0,
    attempt INTEGER NOT NULL DEFAULT 1,
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    tracking TEXT NOT NULL DEFAULT '{}',
    checkpoint TEXT,
    checkpoint_iteration INTEGER
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    time REAL NOT NULL,
    attempt INTEGER NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id, seq);
"""
VERSION = 1
COLUMNS: dict[str, set[str]] = {  # what this version reads (a journal may have more, never fewer)
    "jobs": {
        "seq", "job_id", "name", "user", "config", "status", "reason", "service", "iterations", "iterations_done",
        "attempt", "submitted_at", "started_at", "finished_at", "tracking", "checkpoint", "checkpoint_iteration",
    },
    "events": {"seq", "job_id", "time", "attempt", "kind", "data"},
}  # fmt: skip


class JournalError(RuntimeError):
    """An illegal status move, an unknown job, a journal another server holds, or a file that is not a
    readable journal of this version."""


@dataclass(frozen=True, slots=True)
class JobEntry:
    """One job as the journal knows it. `config`: the validated job config (a JSON-able dict, overrides
    applied) from which the job is prepared again after a restart. `tracking`: MLflow uri and run id."""

    seq: int
    job_id: str
    name: str
    user: str
    config: dict[str, Any]
    status: JobStatus
    reason: str
    service: str | None
    iterations: int
    iterations_done: int
    attempt: int
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    tracking: dict[str, Any]
    checkpoint: str | None = None  # the latest checkpoint's file, written after iteration checkpoint_iteration
    checkpoint_iteration: int | None = None

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    def as_dict(self, config: bool = False) -> dict[str, Any]:
        """JSON-able view for the API (the config only when asked: it can be a few KiB)."""
        out = {k: getattr(self, k) for k in self.__slots__ if k != "config"}
        if config:
            out["config"] = self.config
        return out


@dataclass(frozen=True, slots=True)
class JournalEvent:
    seq: int
    job_id: str
    time: float
    attempt: int
    kind: str
    data: dict[str, Any]


__all__ = [
    "COLUMNS",
    "SCHEMA",
    "TERMINAL",
    "TRANSITIONS",
    "VERSION",
    "JobEntry",
    "JobStatus",
    "JournalError",
    "JournalEvent",
]
