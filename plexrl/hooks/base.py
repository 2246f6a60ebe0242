"""The hook interface: the only way out of a run. Tracking (per-job MLflow runs, the cluster-level run),
the timeline, the accounting and progress bars are hooks; operators, the planner and executors never call
them. Every method is optional.

`HookList` calls each hook in order. A hook that raises is logged and skipped from then on (tracking must not
fail a job), unless it is `required`: the accounting reads the timeline, so a required hook that raises fails
the run loudly (`HookFailed`), and the runner closes the open jobs with what they logged. What is skipped
depends on what failed:
- a callback about one job (`on_job_start` ... `on_job_end`): the hook is off for THAT job only (its other
  callbacks for it are skipped, except `on_job_end`, so that the hook can close what it opened); the error
  is added to the job's `run.tracking["hook_errors"]`. The hook keeps serving every other job: one job's bad
  tracking settings (an MLflow experiment that cannot be created) do not end tracking for a server's later
  jobs;
- a callback about the whole run (`on_start`, `on_end`, `close`): the hook is off for the rest of the run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plexrl.job.spec import JobRun
    from plexrl.reports import MoveRecord

log = logging.getLogger(__name__)


class HookFailed(RuntimeError):
    """A required hook raised: what depends on it (the accounting) would be wrong, so the run stops."""


@dataclass(slots=True)
class RunSummary:
    """What `on_end` receives: every job's record, the services and their reports, and the run's span on
    the runner's clock (`start`: the services were up; `end`: the last job ended)."""

    runs: list[JobRun]
    services: list[str]
    service_reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0
    interrupted: bool = False


class Hook:
    """Base class with no-op callbacks. `lane` is a service id, or "cpu" for the CPU pool. Hooks read the
    job's record (`JobRun`, with its frozen spec in `.spec`); they may add to `run.tracking` and
    `run.artifacts`, nothing else."""

    required: bool = False  # True: a failure stops the run instead of disabling the hook

    def on_start(self, time: float) -> None:
        """The services are up and the first event is about to be handled (`time` on the runner's clock)."""

    def on_job_start(self, run: JobRun) -> None: ...

    def before_node(self, run: JobRun, iteration: int, node: str, lane: str, start: float) -> None: ...

    def after_node(
        self, run: JobRun, iteration: int, node: str, lane: str, start: float, end: float, metrics: dict[str, float]
    ) -> None:
        """A node ended (`metrics`: its output's metrics; empty when it failed, and for every chunk of a chunked
        node but the last, whose metrics are the whole node's)."""

    def on_swap(self, run: JobRun, lane: str, start: float, end: float, nbytes: int) -> None:
        """State moved on service `lane` before one of the job's nodes (the blocking part only)."""

    def on_move(self, run: JobRun, lane: str, record: MoveRecord) -> None:
        """One state move of the job's on service `lane`, blocking or in the background, with where its
        seconds went (`plexrl.reports.MoveRecord`; `record.start` on the service's clock)."""

    def on_load(self, run: JobRun, lane: str, start: float, end: float, nbytes: int) -> None:
        """The job's engine and state were created on service `lane` (its first load: set-up, not a swap)."""

    def on_weight_load(self, run: JobRun, lane: str, kind: str, start: float, end: float, nbytes: int) -> None:
        """The job's weights were loaded into its generation engine during a node on service `lane`: `kind`
        "sync" (new version after training) or "swap" (the shared engine held another job's weights)."""

    def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None: ...

    def on_checkpoint(self, run: JobRun, iteration: int, path: Path, error: str | None) -> None:
        """The job's state after `iteration` (the planner's count) was saved to `path`, or that failed
        (`error`; an earlier checkpoint stays intact). May come after the job ended."""

    def on_job_held(self, run: JobRun, reason: str) -> None:
        """The planner holds the queued job for its user's limits (`reason`), or no longer does ("")."""

    def on_job_end(self, run: JobRun) -> None: ...

    def on_end(self, summary: RunSummary) -> None:
        """Every job has ended and the services are stopped (also after an interrupt)."""

    def close(self) -> None: ...


