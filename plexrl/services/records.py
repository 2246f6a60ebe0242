"""Every state move of a service, accounted for: `recorded` wraps one move and returns its `MoveRecord`
(`plexrl.reports`), `MoveLog` keeps a service's records until its next node report carries them to the runner
(and so to the timeline, MLflow and the cluster page) and sums them for the service's report, and
`summarize` / `format_summary` turn records into the per-arm lines the benchmarks print.

Where a move's seconds went (`MoveRecord`): queued behind other moves, copying, waiting on the compute
stream's event. Page faults are the moving thread's minor faults (`getrusage(RUSAGE_THREAD)`), taken around
the whole move: on a CPU service they are the first touches of fresh buffers, the cost a reused buffer saves;
its CPU seconds (`time.thread_time`) against its copy and wait seconds say how long it waited for a core.
Nothing here decides or carries out a move (`plexrl.services.swap` does).
"""

from __future__ import annotations

import contextlib
import resource
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from plexrl.reports import MoveRecord
from plexrl.services.host import Tally

_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)
_queue = threading.local()  # what the thread that runs a move knows of its queueing (`queued`)


def thread_faults() -> int:
    """Minor page faults of the calling thread so far (-1 where the platform has no per-thread count)."""
    if _RUSAGE_THREAD is None:
        return -1
    return int(resource.getrusage(_RUSAGE_THREAD).ru_minflt)


@contextlib.contextmanager
def queued(since: float, *, background: bool) -> Iterator[None]:
    """The moves this thread makes inside the block were queued at `since` (`time.perf_counter()`): their
    records count the time from then to their start as queued."""
    _queue.since, _queue.background = since, background
    try:
        yield
    finally:
        _queue.since = None


def lane(stream: Any = None) -> str:
    """The thread a move runs on, with its CUDA stream when it has one."""
    name = threading.current_thread().name
    return name if stream is None else f"{name} / stream {getattr(stream, 'stream_id', stream)}"


def recorded(
    job: str, src: str, dst: str, move: Callable[[Tally], int], *, clock: Callable[[], float], stream: Any = None
) -> MoveRecord:
    """Run `move(tally)` (it returns the state's bytes) and return its record."""
    since = getattr(_queue, "since", None)
    background = bool(getattr(_queue, "background", False)) if since is not None else False
    t0 = time.perf_counter()
    start = clock()
    faults = thread_faults()
    cpu0 = time.thread_time()
    tally = Tally()
    nbytes = move(tally)
    cpu = time.thread_time() - cpu0
    after = thread_faults()
    elapsed = time.perf_counter() - t0
    if since is not None:
        _queue.since = time.perf_counter()  # the next move of this batch queues behind this one
    return MoveRecord(
        job, src, dst, nbytes, tally.copies, tally.made, tally.reused, after - faults if faults >= 0 else -1,
        queued=max(t0 - since, 0.0) if since is not None else 0.0, copy=tally.copy,
        wait=max(elapsed - tally.copy, 0.0), lane=lane(stream), background=background, why="; ".join(tally.why),
        start=start, cpu=cpu,
    )  # fmt: skip


