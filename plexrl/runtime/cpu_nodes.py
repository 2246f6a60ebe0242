"""CPU nodes with a time limit: `run_bounded(spec, iteration, node, inputs, clock, limit_s)` runs a CPU-pool
node in a worker process of this process (`python -m plexrl.runtime._cpu_node_worker`) and waits for it at most
`limit_s` seconds; past it the worker's whole process group is killed and the node fails with the reason
(`limits.max_cpu_node_s`), so its job fails and nothing else does: the caller (the server's runner thread on
the local driver, a CPU-pool worker on Dask) never ran the node's code, so a node that hangs, spins, or holds
the GIL (Python's `re` on a backtracking pattern, native code) cannot freeze it. A worker that dies in a node
(a crash in native code, the kernel's memory killer) fails that node the same way.

Workers are kept per process (`POOL`), one node at a time each (a second caller at once gets a worker of its
own; at most `MAX_IDLE` idle ones are kept). A job's spec is sent to a worker once (pickled with cloudpickle,
as Dask ships it), keyed by job, attempt and object, and dropped with `forget(job_id)`; inputs go with each
node and the `NodeResult` comes back pickled (the worker runs only the job's declared operators: the same
trust as a Dask worker). The report's times are the caller's clock.

What this module does NOT do: limit memory or CPU time (a node's memory is its job's: `limits` size the job
before it runs), or sandbox the node (operators are trusted code named through the allow-list).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MAX_IDLE = 4  # idle workers kept per process
START_S = 300.0  # a worker must import PlexRL and take a spec within this (besides the node's own limit)


class NodeWorker:
    """One worker process; used by one caller at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "plexrl.runtime._cpu_node_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # its own process group: a kill takes whatever it started too
        )
        self.specs: set[tuple[str, int, int]] = set()  # the spec keys it holds
        self._buffer = b""
        try:
            self.send(("path", list(sys.path)))  # the caller's imports resolve the same there (a user's module)
        except OSError:
            self.kill()
            raise

    def send(self, message: Any) -> None:
        import cloudpickle

        assert self.proc.stdin is not None
        body = cloudpickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.write(struct.pack(">Q", len(body)) + body)
        self.proc.stdin.flush()

    def receive(self, deadline: float) -> tuple[bool, Any]:
        """(True, the answer) or (False, None) when the deadline passed or the worker died."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        need = 8
        while True:
            if len(self._buffer) >= 8:
                need = 8 + struct.unpack(">Q", self._buffer[:8])[0]
                if len(self._buffer) >= need:
                    body, self._buffer = self._buffer[8:need], self._buffer[need:]
                    return True, pickle.loads(body)
            left = deadline - time.monotonic()
            if left <= 0:
                return False, None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return False, None
            chunk = os.read(fd, max(1 << 16, need - len(self._buffer)))
            if not chunk:
                return False, None
            self._buffer += chunk

    def kill(self) -> None:
        """End the worker and everything it started; reap it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        self.proc.wait()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class Pool:
    """Idle workers of this process; see the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[NodeWorker] = []
        self._all: set[NodeWorker] = set()

    def acquire(self) -> NodeWorker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.alive:
                    return worker
                self._all.discard(worker)
        worker = NodeWorker()
        with self._lock:
            self._all.add(worker)
        return worker

    def release(self, worker: NodeWorker) -> None:
        with self._lock:
            if worker.alive and len(self._idle) < MAX_IDLE:
                self._idle.append(worker)
                return
            self._all.discard(worker)
        worker.kill()

    def discard(self, worker: NodeWorker) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)

    def forget(self, job_id: str) -> None:
        """Drop the specs of `job_id` from the idle workers (a busy one keeps it until its next `forget`)."""
        with self._lock:
            idle = list(self._idle)
        for worker in idle:
            held = {k for k in worker.specs if k[0] == job_id}
            if held:
                try:
                    worker.send(("forget", job_id))
                    worker.specs -= held
                except OSError:
                    self.discard(worker)

    def close(self) -> None:
        with self._lock:
            workers, self._idle, self._all = list(self._all), [], set()
        for worker in workers:
            worker.kill()


POOL = Pool()
atexit.register(POOL.close)


def run_bounded(
    spec: Any, iteration: int, node: str, inputs: dict[str, Any], clock: Callable[[], float], limit_s: float
) -> Any:
    """Run the CPU node `node` of `spec` in a worker process, at most `limit_s` seconds (see the module
    docstring); a `NodeResult` whose error says why when it was killed or its worker died. Never raises for the
    node's own failures."""
    from plexrl.reports import NodeReport
    from plexrl.services.service import NodeResult

    key = (spec.job_id, int(getattr(spec, "attempt", 0) or 0), id(spec))
    start = clock()
    worker = POOL.acquire()
    try:
        if key not in worker.specs:
            stale = {k for k in worker.specs if k[0] == spec.job_id}
            if stale:
                worker.send(("forget", spec.job_id))
                worker.specs -= stale
            worker.send(("spec", key, spec))
            ok, ready = worker.receive(time.monotonic() + START_S)  # (imports, then the spec: not the node's time)
            if not ok or ready != ("ready", key):
                raise RuntimeError(ready[1] if isinstance(ready, tuple) and ready[0] == "error" else "it did not start")
            worker.specs.add(key)
        worker.send(("run", key, iteration, node, inputs))
        ok, answer = worker.receive(time.monotonic() + limit_s)
    except (OSError, RuntimeError, pickle.PicklingError, TypeError, AttributeError) as exc:
        POOL.discard(worker)
        error = f"the CPU node's worker process could not take the job: {type(exc).__name__}: {exc}"
        return NodeResult(NodeReport(spec.job_id, iteration, node, error, start, clock()))
    if not ok:
        died = not worker.alive
        POOL.discard(worker)
        if died:
            code = worker.proc.returncode
            why = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            error = f"the CPU node's worker process died ({why})"
        else:
            error = (
                f"the CPU node ran past this server's limit of {limit_s:g} s (limits.max_cpu_node_s); its process "
                "was killed"
            )
        log.warning("job %s node %s (iteration %d): %s", spec.job_id, node, iteration, error)
        return NodeResult(NodeReport(spec.job_id, iteration, node, error, start, clock()))
    POOL.release(worker)
    result: Any = answer
    result.report.start, result.report.end = start, clock()
    return result


__all__ = ["POOL", "NodeWorker", "Pool", "run_bounded"]
