"""`ControllerBackend`: sessions on `plexrl serve` as journalled jobs of its controller. A model's session job is
submitted like any job (`Controller.submit`: the journal records it, with its `SessionConfig`, before anyone is
told; per-user admission applies), prepared on the controller's pool (`api.prepare_entry` opens its calls on
the board and builds its `SessionSpec`), handed to the runner, placed, checkpointed and resumed as any job. Its
calls go through the runner's `CallBoard`; the runner's hooks say when it is on its service, the journal when
it ended or what it waits for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plexrl.hooks.base import Hook
from plexrl.job.spec import JobRun
from plexrl.runtime.calls import CallBoard
from plexrl.sessions.calls import Call
from plexrl.sessions.spec import SessionConfig


class _News(Hook):
    """The runner's news of session jobs for the registry: on a service (ready), ended."""

    def __init__(self, backend: ControllerBackend) -> None:
        self.backend = backend

    def on_load(self, run: JobRun, lane: str, start: float, end: float, nbytes: int) -> None:
        if self.backend.registry is not None and self.backend.board.has(run.job_id):
            self.backend.registry.job_ready(run.job_id)

    def on_job_end(self, run: JobRun) -> None:
        if self.backend.registry is not None:
            self.backend.registry.job_ended(run.job_id, run.status, run.error)


class ControllerBackend:
    """See the module docstring. Build the runner with `hooks=[..., backend.hook]` and `calls=backend.board`,
    then `attach(controller)`."""

    def __init__(self, journal: Any) -> None:
        self.board = CallBoard()
        self.hook = _News(self)
        self.journal = journal
        self.controller: Any = None
        self.registry: Any = None

    def attach(self, controller: Any) -> None:
        self.controller = controller

    def bind(self, registry: Any) -> None:
        self.registry = registry

    def open(self, cfg: SessionConfig, user: str) -> str:
        # (iterations 0: a session's calls are open-ended; the journal counts them as iterations done)
        config = cfg.model_dump(mode="json", exclude_unset=True)  # (what is unset takes the device's defaults)
        # with checkpoints, a session with none told its client of no change: it may resume from scratch
        config.setdefault("client", {})["checkpoint_every"] = int(getattr(self.controller, "checkpoint_every", 0) or 0)
        entry = self.controller.submit(cfg.name, config, 0, user)
        self.board.open(entry.job_id)  # (its preparation opens it too: whichever comes first)
        return str(entry.job_id)

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
        entry = self.journal.get(job_id)
        if entry is not None and entry.status == "queued":  # not on a service yet: nothing to wait for
            self.controller.cancel(job_id, "its client closed the session before it was placed")
            return
        self.controller.runner.close_session(job_id)

    def reason(self, job_id: str) -> str:
        entry = self.journal.get(job_id)
        return str(entry.reason) if entry is not None and entry.reason else ""

    def status(self, job_id: str) -> tuple[str, str]:
        """The job's status and reason in the journal ("" when unknown)."""
        entry = self.journal.get(job_id)
        return (str(entry.status), str(entry.reason)) if entry is not None else ("", "")


__all__ = ["ControllerBackend"]