class MoveLog:
    """A service's move records: `add` from any thread; `drain` hands the runner those since the last drain;
    `totals` sums every record so far (the service's report). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[MoveRecord] = []
        self._all: dict[str, float] = summarize([])

    def add(self, record: MoveRecord) -> None:
        with self._lock:
            self._pending.append(record)
            for key, value in summarize([record]).items():
                if key != "gbps":
                    self._all[key] += value

    def drain(self) -> list[MoveRecord]:
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def totals(self) -> dict[str, float]:
        with self._lock:
            out = dict(self._all)
        out["gbps"] = gbps(out.get("bytes", 0), out.get("copy_s", 0.0))
        return out


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def summarize(records: Iterable[MoveRecord | dict[str, Any]]) -> dict[str, float]:
    """The sums of `records` (MoveRecords, or their dicts from a timeline): moves, bytes, copies, buffers
    made / reused, page faults, one-copy moves, background moves (and their bytes and copy seconds), moves that
    made a buffer (`fresh`, their bytes and copy seconds), queued / copy / wait seconds, the thread's CPU seconds
    of the moves that measured them (`cpu_s`) and those moves' copy + wait seconds (`timed_s`), and GB/s of the
    copying (bytes / copy seconds)."""
    keys = ("moves", "bytes", "copies", "made", "reused", "faults", "one_copy", "background")
    out: dict[str, float] = dict.fromkeys(keys, 0)
    out.update(queued_s=0.0, copy_s=0.0, wait_s=0.0, background_bytes=0, background_copy_s=0.0, fresh=0,
               fresh_bytes=0, fresh_copy_s=0.0, cpu_s=0.0, timed_s=0.0)  # fmt: skip
    for r in records:
        rec = MoveRecord(**r) if isinstance(r, dict) else r
        out["moves"] += 1
        out["bytes"] += rec.nbytes
        out["copies"] += rec.copies
        out["made"] += rec.made
        out["reused"] += rec.reused
        out["faults"] += max(rec.faults, 0)
        out["one_copy"] += not rec.why
        out["background"] += rec.background
        if rec.background:
            out["background_bytes"] += rec.nbytes
            out["background_copy_s"] += rec.copy
        if rec.made:  # into memory never touched before (or given back to the system): its page faults
            out["fresh"] += 1
            out["fresh_bytes"] += rec.nbytes
            out["fresh_copy_s"] += rec.copy
        out["cpu_s"] += max(rec.cpu, 0.0)
        out["timed_s"] += rec.copy + rec.wait if rec.cpu >= 0 else 0.0  # the seconds `cpu_s` is a share of
        out["queued_s"] += rec.queued
        out["copy_s"] += rec.copy
        out["wait_s"] += rec.wait
    out["gbps"] = gbps(out["bytes"], out["copy_s"])
    return out


def format_summary(s: dict[str, float], bound_gbps: float | None = None, fresh_gbps: float | None = None) -> str:
    """One line of `summarize`'s figures (and the copying's speed against `bound_gbps`, when given; the moves
    into kept buffers against it too, and those that made a buffer against `fresh_gbps`, the speed of a copy
    into fresh memory, when given)."""
    line = (
        f"moves {int(s['moves'])} ({int(s['one_copy'])} one copy, {int(s['background'])} background), "
        f"{s['bytes'] / 2**30:.2f} GiB, copies {int(s['copies'])}, buffers made {int(s['made'])} / reused "
        f"{int(s['reused'])}, faults {int(s['faults'])}, queued {s['queued_s']:.2f} s, copy {s['copy_s']:.2f} s, "
        f"wait {s['wait_s']:.2f} s, {s['gbps']:.2f} GB/s"
    )
    if s.get("timed_s"):  # the share of the move seconds its thread ran on a core (the rest: waiting for one)
        line += f", on a core {s['cpu_s'] / s['timed_s']:.0%} of it"
    if bound_gbps:
        line += f" (bound {bound_gbps:.2f} GB/s: {bound_gbps / s['gbps']:.1f}x)" if s["gbps"] > 0 else ""
    if s.get("fresh"):  # where the copy seconds went: first touches of fresh memory vs copies into kept buffers
        rest = gbps(s["bytes"] - s["fresh_bytes"], s["copy_s"] - s["fresh_copy_s"])
        made = gbps(s["fresh_bytes"], s["fresh_copy_s"])
        line += f"; {int(s['fresh'])} into fresh buffers {s['fresh_copy_s']:.2f} s ({made:.2f} GB/s"
        line += (
            f", a copy into fresh memory here {fresh_gbps:.2f} GB/s: {fresh_gbps / made:.1f}x)"
            if fresh_gbps and made > 0
            else ")"
        )
        line += f", the rest {rest:.2f} GB/s"
        line += f" ({bound_gbps / rest:.1f}x the bound)" if bound_gbps and rest > 0 else ""
    return line


__all__ = ["MoveLog", "format_summary", "gbps", "lane", "queued", "recorded", "summarize", "thread_faults"]
