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
    """The runner's news of session jobs: loaded on a service (ready)."""

    def __init__(self, backend: RunnerBackend) -> None:
        self.backend = backend

    def on_load(self, run: JobRun, lane: str, start: float, end: float, nbytes: int) -> None:
        if self.backend.registry is not None:
            self.backend.registry.job_ready(run.job_id)


class RunnerBackend:
    """See the module docstring. Build the runner with `hooks=[backend.hook]`, `on_closed=backend.closed` and
    `calls=backend.board`, then `attach(runner)`."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device  # the runner's services': sessions take its defaults (`prepare_session`)
        self.board = CallBoard()
        self.hook = _Watch(self)
        self.runner: Any = None
        self.registry: Any = None

    def attach(self, runner: Any) -> None:
        self.runner = runner

    def bind(self, registry: Any) -> None:
        self.registry = registry

    def open(self, cfg: SessionConfig, user: str) -> str:
        self.board.open(cfg.name)
        threading.Thread(target=self._submit, args=(cfg, user), name=f"session-{cfg.name}", daemon=True).start()
        return cfg.name

    def _submit(self, cfg: SessionConfig, user: str) -> None:
        try:
            self.runner.submit(prepare_session(cfg, user=user, device=self.device))
        except Exception as exc:
            log.exception("session %s could not be started", cfg.name)
            why = f"the session could not start: {type(exc).__name__}: {exc}"
            self.board.drop(cfg.name, why)
            if self.registry is not None:
                self.registry.job_ended(cfg.name, "failed", why)

    def call(
        self, job_id: str, kind: str, call: Call, done: Callable[[dict[str, Any] | None, str | None], None]
    ) -> None:
        try:
            self.board.put(job_id, kind, call, done)
        except KeyError:
            done(None, f"session job {job_id} has ended")

    def withdraw(self, job_id: str, done: Callable[[dict[str, Any] | None, str | None], None]) -> bool:
        return self.board.withdraw(job_id, done)

    def close(self, job_id: str) -> None:
        self.runner.close_session(job_id)

    def reason(self, job_id: str) -> str:
        return ""

    def status(self, job_id: str) -> tuple[str, str]:
        return "", ""

    def closed(self, run: JobRun) -> None:
        """`Runner(on_closed=...)`: every ended job, placed or not."""
        if self.registry is not None:
            self.registry.job_ended(run.job_id, run.status, run.error)


__all__ = ["RunnerBackend"]
