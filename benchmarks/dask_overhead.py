"""What the Dask path costs one job: the main job's iterations in-process (`InlineExecutor`, the fastest way
to run it alone) and on a local Dask cluster (`DaskExecutor`, one service, lookahead and inline cpu nodes
on, as cluster runs use it), side by side; seconds per iteration over the iterations after the first 5
and their ratio.

    .venv/bin/python benchmarks/dask_overhead.py [--iterations 15] [--engine torch|vllm|auto]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plexrl.config import load_job
from plexrl.hooks.base import Hook
from plexrl.job import JobRun, prepare_job
from plexrl.runtime import InlineExecutor, Runner
from plexrl.runtime.dask import DaskExecutor
from plexrl.runtime.jobs import configure_torch

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "grpo_arithmetic.yaml"
WARMUP = 5


def seconds_per_iteration(executor: Any, spec: Any, iterations: int, **kwargs: Any) -> float:
    marks: dict[int, float] = {}

    class Clock(Hook):
        def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
            marks[iteration] = time.perf_counter()

    (run,) = Runner(executor, hooks=[Clock()], **kwargs).run([spec])
    if run.status != "done":
        raise SystemExit(f"{run.status}: {run.error}")
    return (marks[iterations - 1] - marks[WARMUP - 1]) / (iterations - WARMUP)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=15)
    ap.add_argument("--engine", choices=["torch", "vllm", "auto"], default="auto")
    args = ap.parse_args(argv)
    raw = load_job(CONFIG).raw
    raw.update(iterations=args.iterations, threads=1, engine=args.engine)  # one torch thread, as the services
    raw["tracking"] = {"mlflow": False, "progress": False, "log_model": False}
    spec = prepare_job(load_job(raw))
    configure_torch(1)
    inline = seconds_per_iteration(InlineExecutor(), spec, args.iterations)
    dask = seconds_per_iteration(
        DaskExecutor(services=1, cpu_threads=1, service_threads=1), spec, args.iterations,
        lookahead=True, inline_below=0.01,
    )  # fmt: skip
    print(f"engine {spec.generation}, {args.iterations - WARMUP} iterations timed (after {WARMUP})")
    print(f"in-process (InlineExecutor): {inline:.3f} s/iteration")
    print(f"local Dask (DaskExecutor)  : {dask:.3f} s/iteration")
    print(f"ratio dask / in-process = {dask / inline:.3f}")


if __name__ == "__main__":
    main()
