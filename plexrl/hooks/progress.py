"""Progress of running jobs: a rich bar per job on a terminal, plain lines everywhere else.

`progress_hook(stream)` picks: `ProgressBar` (rich; iteration, reward, held-out accuracy, tokens/s) when
`stream` is a terminal, else `ProgressLines`: one line per job at most every `every_s` seconds (and at its
first and last iteration, and when it ends), for a log file, CI, a `tmux` capture:

    [grpo-arithmetic] iteration 12/600 | reward 0.412 | acc 0.300 | 4.1 s/it | ETA 40m12s (13:05:41)

A user can tell a slow job from a hung one without a terminal (a job's first iteration can take minutes).
The time per iteration is the mean since the job's first iteration ended (the first one includes loading);
the estimated end is that mean times the iterations left. The clock and the stream are injected (tests).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from plexrl.hooks.base import Hook

if TYPE_CHECKING:
    from plexrl.job.spec import JobRun

LINE_EVERY_S = 30.0


def _stats(job: JobRun, metrics: dict[str, float], acc: dict[str, float]) -> list[str]:
    name = job.spec.eval_metric()
    if name and name in metrics:
        acc[job.job_id] = metrics[name]
    parts = [f"reward {metrics.get('verify/reward_mean', float('nan')):.3f}"]
    if job.job_id in acc:
        parts.append(f"acc {acc[job.job_id]:.3f}")
    return parts


class ProgressBar(Hook):
    """A rich progress bar per job: iteration, reward, held-out accuracy, tokens/s (for a terminal)."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"),
        )
        self.tasks: dict[str, Any] = {}
        self.acc: dict[str, float] = {}
        self.progress.start()

    def on_job_start(self, job: JobRun) -> None:
        self.tasks[job.job_id] = self.progress.add_task(job.job_id, total=job.config.iterations, stats="")

    def on_iteration_end(self, job: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        parts = _stats(job, metrics, self.acc)
        if "rollout/tokens_per_s" in metrics:
            parts.append(f"{metrics['rollout/tokens_per_s']:.0f} tok/s")
        self.progress.update(self.tasks[job.job_id], completed=iteration + 1, stats=" | ".join(parts))

    def close(self) -> None:
        self.progress.stop()


@dataclass(slots=True)
class _Seen:
    first_end: float | None = None  # when the first iteration seen ended
    first_iteration: int = 0
    last_line: float = -math.inf


def _duration(seconds: float) -> str:
    """
    >>> _duration(3725.2), _duration(59.6)
    ('1h02m05s', '1m00s')
    """
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


class ProgressLines(Hook):
    """One progress line per job at most every `every_s` seconds, on `stream` (see the module docstring)."""

    def __init__(
        self,
        stream: TextIO | None = None,
        every_s: float = LINE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.stream, self.every_s, self.clock, self.wall = stream or sys.stderr, every_s, clock, wall
        self.seen: dict[str, _Seen] = {}
        self.acc: dict[str, float] = {}

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def on_job_start(self, job: JobRun) -> None:
        self.seen[job.job_id] = _Seen()
        self._write(f"[{job.job_id}] started: {job.config.iterations} iterations")

    def on_iteration_end(self, job: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        seen = self.seen.setdefault(job.job_id, _Seen())
        now, total, done = self.clock(), job.config.iterations, iteration + 1
        if done <= 0:  # the evaluation before the first iteration (logged at step 0)
            acc = _stats(job, metrics, self.acc)[1:]
            self._write(f"[{job.job_id}] before training" + "".join(f" | {a}" for a in acc))
            return
        parts = [f"iteration {done}/{total}", *_stats(job, metrics, self.acc)]
        if seen.first_end is None:
            seen.first_end, seen.first_iteration = now, done
        elif done > seen.first_iteration:
            per = (now - seen.first_end) / (done - seen.first_iteration)
            left = per * (total - done)
            end = time.strftime("%H:%M:%S", time.localtime(self.wall() + left))
            parts += [f"{per:.1f} s/it", f"ETA {_duration(left)} ({end})"]
        if done in (seen.first_iteration, total) or now - seen.last_line >= self.every_s:
            seen.last_line = now
            self._write(f"[{job.job_id}] " + " | ".join(parts))

    def on_job_end(self, job: JobRun) -> None:
        error = f": {job.error}" if getattr(job, "error", None) else ""
        self._write(f"[{job.job_id}] {job.status}{error}")
        self.seen.pop(job.job_id, None)


def progress_hook(stream: TextIO | None = None, every_s: float = LINE_EVERY_S) -> Hook:
    """The rich bar when `stream` (default stderr) is a terminal, else plain lines every `every_s` seconds."""
    stream = stream or sys.stderr
    return ProgressBar() if stream.isatty() else ProgressLines(stream, every_s)


__all__ = ["LINE_EVERY_S", "ProgressBar", "ProgressLines", "progress_hook"]
