"""The hook interface. Every method is optional; `HookList` calls each hook in order and isolates
failures: a hook that raises is logged and disabled, it never fails a job."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plexrl.batch import Batch
    from plexrl.job import JobHandle

log = logging.getLogger(__name__)


class Hook:
    """Base class with no-op callbacks. `lane` is a service id, or "cpu" for the CPU pool."""

    def on_start(self, time: float) -> None:
        """The driver's services are up and the first event is about to be handled (`time` on its clock)."""

    def on_job_start(self, job: JobHandle) -> None: ...

    def before_node(self, job: JobHandle, iteration: int, node: str, lane: str, start: float) -> None: ...

    def after_node(
        self, job: JobHandle, iteration: int, node: str, lane: str, start: float, end: float, output: Batch | None
    ) -> None: ...

    def on_swap(self, job: JobHandle, lane: str, start: float, end: float, nbytes: int) -> None:
        """State moved on service `lane` before one of `job`'s nodes (the blocking part only)."""

    def on_weight_load(self, job: JobHandle, lane: str, kind: str, start: float, end: float, nbytes: int) -> None:
        """The job's weights were loaded into its generation engine during a node on service `lane`: `kind`
        "sync" (new version after training) or "swap" (the shared engine held another job's weights)."""

    def on_iteration_end(self, job: JobHandle, iteration: int, metrics: dict[str, float]) -> None: ...

    def on_job_end(self, job: JobHandle) -> None: ...

    def close(self) -> None: ...


class HookList(Hook):
    def __init__(self, hooks: list[Hook] | None = None) -> None:
        self.hooks = list(hooks or [])

    def _call(self, name: str, *args: Any) -> None:
        for hook in list(self.hooks):
            try:
                getattr(hook, name)(*args)
            except Exception:
                log.exception("hook %s.%s failed; disabling it", type(hook).__name__, name)
                self.hooks.remove(hook)

    def on_start(self, time: float) -> None:
        self._call("on_start", time)

    def on_job_start(self, job: JobHandle) -> None:
        self._call("on_job_start", job)

    def on_weight_load(self, job: JobHandle, lane: str, kind: str, start: float, end: float, nbytes: int) -> None:
        self._call("on_weight_load", job, lane, kind, start, end, nbytes)

    def before_node(self, job: JobHandle, iteration: int, node: str, lane: str, start: float) -> None:
        self._call("before_node", job, iteration, node, lane, start)

    def after_node(
        self, job: JobHandle, iteration: int, node: str, lane: str, start: float, end: float, output: Batch | None
    ) -> None:
        self._call("after_node", job, iteration, node, lane, start, end, output)

    def on_swap(self, job: JobHandle, lane: str, start: float, end: float, nbytes: int) -> None:
        self._call("on_swap", job, lane, start, end, nbytes)

    def on_iteration_end(self, job: JobHandle, iteration: int, metrics: dict[str, float]) -> None:
        self._call("on_iteration_end", job, iteration, metrics)

    def on_job_end(self, job: JobHandle) -> None:
        self._call("on_job_end", job)

    def close(self) -> None:
        self._call("close")
