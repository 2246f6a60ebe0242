"""Every built-in algorithm on the arithmetic task with the same budget, seed and warm start, one after
another in one process; prints held-out greedy accuracy before (the shared warm start) and after, and wall
time per algorithm.

    .venv/bin/python benchmarks/algorithms.py [--iterations 200] [--run-dir runs/bench-algorithms]
"""

from __future__ import annotations

import argparse
import time

from plexrl.config import BUILTIN_PIPELINES, load_job
from plexrl.runtime.jobs import run_jobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--run-dir", default="runs/bench-algorithms")
    ap.add_argument("--only", nargs="*", default=sorted(BUILTIN_PIPELINES))
    args = ap.parse_args()
    rows = []
    for name in args.only:
        raw = {
            "name": f"bench-{name}",
            "iterations": args.iterations,
            "run_dir": args.run_dir,
            "pipeline": {"name": name, "params": {"eval_every": args.iterations}},
            "tracking": {"progress": False, "log_model": False, "experiment": "plexrl-algorithms"},
        }
        start = time.perf_counter()
        (job,) = run_jobs([load_job(raw)], progress=False)
        wall = time.perf_counter() - start
        acc = job.series("evaluate/accuracy")
        rows.append((name, job.status, acc[0], acc[-1], wall))
        print(f"{name:<13} {job.status:<6} accuracy {acc[0]:.3f} -> {acc[-1]:.3f}  {wall:6.1f} s", flush=True)
    print(f"\n| algorithm | held-out accuracy before | after {args.iterations} iterations | wall s |")
    print("|---|---|---|---|")
    for name, _status, before, after, wall in rows:
        print(f"| {name} | {before:.3f} | {after:.3f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
