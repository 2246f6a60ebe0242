"""Batches stay on the workers: the bytes that reach the client (the process running the planner) per
iteration, on a real local Dask cluster, for the main job's batch and a batch 16x larger, side by side.

Each size runs the main job's pipeline (configs/grpo_arithmetic.yaml: GRPO, 64 prompts x 8 samples) for
`--iterations` on `DaskExecutor` and reads `bytes_received` (pickled bytes of every result fetched into the
client) for each job per iteration, the first iteration and the job's load excluded; the two sizes run
at once, one per service. Beside it, the bytes the nodes'
outputs take when pickled (measured by running the same iterations in-process and pickling every output):
what a design that routes batches through the client would move in each direction.

    .venv/bin/python benchmarks/client_bytes.py [--iterations 6] [--scale 16] [--smoke]
"""

from __future__ import annotations

import argparse
import copy
import pickle
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plexrl.hooks.base import Hook
from plexrl.job.load import load_job
from plexrl.job.spec import JobRun, prepare_job
from plexrl.planner import Planner
from plexrl.runtime import InlineExecutor, NodeTask, Runner
from plexrl.runtime.dask import DaskExecutor

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "grpo_arithmetic.yaml"


class PicklingInline(InlineExecutor):
    """In-process executor that also pickles every node output (what a client-hub design would ship)."""

    def __init__(self) -> None:
        super().__init__(services=1)
        self.output_bytes: dict[int, int] = {}  # iteration -> bytes

    def submit(self, task: NodeTask) -> int:
        handle = super().submit(task)
        if handle in self.outputs:
            size = len(pickle.dumps(self.outputs[handle]))
            self.output_bytes[task.iteration] = self.output_bytes.get(task.iteration, 0) + size
        return handle


def client_bytes(specs: list[Any]) -> dict[str, float]:
    """Run the jobs at once, one per service; bytes fetched into the client per iteration, per job."""
    executor = DaskExecutor(services=len(specs), cpu_threads=1)
    seen: dict[tuple[str, int], int] = {}

    class Meter(Hook):
        def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
            seen[run.job_id, iteration] = executor.bytes_by_job[run.job_id]

    runs = Runner(executor, Planner(clock=executor.clock, lookahead=True, inline_below=0.01), hooks=[Meter()]).run(
        specs
    )
    out = {}
    for run in runs:
        if run.status != "done":
            raise SystemExit(f"job {run.job_id} {run.status}: {run.error}")
        last = run.iterations_done - 1
        out[run.job_id] = (seen[run.job_id, last] - seen[run.job_id, 0]) / last
    return out


def output_bytes(spec: Any) -> float:
    executor = PicklingInline()
    Runner(executor, Planner(clock=executor.clock)).run([spec])
    rows = [v for it, v in executor.output_bytes.items() if it >= 1]
    return sum(rows) / len(rows)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--scale", type=int, default=16, help="batch multiplier of the second row")
    ap.add_argument("--smoke", action="store_true", help="tiny model and batches, 3 iterations (for the tests)")
    args = ap.parse_args(argv)
    run_dir = tempfile.mkdtemp(prefix="plexrl-bytes-") if args.smoke else "runs"  # runs/: the cached warm start
    base = load_job(CONFIG).raw
    base.update(run_dir=run_dir, iterations=3 if args.smoke else args.iterations, engine="torch")
    base["tracking"] = {"mlflow": False, "progress": False, "log_model": False}
    base["warm_start"]["enabled"] = True
    if args.smoke:
        base["model"] = {"layers": 1, "hidden": 32, "heads": 2, "intermediate": 64}
        base["task"] = {"digits": 2, "train_size": 200, "eval_size": 16}
        base["warm_start"] = {"max_steps": 4, "batch_size": 16, "eval_every": 2, "eval_size": 16}
        base["pipeline"]["params"].update(batch_size=4, n=4, eval_size=16)
    batch = base["pipeline"]["params"]["batch_size"]
    specs = []
    for scale in (1, args.scale):
        raw = copy.deepcopy(base)
        raw["name"] = f"bytes-x{scale}"
        raw["pipeline"]["params"]["batch_size"] = batch * scale
        specs.append(prepare_job(load_job(raw)))
    got = client_bytes(specs)
    print(f"{'prompts x samples':<20}{'client bytes/iteration':>24}{'node outputs bytes/iteration':>30}")
    for spec in specs:
        params = spec.config.pipeline.params
        shape = f"{params['batch_size']} x {params.get('n', 8)}"
        print(f"{shape:<20}{got[spec.job_id]:>24,.0f}{output_bytes(spec):>30,.0f}", flush=True)


if __name__ == "__main__":
    main()
