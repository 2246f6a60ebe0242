"""What the pipeline machinery costs: the same GRPO iterations run (a) through PlexRL (planner, the Runner
over the in-process executor, hooks incl. MLflow; `time/iteration` counts the hooks) and (b) as a
hand-written loop calling the same operator functions directly, side by side in one process. Prints
seconds per iteration of each and their ratio.

    .venv/bin/python benchmarks/pipeline_overhead.py [--iterations 30] [--mlflow/--no-mlflow] [--smoke]

`--smoke`: a tiny job (benchmarks/_tiny.py), 2 iterations, in a temporary directory (the test suite runs it).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from plexrl.job.load import load_job
from plexrl.job.spec import prepare_job
from plexrl.operator import OpContext
from plexrl.runtime.jobs import configure_torch, run_jobs
from plexrl.services.service import Service


def hand_loop(job: Any, iterations: int) -> float:
    """Call the operators of the job's graph in topological order with no planner, runner or hooks."""
    service = Service("bench")
    service.load_job(job)
    start = time.perf_counter()
    for it in range(iterations):
        outputs: dict[str, Any] = {}
        for node in job.graph.nodes:
            if not node.active(it, iterations):
                continue
            inputs = {p: outputs[s] for p, s in node.inputs.items()}
            if node.runs_on == "service":
                outputs[node.name] = service.run_node(job.job_id, it, node.name, inputs).output
            else:
                ctx = OpContext(job.job_id, it, node.name, job.config.seed, job.task, job.tokenizer)
                outputs[node.name] = node.operator.run(ctx, inputs, node.params)
    return (time.perf_counter() - start) / iterations


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--mlflow", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--smoke", action="store_true", help="a tiny job, 2 iterations (for the tests)")
    args = ap.parse_args(argv)
    run_dir = tempfile.mkdtemp(prefix="plexrl-bench-")
    tracking = {"mlflow": args.mlflow, "progress": False, "log_model": False}
    raw: dict[str, Any] = {"run_dir": run_dir, "iterations": args.iterations, "tracking": tracking}
    warmup = 5
    if args.smoke:
        from _tiny import tiny_job

        raw = tiny_job(run_dir, iterations=2, tracking=tracking)
        args.iterations, warmup = 2, 1
    loaded = load_job(copy.deepcopy(raw))
    configure_torch(loaded.config.threads)
    job = prepare_job(loaded)  # warm start, cached for both runs
    hand_loop(job, warmup)  # warm-up (allocator, kernels) so that order does not favour either side
    before = hand_loop(job, args.iterations)
    (done,) = run_jobs([load_job(copy.deepcopy(raw))], progress=False)
    per_iteration = [row["time/iteration"] for row in done.history if "time/iteration" in row]  # not the baseline
    plex = sum(per_iteration) / len(per_iteration)
    after = hand_loop(job, args.iterations)
    hand = (before + after) / 2
    print(f"iterations: {args.iterations} (batch {loaded.graph.node('prompts').params.model_dump()})")
    runs = f"runs before/after: {before * 1000:.1f}, {after * 1000:.1f}"
    print(f"hand-written loop : {hand * 1000:8.1f} ms / iteration ({runs})")
    print(f"plexrl pipeline   : {plex * 1000:8.1f} ms / iteration (mlflow={'on' if args.mlflow else 'off'})")
    print(f"ratio plexrl / hand = {plex / hand:.3f}")


if __name__ == "__main__":
    main()
