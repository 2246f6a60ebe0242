"""Reward terms run in worker processes with a time limit per call, so that one hung call costs one call.

`score_term(term, allowed, rows)` runs one term of a job's reward on a batch of rows in a worker process of
that term and returns one `Outcome` per row: `("ok", value)`, `("error", "Type: message")` or
`("timeout", None)`. The worker (`python -m plexrl._reward_worker`, see its docstring for the protocol)
resolves the term once, then answers each call as it ends. A batched user reward is one call for the batch;
every other term (built-ins included) is one call per row. The parent waits for each call at most the term's
`timeout_s`, counted from the end of the previous call; when a call passes it, the worker is killed (its
whole process group), the call is a timeout, and the rest of the batch goes to a fresh worker. A worker that
dies in a call (a crash in native code, `os._exit`, the kernel's CPU limit) costs that call, as an error.

Why a process per term and not threads: a thread cannot be killed, and a call that holds the GIL (Python's
`re` on a backtracking pattern, native code) freezes every thread of the process, a server's included.
`subprocess` (not `multiprocessing`) starts the workers, which works inside daemonic Dask workers too.

Workers are kept per process, by term (its built-in name or ref, parameters, limit) and the `sys.path` and
allow-list it was resolved under: the next batch of any job with the same term reuses an idle one (a worker
serves one batch at a time; a second caller at once gets a worker of its own). At most `MAX_IDLE` idle
workers are kept in all (the least recently used is closed), and all are closed at interpreter exit.

What this module does NOT do: sandbox the reward (a worker is an ordinary process of the same user, with the
parent's environment: a user reward is trusted code named through the allow-list; `plexrl.tools.sandbox` is
for model-written code), or decide what a timeout means for the job (`plexrl.rewards` does).
"""

from __future__ import annotations

import atexit
import contextlib
import json
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
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Literal

from plexrl.data.config import RewardTerm

log = logging.getLogger(__name__)

Status = Literal["ok", "error", "timeout"]
Outcome = tuple[Status, Any]
Row = tuple[str, str, Any, dict[str, Any]]  # prompt, response, ground truth, extra
Key = tuple[str, tuple[str, ...] | None, tuple[str, ...]]  # term, allow-list, sys.path

MAX_IDLE = 16  # idle workers kept per process, all terms together
START_TIMEOUT_S = 120.0  # a worker must import and resolve its term within this
MAX_LINE = 16 << 20  # the longest answer line a worker may send


class WorkerFailed(RuntimeError):
    """A worker could not start or resolve its term (the message says why)."""


class TermWorker:
    """One worker process of one term. Used by one caller at a time (the pool hands it out). Started here, it
    imports and resolves its term while the caller goes on; `run` waits for that first."""

    def __init__(self, term: RewardTerm, allowed: tuple[str, ...] | None, path: Sequence[str]) -> None:
        self.term, self.key = term, worker_key(term, allowed, path)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "plexrl._reward_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # its own process group: a kill takes whatever it started too
        )
        self._buffer, self._ready = b"", False
        hello = {
            "path": list(path),
            "allowed": None if allowed is None else list(allowed),
            "term": term.model_dump(),
        }
        try:
            self._send(hello)
        except BaseException:
            self.kill()
            raise

    def wait_ready(self) -> None:
        """Wait until the worker has resolved its term; `WorkerFailed` (the worker killed) if it cannot."""
        if self._ready:
            return
        try:
            first = self._line(time.monotonic() + START_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        if first is None or "ready" not in first:
            self.kill()
            why = "it exited or took too long" if first is None else first.get("error", first)
            raise WorkerFailed(f"reward {_name(self.term)}: its worker process could not start ({why})")
        self._ready = True

    def _send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.write(struct.pack(">Q", len(body)) + body)
        self.proc.stdin.flush()

    def _line(self, deadline: float) -> dict[str, Any] | None:
        """The next answer, or None if the worker died or the deadline passed (`self.proc.poll()` tells)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or len(self._buffer) > MAX_LINE:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            got = json.loads(line)
        except ValueError:
            return {"error": "ValueError: the worker sent an unreadable answer"}
        return got if isinstance(got, dict) else {"error": "ValueError: the worker sent an unreadable answer"}

    def run(self, rows: list[Row], batched: bool) -> tuple[list[Outcome], bool]:
        """Outcomes of the calls on `rows` (one for a batched reward, else one per row), and whether this
        worker is still usable (False: it was killed or died; the caller starts another for the rest)."""
        self.wait_ready()
        try:
            self._send({"rows": rows})
        except (BrokenPipeError, OSError):
            self.kill()
            return [("error", "RuntimeError: the reward's worker process died")], False
        calls = 1 if batched else len(rows)
        out: list[Outcome] = []
        for _ in range(calls):
            got = self._line(time.monotonic() + self.term.timeout_s)
            if got is None:
                died = self.proc.poll() is not None
                self.kill()
                if died:
                    why = _exit_reason(self.proc.returncode)
                    out.append(("error", f"RuntimeError: the reward's worker process died in the call ({why})"))
                else:
                    out.append(("timeout", None))
                return out, False
            out.append(("ok", got["ok"]) if "ok" in got else ("error", str(got.get("error", "unknown error"))))
        return out, True

    def hang_up(self) -> None:
        """Close the pipes: the worker exits once its current call (if any) returns."""
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()

    def kill(self) -> None:
        """End the worker and everything it started, and reap it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.close()

    def close(self) -> None:
        """Close its stdin (it exits at end of input), wait a little, then kill it; reap it."""
        self.hang_up()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        sig = -code
        if sig == signal.SIGXCPU:
            return "it passed its CPU time limit"
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(sig).name}"
    return f"exit code {code}"