class HookList(Hook):
    """The hooks of a run, called in order (see the module docstring for what happens when one raises).
    Called from the runner's thread only."""

    def __init__(self, hooks: list[Hook] | None = None) -> None:
        self.hooks = list(hooks or [])
        self._off: dict[str, set[int]] = {}  # job id -> id() of the hooks that failed for it (until its end)

    def _call(self, name: str, *args: Any) -> None:
        for hook in list(self.hooks):
            try:
                getattr(hook, name)(*args)
            except Exception as exc:
                self._required(hook, name, exc)
                log.exception("hook %s.%s failed; disabling it", type(hook).__name__, name)
                if hook in self.hooks:
                    self.hooks.remove(hook)

    def _call_job(self, name: str, run: JobRun, *args: Any, end: bool = False) -> None:
        """A per-job callback: a hook that raises is off for `run` only (`on_job_end` still reaches it)."""
        off = self._off.get(run.job_id, set())
        for hook in list(self.hooks):
            if id(hook) in off and not end:
                continue
            try:
                getattr(hook, name)(run, *args)
            except Exception as exc:
                self._required(hook, name, exc)
                what = f"{type(hook).__name__}.{name}"
                log.exception("hook %s failed for job %s; it is off for that job, on for the others", what, run.job_id)
                run.tracking.setdefault("hook_errors", []).append(f"{what}: {type(exc).__name__}: {exc}")
                if not end:
                    off = self._off.setdefault(run.job_id, off)
                    off.add(id(hook))

    @staticmethod
    def _required(hook: Hook, name: str, exc: Exception) -> None:
        if hook.required:
            raise HookFailed(
                f"hook {type(hook).__name__}.{name} failed: {type(exc).__name__}: {exc}; the run stops "
                "because its accounting depends on this hook"
            ) from exc

    def on_start(self, time: float) -> None:
        self._call("on_start", time)

    def on_job_start(self, run: JobRun) -> None:
        self._off.pop(run.job_id, None)  # (a job submitted again under its name starts with every hook)
        self._call_job("on_job_start", run)

    def before_node(self, run: JobRun, iteration: int, node: str, lane: str, start: float) -> None:
        self._call_job("before_node", run, iteration, node, lane, start)

    def after_node(
        self, run: JobRun, iteration: int, node: str, lane: str, start: float, end: float, metrics: dict[str, float]
    ) -> None:
        self._call_job("after_node", run, iteration, node, lane, start, end, metrics)

    def on_swap(self, run: JobRun, lane: str, start: float, end: float, nbytes: int) -> None:
        self._call_job("on_swap", run, lane, start, end, nbytes)

    def on_move(self, run: JobRun, lane: str, record: MoveRecord) -> None:
        self._call_job("on_move", run, lane, record)

    def on_load(self, run: JobRun, lane: str, start: float, end: float, nbytes: int) -> None:
        self._call_job("on_load", run, lane, start, end, nbytes)

    def on_weight_load(self, run: JobRun, lane: str, kind: str, start: float, end: float, nbytes: int) -> None:
        self._call_job("on_weight_load", run, lane, kind, start, end, nbytes)

    def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        self._call_job("on_iteration_end", run, iteration, metrics)

    def on_checkpoint(self, run: JobRun, iteration: int, path: Path, error: str | None) -> None:
        self._call_job("on_checkpoint", run, iteration, path, error)

    def on_job_held(self, run: JobRun, reason: str) -> None:
        self._call_job("on_job_held", run, reason)

    def on_job_end(self, run: JobRun) -> None:
        try:
            self._call_job("on_job_end", run, end=True)
        finally:
            self._off.pop(run.job_id, None)

    def on_end(self, summary: RunSummary) -> None:
        self._call("on_end", summary)

    def close(self) -> None:
        self._call("close")
