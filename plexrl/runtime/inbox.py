"""The runner's inbox: what other threads ask of its loop (`submit`, `cancel`, `stop`), and the jobs that
arrive later (`Arrivals`). The inbox's lock is the runner's ONLY lock.

Concurrency contract: any thread may call `submit`, `cancel` and `stop`; each queues a request under the
lock and wakes the loop. Only the loop thread calls the `take_*` methods, `name`, `wait` and the
`Arrivals` (the arrivals are the loop's alone and take no lock). `submit`'s duplicate-name check reads the
set of names in use, which the loop keeps here (`name`) under the lock, so no other thread ever reads the
loop's records (`Runner.runs`).
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from plexrl.planner import JobCancelled
from plexrl.planner.events import CallArrived, SessionClosing


class Inbox:
    """See the module docstring."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock  # the runner's: a session's call is stamped with when it came (`CallArrived.at`)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # an idle loop waits on it for a request
        self._cancels: deque[JobCancelled] = deque()
        self._calls: deque[CallArrived | SessionClosing] = deque()  # sessions' calls and closes, in order
        self._submits: deque[Any] = deque()
        self._names: set[str] = set()  # job names a `submit` may not reuse (jobs not failed or cancelled)
        self._stop: str | None = None

    # -- any thread ---------------------------------------------------------------------------------
    def submit(self, spec: Any) -> None:
        """Queue a job; ValueError if its name is in use or already queued."""
        with self._wake:
            if spec.job_id in self._names or any(s.job_id == spec.job_id for s in self._submits):
                raise ValueError(f"a job named {spec.job_id!r} was already submitted; give each job a unique name")
            self._submits.append(spec)
            self._wake.notify_all()

    def cancel(self, job_id: str, reason: str) -> None:
        with self._wake:
            self._cancels.append(JobCancelled(job_id, reason))
            self._wake.notify_all()

    def call_arrived(self, job_id: str, node: str) -> None:
        """An idle session's next call is waiting (`calls.CallBoard.put`)."""
        with self._wake:
            self._calls.append(CallArrived(job_id, node, self._clock() if self._clock is not None else None))
            self._wake.notify_all()

    def close_session(self, job_id: str) -> None:
        """A session gets no more calls (`Runner.close_session`)."""
        with self._wake:
            self._calls.append(SessionClosing(job_id))
            self._wake.notify_all()

    def stop(self, reason: str) -> None:
        """Ask the loop to stop (the first reason given stands)."""
        with self._wake:
            if self._stop is None:
                self._stop = reason
            self._wake.notify_all()

    # -- the loop thread ----------------------------------------------------------------------------
    @property
    def stopping(self) -> str | None:
        """The stop reason, once `stop` was called."""
        with self._lock:
            return self._stop

    def take_submits(self) -> list[Any]:
        with self._lock:
            out = list(self._submits)
            self._submits.clear()
        return out

    def take_cancels(self) -> list[JobCancelled]:
        with self._lock:
            out = list(self._cancels)
            self._cancels.clear()
        return out

    def take_calls(self) -> list[CallArrived | SessionClosing]:
        with self._lock:
            out = list(self._calls)
            self._calls.clear()
        return out

    def has_cancels(self) -> bool:
        with self._lock:
            return bool(self._cancels)

    def drop_submits(self) -> None:
        with self._lock:
            self._submits.clear()

    def name(self, job_id: str, taken: bool) -> None:
        """Mark `job_id` as a name `submit` may not reuse (`taken`), or may again."""
        with self._lock:
            if taken:
                self._names.add(job_id)
            else:
                self._names.discard(job_id)

    def wait(self, timeout: float | None = None) -> None:
        """Block until a request is queued, or at most `timeout` seconds (None: until one is)."""
        with self._wake:
            if timeout is None:
                while not self._any():
                    self._wake.wait()
            elif not self._any():
                self._wake.wait(timeout)

    def _any(self) -> bool:  # (lock held)
        return bool(self._submits or self._cancels or self._calls or self._stop is not None)


class Arrivals:
    """Jobs that arrive later (`Runner.run(..., arrivals=...)`): (time, order, job id), earliest first (ties:
    in the order given). The loop's alone: no lock."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []

    def __bool__(self) -> bool:
        return bool(self._heap)

    def start(self, times: Iterable[tuple[float, str]]) -> None:
        self._heap = [(t, i, job_id) for i, (t, job_id) in enumerate(times)]
        heapq.heapify(self._heap)

    def next_time(self) -> float:
        return self._heap[0][0]

    def due(self, now: float) -> list[str]:
        """Take the job ids whose arrival time has come, in arrival order."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def waiting(self) -> set[str]:
        return {job_id for _, _, job_id in self._heap}

    def drop(self, job_ids: set[str]) -> None:
        """Forget jobs that will not arrive (cancelled before they came)."""
        self._heap = [a for a in self._heap if a[2] not in job_ids]
        heapq.heapify(self._heap)


__all__ = ["Arrivals", "Inbox"]