def _name(term: RewardTerm) -> str:
    return f"{term.key!r} ({term.name or term.ref})"


class WorkerPool:
    """Idle workers by term; see the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: OrderedDict[int, tuple[Key, TermWorker]] = OrderedDict()
        self._ids = 0
        self._pid = os.getpid()

    def _forked(self) -> None:
        if os.getpid() != self._pid:  # a forked child: its parent's workers are not its own
            self._idle, self._pid = OrderedDict(), os.getpid()

    def acquire(self, term: RewardTerm, allowed: tuple[str, ...] | None) -> TermWorker:
        """An idle worker of `term` (resolved under `allowed` and this `sys.path`), else a new one."""
        path = tuple(sys.path)
        key = worker_key(term, allowed, path)
        with self._lock:
            self._forked()
            for wid, (k, worker) in reversed(self._idle.items()):
                if k == key:
                    del self._idle[wid]
                    if worker.proc.poll() is None:
                        return worker
                    worker.close()
                    break
        return TermWorker(term, allowed, path)

    def release(self, worker: TermWorker) -> None:
        """Keep `worker` for the next batch of its term (closing the least recently used beyond MAX_IDLE)."""
        closing = []
        with self._lock:
            self._forked()
            self._ids += 1
            self._idle[self._ids] = (worker.key, worker)
            while len(self._idle) > MAX_IDLE:
                closing.append(self._idle.popitem(last=False)[1][1])
        for old in closing:
            old.close()

    def close(self) -> None:
        """Close every idle worker (at exit; tests)."""
        with self._lock:
            idle, self._idle = list(self._idle.values()), OrderedDict()
            mine = os.getpid() == self._pid
        workers = [w for _, w in idle] if mine else []
        for worker in workers:  # all at once: each takes a moment to exit
            worker.hang_up()
        for worker in workers:
            worker.close()

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)


def worker_key(term: RewardTerm, allowed: tuple[str, ...] | None, path: Sequence[str]) -> Key:
    """Workers are shared by the calls whose term, allow-list and `sys.path` are all the same."""
    return term.model_dump_json(), allowed, tuple(path)


POOL = WorkerPool()
atexit.register(POOL.close)


def score_term(
    term: RewardTerm, allowed: tuple[str, ...] | None, rows: list[Row], batched: bool, worker: TermWorker | None = None
) -> list[Outcome]:
    """One outcome per call of `term` on `rows` (one for a `batched` user reward, else one per row); see the
    module docstring. `worker`: one of `POOL.acquire(term, allowed)` to start with (this call owns it: it goes
    back to the pool or is killed). Raises `WorkerFailed` when no worker can resolve the term."""
    out: list[Outcome] = []
    calls = (1 if batched else len(rows)) if rows else 0
    while len(out) < calls:
        worker = worker or POOL.acquire(term, allowed)
        got, usable = worker.run(rows if batched else rows[len(out) :], batched)
        out += got
        if usable:
            POOL.release(worker)
        worker = None
    if worker is not None:
        POOL.release(worker)
    return out


__all__ = ["MAX_IDLE", "POOL", "Outcome", "TermWorker", "WorkerFailed", "WorkerPool", "score_term"]
