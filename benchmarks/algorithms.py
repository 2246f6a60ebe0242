"""Every built-in algorithm on the arithmetic task with the same budget, seed and warm start, one after
another in one process; prints held-out greedy accuracy before (the shared warm start) and after, and wall
time per algorithm.

    .venv/bin/python benchmarks/algorithms.py [--iterations 200] [--run-dir runs/bench-algorithms] [--smoke]

`--smoke`: every algorithm for 1 iteration on a tiny job (benchmarks/_tiny.py) in a temporary directory
(the test suite runs it; the warm start is built once and shared).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from plexrl.job.load import BUILTIN_PIPELINES, load_job
from plexrl.runtime.jobs import run_jobs


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--run-dir", default="runs/bench-algorithms")
    ap.add_argument("--only", nargs="*", default=sorted(BUILTIN_PIPELINES))
    ap.add_argument("--smoke", action="store_true", help="1 iteration of each on a tiny job (for the tests)")
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="plexrl-algorithms-") if args.smoke else None
    if tmp is not None:
        args.iterations, args.run_dir = 1, tmp.name
    rows = []
    for name in args.only:
        raw: dict[str, Any] = {
            "name": f"bench-{name}",
            "iterations": args.iterations,
            "run_dir": args.run_dir,
            "pipeline": {"name": name, "params": {"eval_every": args.iterations}},
            "tracking": {"progress": False, "log_model": False, "experiment": "plexrl-algorithms"},
        }
        if tmp is not None:
            from _tiny import tiny_job

            raw = tiny_job(tmp.name, name=f"bench-{name}", iterations=1)
            params: dict[str, Any] = {"batch_size": 4, "n": 4, "eval_every": 1, "eval_size": 8}
            if name == "grpo_tools":  # its own task, and a token budget per episode
                raw["task"] = {"name": "tool_arithmetic", "digits": 2, "train_size": 200, "eval_size": 16}
                params.update(n=2, max_new_tokens=4, token_budget=16, max_output_tokens=8)
            raw["pipeline"] = {"name": name, "params": params}
        start = time.perf_counter()
        (job,) = run_jobs([load_job(raw)], progress=False)
        wall = time.perf_counter() - start
        acc = job.series("evaluate/accuracy")
        rows.append((name, job.status, acc[0], acc[-1], wall))
        print(f"{name:<13} {job.status:<6} accuracy {acc[0]:.3f} -> {acc[-1]:.3f}  {wall:6.1f} s", flush=True)
    if tmp is not None:
        tmp.cleanup()
    print(f"\n| algorithm | held-out accuracy before | after {args.iterations} iterations | wall s |")
    print("|---|---|---|---|")
    for name, _status, before, after, wall in rows:
        print(f"| {name} | {before:.3f} | {after:.3f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
