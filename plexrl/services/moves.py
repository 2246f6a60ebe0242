"""A service's background state moves: prefetch and the early swaps of lookahead nodes (`BackgroundMoves`),
and the swap statistics they feed (`SwapStats`, `hidden_share`).

ONE background thread runs every queued move in the order it was queued, which is the planner's order, so
tiers and budgets follow the StateManager's sequence and moves of one job never overlap (a move whose job's
earlier background move failed fails too). On GPU the moves run on a separate CUDA stream.

Concurrency contract (what the service and this class promise each other):
- host side: a node's own swaps and the background thread never move the same job at once (a node waits for
  its jobs' queued moves, `wait_for`; blocking swaps wait for every move queued before them, `wait_all`), and
  a job's state is never moved while a node of that job runs (the planner pins it; early swaps of node `seq`
  start only after node `seq - 1` applied its swaps, and never move `seq - 1`'s job).
- device side (`StreamOrder`, `plexrl/services/streams.py`): the background moves run inside
  `order.background()` (the copy stream, synchronized before a batch of moves counts as done); every copy of
  a job waits for the event its last node recorded (`before_copy`), and every device buffer a background move
  allocates is marked for the compute stream (`allocated`). The node's end waits for its device work
  (`node_end`), so a node's GPU tail is neither read by a copy nor booked to the next node.

Early swaps: an executor that sends a service's next node while one runs numbers the service's ordered
tasks (`seq`: nodes and checkpoints, consecutive in the order sent). `start_early(seq, swaps)` queues node
`seq`'s swaps once task `seq - 1` has `passed` (applied its swaps and queued its prefetch: what the planner
assumed when it computed them); before that they are staged, and if node `seq` has begun (`claim`) they are
"late" and ignored (the node applies its swaps itself). Nothing here blocks on a task that may never run:
a staged start is only launched by a `passed`, and a node never waits for a staged start.

Priority (`ahead`): on a CPU service the background thread copies on the same cores as the service's node
threads, and a service may run two nodes at once; as the third runnable thread on 2 cores a move waited for a
core about half its time (the move records' CPU seconds: on a core 69% of the move seconds on the real-size
mix). The thread then asks to run `ahead` nice levels above the thread that made the service (Linux, per
thread; permitted to a privileged process, else it stays level and `lifted` says so): in a probe beside two
training threads a 1.61 GB swap took 157-176 ms each way level, 85 ms (its time alone) 5 levels ahead. The
copy needs the same CPU seconds either way; ahead, it is done before the node that waits for it.

Does NOT decide which moves to make (the planner's StateManager does) nor carry out one move (`Service._move`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from plexrl.planner.state import Move
from plexrl.services.records import queued
from plexrl.services.streams import StreamOrder

log = logging.getLogger(__name__)


def thread_nice(tid: int | None = None) -> int | None:
    """The nice value of thread `tid` (default: the calling thread), None where threads have none (not Linux)."""
    if not hasattr(os, "getpriority"):
        return None
    return os.getpriority(os.PRIO_PROCESS, tid if tid is not None else threading.get_native_id())


def run_ahead(levels: int, base: int | None) -> bool:
    """Run the calling thread `levels` nice levels above `base` (a nice value); False where not permitted or
    not possible (then it stays as it was)."""
    if levels <= 0 or base is None or not hasattr(os, "setpriority"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(base - levels, -20))
    except OSError:  # (PermissionError: an unprivileged process may only lower its threads' priority)
        return False
    return True


@dataclass(slots=True)
class SwapStats:
    """Seconds of state moves on one service. `blocking_seconds` is what nodes saw (the sum of their swap
    spans: moves on the node's thread plus waits for background moves); `prefetch_seconds` is move time on
    the background thread (prefetch and early swaps); `prefetch_wait_seconds` is the part of
    `blocking_seconds` spent waiting for background moves. So background time hidden from the nodes =
    prefetch - wait, and the share of swap time hidden = hidden / (blocking + hidden) (`hidden_share`)."""

    blocking_seconds: float = 0.0  # nodes' swap spans: moves they made or waited for (evictions + swap-in)
    prefetch_seconds: float = 0.0  # moves done in the background (prefetch + early swaps)
    prefetch_wait_seconds: float = 0.0  # part of blocking_seconds spent waiting for background moves
    early_seconds: float = 0.0  # part of prefetch_seconds: lookahead nodes' swaps started early
    early_starts: int = 0  # lookahead nodes whose swaps started before the node did
    early_during_previous: int = 0  # of them: started while the node before was still computing
    bytes_moved: int = 0
    moves: int = 0
    copies: int = 0  # copy calls of the moves (device <-> host: one per state once its tensors are one buffer)
    per_tier: dict[str, int] = field(default_factory=dict)


def hidden_share(blocking: float, prefetch: float, waited: float) -> float:
    """Share of swap time that no node saw: background move seconds not waited for / all swap seconds
    (`SwapStats`). NaN when nothing moved."""
    hidden = max(prefetch - waited, 0.0)
    total = blocking + hidden
    return hidden / total if total > 0 else float("nan")


class BackgroundMoves:
    """See the module docstring. `move` carries out one move (returns its bytes); `stats` and `lock` are the
    service's (the lock guards the stats); `order`: the service's stream order (its `background()` wraps
    every batch of moves); `ahead`: nice levels the background thread asks to run above the caller's thread
    (see the module docstring; 0: level)."""

    def __init__(
        self, name: str, move: Callable[[Move], int], stats: SwapStats, lock: threading.Lock, order: StreamOrder,
        ahead: int = 0,
    ) -> None:  # fmt: skip
        self._move, self.stats, self._lock, self._streams = move, stats, lock, order
        self.ahead, self.lifted, self.native_id = ahead, False, -1  # (the thread's id once it runs)
        base = thread_nice()
        self._thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"{name}-prefetch", initializer=self._lift, initargs=(base,)
        )
        self._order = threading.RLock()  # everything below
        self._inflight: dict[str, Future[int]] = {}  # job -> its latest queued background move
        self._last: Future[int] | None = None  # the latest queued move (one thread: done => all done)
        self._claimed = -1  # highest seq that has begun (its early start, if any, is taken or too late)
        self._passed = -1  # highest seq whose swaps are applied and whose prefetch is queued
        self._staged: dict[int, list[Move]] = {}  # seq -> early swaps waiting for seq - 1 to pass
        self.early: dict[int, Future[int]] = {}  # seq -> early swaps queued on the background thread
        self.computing: int | None = None  # seq of the node whose operator runs now (stats only)

    def _lift(self, base: int | None) -> None:
        self.native_id = threading.get_native_id()
        self.lifted = run_ahead(self.ahead, base)
        if self.ahead and not self.lifted:
            log.info("background moves run level with the service's nodes (raising a thread's priority is not "
                     "permitted to this process)")  # fmt: skip

    def queue(self, moves: Sequence[Move], *, early: bool = False) -> Future[int]:
        """Queue `moves` behind every move queued before; each of their jobs' in-flight entry becomes the
        returned future (its value: the bytes moved)."""
        moves = list(moves)
        since = time.perf_counter()  # the moves' records count their wait behind earlier moves from here
        with self._order:
            prior = {m.job_id: self._inflight.get(m.job_id) for m in moves}

            def work() -> int:
                for job_id, fut in prior.items():  # done: the one thread ran them first
                    exc = fut.exception() if fut is not None else None
                    if exc is not None:
                        raise RuntimeError(f"an earlier move of job {job_id} failed: {type(exc).__name__}: {exc}")
                t0 = time.perf_counter()
                total = 0
                with self._streams.background(), queued(since, background=True):  # the copy stream
                    for m in moves:
                        total += self._move(m)
                with self._lock:
                    seconds = time.perf_counter() - t0
                    self.stats.prefetch_seconds += seconds
                    if early:
                        self.stats.early_seconds += seconds
                return total

            fut = self._thread.submit(work)
            for m in moves:
                self._inflight[m.job_id] = fut
            self._last = fut
            return fut

    # -- early swaps of a lookahead node ----------------------------------------------------------------
    def start_early(self, seq: int, moves: Sequence[Move]) -> str:
        """Start node `seq`'s swaps in the background before the node runs: at once if task `seq - 1` has
        passed, else as soon as it does. Returns "started", "staged" (waiting for `seq - 1`) or "late" (node
        `seq` has begun; it applies them itself). Thread-safe; never blocks."""
        with self._order:
            if seq <= self._claimed:
                return "late"
            if seq - 1 <= self._passed:
                self._launch(seq, list(moves))
                return "started"
            self._staged[seq] = list(moves)
            return "staged"

    def _launch(self, seq: int, moves: list[Move]) -> None:
        self.early[seq] = self.queue(moves, early=True)
        with self._lock:
            self.stats.early_starts += 1
            if self.computing is not None and self.computing == seq - 1:
                self.stats.early_during_previous += 1

    def claim(self, seq: int | None) -> Future[int] | None:
        """Task `seq` begins: its early swaps' future if they were queued, else None (a staged start that
        never got going is dropped: the node applies its swaps itself)."""
        if seq is None:
            return None
        with self._order:
            self._claimed = max(self._claimed, seq)
            self._staged.pop(seq, None)
            return self.early.pop(seq, None)

    def passed(self, seq: int | None) -> None:
        """Task `seq` applied its swaps and queued its prefetch: start task `seq + 1`'s staged swaps."""
        if seq is None:
            return
        with self._order:
            self._passed = max(self._passed, seq)
            for s in sorted(self._staged):
                if s <= self._claimed:
                    del self._staged[s]  # its node began without it
                elif s - 1 <= self._passed:
                    self._launch(s, self._staged.pop(s))

    @contextlib.contextmanager
    def in_order(self, seq: int | None) -> Iterator[None]:
        """Run a numbered task that is not a node (a checkpoint) in its place: no early start of a later
        node begins until it ends."""
        self.claim(seq)
        try:
            yield
        finally:
            self.passed(seq)

    # -- waiting ----------------------------------------------------------------------------------------
    def wait(self, fut: Future[int], *, check: bool = True) -> None:
        """Wait for a background move inside a node's swap span (counted as a prefetch wait); `check`: raise
        if it failed."""
        t0 = time.perf_counter()
        try:
            if check:
                fut.result()
            else:
                concurrent.futures.wait([fut])
        finally:
            with self._lock:
                self.stats.prefetch_wait_seconds += time.perf_counter() - t0

    def wait_all(self) -> None:
        """Wait for every background move queued so far, inside a node's swap span (a prefetch wait). A node
        that applies its swaps itself calls it first: the planner computed those swaps after the moves queued
        before them, so running them side by side could briefly exceed a tier's budget (a prefetch still
        evicting while the node swaps in). Does not raise for a failed move: the move's job fails when it
        next waits for it (`wait_for`)."""
        with self._order:
            last = self._last
        if last is not None and not last.done():
            self.wait(last, check=False)

    def wait_for(self, job_id: str, *, count: bool = True) -> None:
        """Wait for the job's queued background moves; raise if they failed. `count`: inside a node's swap
        span (a prefetch wait), not a save, checkpoint or release."""
        with self._order:
            fut = self._inflight.pop(job_id, None)
        if fut is None:
            return
        if count:
            self.wait(fut)
        else:
            fut.result()

    def shutdown(self) -> None:
        """Finish the queued moves and stop the thread; staged early starts are dropped."""
        self._thread.shutdown(wait=True)
        with self._order:
            self._staged.clear()
