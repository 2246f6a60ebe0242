"""`RunnerBackend`: the registry's sessions as jobs of a `Runner` it is given, without a journal: each model's
session job is prepared (`prepare_session`) and submitted to the runner, its calls go through the runner's
`CallBoard`, and the runner's hooks say when a job is on its service and when it ended. `plexrl serve` uses the
controller's backend instead (the journal records sessions: `server_backend.py`); this one serves tests and
`benchmarks/service_api.py`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from plexrl.hooks.base import Hook
from plexrl.job.spec import JobRun
from plexrl.runtime.calls import CallBoard
from plexrl.sessions.calls import Call
from plexrl.sessions.spec import SessionConfig, prepare_session

log = logging.getLogger(__name__)


class _Watch(Hook):
    """The runner's news of session jobs: loaded on a service (ready), ended."""

    def __init__(self, backend: RunnerBackend) -> None:
        self.backend = backend

    def on_load(self, run: JobRun, lane: str, start: float, end: float, nbytes: int) -> None:
        self.backend.loaded(run.job_id)


class RunnerBackend:
    """See the module docstring. Build the runner with `hooks=[backend.hook]`, `on_closed=backend.closed` and
    `calls=backend.board`, then `attach(runner)`."""

    def __init__(self) -> None:
        self.board = CallBoard()
        self.hook = _Watch(self)
        self.runner: Any = None
        self._lock = threading.Lock()
        self._ready: dict[str, Callable[[], None]] = {}
        self._ended: dict[str, Callable[[str, str], None]] = {}

    def attach(self, runner: Any) -> None:
        self.runner = runner

    def open(self, cfg: SessionConfig, user: str, ready: Callable[[], None], ended: Callable[[str, str], None]) -> None:
        with self._lock:
            self._ready[cfg.name], self._ended[cfg.name] = ready, ended
        self.board.open(cfg.name)
        try:
            spec = prepare_session(cfg, user=user)
            self.runner.submit(spec)
        except Exception as exc:
            log.exception("session %s could not be started", cfg.name)
            self.board.drop(cfg.name, f"the session could not start: {type(exc).__name__}: {exc}")
            self._end(cfg.name, "failed", f"{type(exc).__name__}: {exc}")

    def call(
        self, job_id: str, kind: str, call: Call, done: Callable[[dict[str, Any] | None, str | None], None]
    ) -> None:
        try:
            self.board.put(job_id, kind, call, done)
        except KeyError:
            done(None, f"session job {job_id} has ended")

    def close(self, job_id: str, checkpoint: bool) -> None:
        self.runner.close_session(job_id, checkpoint)

    def reason(self, job_id: str) -> str:
        return ""

    def loaded(self, job_id: str) -> None:
        with self._lock:
            ready = self._ready.pop(job_id, None)
        if ready is not None:
            ready()

    def closed(self, run: JobRun) -> None:
        """`Runner(on_closed=...)`: every ended job, placed or not."""
        self._end(run.job_id, run.status, run.error)

    def _end(self, job_id: str, status: str, reason: str) -> None:
        with self._lock:
            self._ready.pop(job_id, None)
            ended = self._ended.pop(job_id, None)
        if ended is not None:
            ended(status, reason)


__all__ = ["RunnerBackend"]
