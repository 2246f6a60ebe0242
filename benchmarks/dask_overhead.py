"""What the Dask path costs one job: the main job's iterations in-process (`InlineExecutor`, the fastest way
to run it alone) and on a local Dask cluster (`DaskExecutor`, one service, lookahead and inline cpu nodes
on, as cluster runs use it), side by side; seconds per iteration over the iterations after the first 5
and their ratio.

    .venv/bin/python benchmarks/dask_overhead.py [--iterations 15] [--engine torch|vllm|auto] [--smoke]

`--smoke`: a tiny job (benchmarks/_tiny.py) for 3 iterations, 1 timed, in a temporary directory (the test
suite runs it).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plexrl.hooks.base import Hook
from plexrl.job.load import load_job
from plexrl.job.spec import JobRun, prepare_job
from plexrl.planner import Planner
from plexrl.runtime import InlineExecutor, Runner
from plexrl.runtime.dask import DaskExecutor
from plexrl.runtime.jobs import configure_torch

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "grpo_arithmetic.yaml"
WARMUP = 5


def seconds_per_iteration(executor: Any, spec: Any, iterations: int, warmup: int = WARMUP, **planner: Any) -> float:
    """Mean seconds per iteration over iterations warmup..iterations-1 (needs iterations > warmup); `planner`:
    the planner's options (lookahead, inline_below)."""
    marks: dict[int, float] = {}

    class Clock(Hook):
        def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
            marks[iteration] = time.perf_counter()

    (run,) = Runner(executor, Planner(clock=executor.clock, **planner), hooks=[Clock()]).run([spec])
    if run.status != "done":
        raise SystemExit(f"{run.status}: {run.error}")
    return (marks[iterations - 1] - marks[warmup - 1]) / (iterations - warmup)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=15)
    ap.add_argument("--engine", choices=["torch", "vllm", "auto"], default="auto")
    ap.add_argument("--smoke", action="store_true", help="a tiny job, 3 iterations (for the tests)")
    args = ap.parse_args(argv)
    warmup = WARMUP
    tmp = tempfile.TemporaryDirectory(prefix="plexrl-dask-overhead-") if args.smoke else None
    if tmp is not None:
        from _tiny import tiny_job

        raw = tiny_job(tmp.name, iterations=3)
        args.iterations, warmup = 3, 2
    else:
        raw = load_job(CONFIG).raw
        raw.update(iterations=args.iterations, threads=1, engine=args.engine)  # one torch thread, as the services
        raw["tracking"] = {"mlflow": False, "progress": False, "log_model": False}
    if args.iterations <= warmup:
        ap.error(f"--iterations must exceed the {warmup} untimed ones")
    spec = prepare_job(load_job(raw))
    configure_torch(1)
    inline = seconds_per_iteration(InlineExecutor(), spec, args.iterations, warmup)
    dask = seconds_per_iteration(
        DaskExecutor(services=1, cpu_threads=1, service_threads=1), spec, args.iterations, warmup,
        lookahead=True, inline_below=0.01,
    )  # fmt: skip
    if tmp is not None:
        tmp.cleanup()
    print(f"engine {spec.generation}, {args.iterations - warmup} iterations timed (after {warmup})")
    print(f"in-process (InlineExecutor): {inline:.3f} s/iteration")
    print(f"local Dask (DaskExecutor)  : {dask:.3f} s/iteration")
    print(f"ratio dask / in-process = {dask / inline:.3f}")


if __name__ == "__main__":
    main()
