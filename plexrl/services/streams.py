"""Stream ordering between a service's nodes and its state moves: ONE small interface (`StreamOrder`) that the
service, its background moves and the swap functions call at the points where order matters, with a CUDA
implementation, a plain one for CPU services, and one that records the calls (tests).

On CUDA a node's kernels run on the compute stream (the device's default stream) and may still run after the
node's Python code returned (the optimizer step of a train node is only queued). Background moves run on a
separate copy stream, which CUDA never orders against the compute stream by itself. So:

- `node_end(jobs)`: at the end of every service node (and load), an event is recorded on the compute stream
  for each job whose tensors the node used, and the call returns only once the node's device work is done:
  the node's end time (`NodeReport.end`) is then its real end, and its GPU tail is not booked to the next node
  (another job's, often) as busy or swap time.
- `before_copy(job)`: before a copy reads, replaces or frees a job's tensors, the current stream (the copy
  stream, in the background) waits for that job's last node event. With `node_end`'s wait this is already
  true when the copy is issued; the event keeps it true if a node ever returns early (a paused slice, a
  failure) and states the order where the copy is made.
- `allocated(t)`: a device buffer allocated on the copy stream and then used by the compute stream is marked
  used there (`record_stream`), so the caching allocator does not hand its block to another copy-stream
  allocation (another job's swap-in) while the compute stream may still touch it.
- `background()`: the background thread's moves run on the copy stream, and the block returns once they are
  done (the host buffers and device storages they free may then be reused).
- `copy(job, dst, src)`: issue one copy of a job's bytes on the current stream (asynchronous on CUDA: the
  bytes are there after `synchronize`).
- `synchronize()`: wait for the copies the current stream issued (before a host buffer is handed back or a
  device storage freed after a device -> host copy).

The CPU service needs none of this (one memory, synchronous copies): `HostOrder` does nothing.
`RecordingOrder` is `HostOrder` with a log of every call (thread, job, event number, buffer address), so a CPU
test can check that the service calls them where it must: no copy of a job issued before that job's last
node event is waited for, every buffer made in the background marked, node ends timed after the wait.

Does NOT decide which moves happen (the planner) nor carry them out (`plexrl.services.swap`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor


class StreamOrder(Protocol):
    """See the module docstring. Every method is safe to call from the node's thread and the background
    thread at once."""

    def node_end(self, job_ids: Iterable[str]) -> None: ...

    def background(self) -> contextlib.AbstractContextManager[None]: ...

    def before_copy(self, job_id: str) -> None: ...

    def allocated(self, t: Tensor) -> None: ...

    def copy(self, job_id: str, dst: Tensor, src: Tensor) -> None: ...

    def synchronize(self) -> None: ...


class HostOrder:
    """A CPU service's order: copies are synchronous and there is one memory, so nothing to do."""

    def node_end(self, job_ids: Iterable[str]) -> None:
        return None

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        yield

    def before_copy(self, job_id: str) -> None:
        return None

    def allocated(self, t: Tensor) -> None:
        return None

    def copy(self, job_id: str, dst: Tensor, src: Tensor) -> None:
        dst.copy_(src)

    def synchronize(self) -> None:
        return None


class CudaOrder:
    """Events on the compute stream (the device's default stream) per job, a copy stream for background moves,
    `record_stream` on buffers the copy stream allocates (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.compute = torch.cuda.default_stream(device)
        self.copy_stream = torch.cuda.Stream(device)
        self._last: dict[str, Any] = {}  # job -> the event recorded at the end of its last node
        self._lock = threading.Lock()

    def node_end(self, job_ids: Iterable[str]) -> None:
        stream = torch.cuda.current_stream(self.device)
        event = stream.record_event()  # one point in the stream: every job of the node shares it
        with self._lock:
            for job_id in job_ids:
                self._last[job_id] = event
        event.synchronize()

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        with torch.cuda.stream(self.copy_stream):
            try:
                yield
            finally:
                self.copy_stream.synchronize()

    def before_copy(self, job_id: str) -> None:
        with self._lock:
            event = self._last.get(job_id)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def allocated(self, t: Tensor) -> None:
        if torch.cuda.current_stream(self.device) != self.compute:
            t.record_stream(self.compute)

    def copy(self, job_id: str, dst: Tensor, src: Tensor) -> None:
        dst.copy_(src, non_blocking=True)  # pinned host memory: a DMA that overlaps; read after `synchronize`

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


class RecordingOrder(HostOrder):
    """`HostOrder` that logs every call as (call, thread name, job or None, value): `node_end` logs the job's
    new event number, `before_copy` the job's event number it waited for (-1: none yet), `allocated` the
    buffer's data pointer, `copy` the job's latest event number; a copy issued on a thread that had not waited
    for that event also goes to `unordered` as (thread, job, latest event, event waited for: -2 never)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str | None, int]] = []
        self._events: dict[str, int] = {}  # job -> its latest node event number
        self._waited: dict[tuple[str, str], int] = {}  # (thread, job) -> the event number that thread waited for
        self.unordered: list[tuple[str, str, int, int]] = []
        self._count = 0
        self._lock = threading.Lock()

    def _add(self, call: str, job: str | None, value: int) -> None:
        self.log.append((call, threading.current_thread().name, job, value))

    def node_end(self, job_ids: Iterable[str]) -> None:
        with self._lock:
            self._count += 1
            for job_id in job_ids:
                self._events[job_id] = self._count
                self._add("node_end", job_id, self._count)

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        with self._lock:
            self._add("background", None, 0)
        yield

    def before_copy(self, job_id: str) -> None:
        with self._lock:
            seen = self._events.get(job_id, -1)
            self._waited[(threading.current_thread().name, job_id)] = seen
            self._add("before_copy", job_id, seen)

    def allocated(self, t: Tensor) -> None:
        with self._lock:
            self._add("allocated", None, t.untyped_storage().data_ptr())

    def copy(self, job_id: str, dst: Tensor, src: Tensor) -> None:
        with self._lock:
            latest = self._events.get(job_id, -1)
            thread = threading.current_thread().name
            waited = self._waited.get((thread, job_id), -2)
            self._add("copy", job_id, latest)
            if waited != latest:
                self.unordered.append((thread, job_id, latest, waited))
        dst.copy_(src)

    def allocations(self) -> set[int]:
        return {value for call, _, _, value in self.log if call == "allocated"}


def stream_order(device: torch.device) -> StreamOrder:
    """The order a service on `device` uses: `CudaOrder` on a CUDA device, else `HostOrder`."""
    return CudaOrder(device) if device.type == "cuda" else HostOrder()


__all__ = ["CudaOrder", "HostOrder", "RecordingOrder", "StreamOrder", "stream_order"]
