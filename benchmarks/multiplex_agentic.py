"""The agentic mix: a multi-turn tool-calling job whose tool calls take 0.5-3 s, beside a plain GRPO job and a
LoRA job, on ONE service (`configs/multiplex_agentic.yaml`); each job alone, exclusive time-slicing and PlexRL
side by side in every repetition.

The jobs (see the config): `agent` (configs/grpo_tools.yaml, up to 3 model turns per episode, every tool call
a sandboxed Python process whose code takes 0.5-3 s: plexrl/job/tasks/timed_calls.py), `grpo` (the README's
GRPO job) and `lora` (a LoRA job over SmolLM2-135M-Instruct, here on a `--layers`-layer copy for speed:
benchmarks/_smol_short.py; 0 keeps the real model). With the copy the device budget is recomputed to hold the
same things: the base, the adapter state and one of the two full states.

Arms in every repetition, seeds identical (benchmarks/multiplex.py's): (a) alone: each job by itself in this
process on the local driver, the dedicated baseline; (b) time-slicing, the llm-d / OpenRL design on our
executor, with the LoRA job's base moves an OpenRL job would make at each of its hand-overs added as
`time-slicing+base` (benchmarks/_openrl.py: measured on the swap path, not run inside the service); (c)
PlexRL with each of `--orderings` (default: the config's).

Printed per arm: accelerator-seconds per step next to its bound (`plexrl.accounting.cost_bound`: the jobs' busy
service seconds alone / their steps); each job's slowdown against alone next to the slowdown bound, and its
completion against time-slicing+base (goal: none above 1); where the service's seconds went: busy (duty
cycle), swaps (blocking, in the background) and idle by reason (what the jobs ran off the service meanwhile:
`tools` is a tool round); then benchmarks/multiplex.py's llm-d / OpenRL figures and PlexRL / time-slicing+base
(goal: cost <= 0.8x). Each multiplexed run also prints its service accounting and move records as it ends.

    .venv/bin/python benchmarks/multiplex_agentic.py [--iterations N] [--reps 1] [--layers 2]
        [--driver dask|local] [--orderings hrrs] [--smoke]

`--smoke`: tiny jobs (a 1-layer agent whose calls are the plain sandboxed `PythonExpression`, a tiny GRPO job,
a LoRA job on a 1-layer copy), 1 iteration, local driver, in a temporary directory (the tests run it; its
figures mean nothing). Run it alone on the machine: other processes on the 2 cores distort every figure.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' helpers, run from anywhere

from _arms import format_idle
from _openrl import base_line, base_moves, with_base_moves
from multiplex import SLICING, Alone, Mux, against_slicing, run_alone, run_mux, spread, with_iterations

from plexrl.cluster import LoadedCluster, load_cluster

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "multiplex_agentic.yaml"
DATA = ROOT / "runs" / "data" / "addition"
BASE = f"{SLICING}+base"  # time-slicing with an OpenRL job's base moves added (`benchmarks/_openrl.py`)
TINY_MODEL = {"layers": 1, "hidden": 32, "heads": 2, "intermediate": 64, "max_position": 64}
SMOKE_SET: dict[str, dict[str, Any]] = {  # per job of the config, what `--smoke` overrides
    "agent": {
        "model": TINY_MODEL,
        "task": {"name": "tool_arithmetic", "digits": 2, "digits_b": 1, "train_size": 200, "eval_size": 8},
        "warm_start": {"max_steps": 4, "batch_size": 16, "eval_every": 2, "eval_size": 8},
        "pipeline.params.tool": "plexrl.job.tasks.python_calls:PythonExpression",
        "pipeline.params.batch_size": 2,
        "pipeline.params.n": 2,
        "pipeline.params.max_turns": 2,
        "pipeline.params.token_budget": 30,
        "pipeline.params.eval_size": 4,
    },
    "grpo": {
        "model": TINY_MODEL,
        "task": {"digits": 2, "train_size": 200, "eval_size": 8},
        "warm_start": {"max_steps": 4, "batch_size": 16, "eval_every": 2, "eval_size": 8},
        "pipeline.params.batch_size": 2,
        "pipeline.params.n": 2,
    },
    "lora": {"pipeline.params.batch_size": 2, "pipeline.params.n": 2, "pipeline.params.max_new_tokens": 4},
}


def agentic_cluster(args: argparse.Namespace, run_dir: Path) -> LoadedCluster:
    """The config's mix, written into `run_dir` with the benchmark's settings (the LoRA job on the short copy,
    the driver, `--smoke`'s tiny jobs) and loaded, iterations set, MLflow and progress bars off."""
    raw = yaml.safe_load(CONFIG.read_text())
    raw["run_dir"] = str(run_dir)
    if args.driver is not None:
        raw["driver"] = args.driver
    for entry in raw["jobs"]:
        entry["config"] = str(ROOT / "configs" / entry["config"])  # the written file lives elsewhere
        sets = entry["set"]
        sets.update({"run_dir": str(run_dir), "tracking.mlflow": False, "tracking.progress": False})
        if sets["name"] == "lora":
            sets.update({"data.train": str(DATA / "train.parquet"), "data.held_out": str(DATA / "test.parquet")})
            if args.layers:
                from _smol_short import short_copy

                sets.update({"model.pretrained": None, "model.path": str(short_copy(args.layers))})
        if args.smoke:
            sets.update(copy.deepcopy(SMOKE_SET[sets["name"]]))
    path = run_dir / "multiplex-agentic.yaml"
    path.write_text("# written by benchmarks/multiplex_agentic.py\n" + yaml.safe_dump(raw, sort_keys=False))
    cluster = with_iterations(load_cluster(path), args.iterations)
    if args.layers:  # the config's budget, for the copy: the base, the adapter state, one of the full states
        cluster = with_budget(cluster)
    return cluster


def with_budget(cluster: LoadedCluster) -> LoadedCluster:
    """`cluster` with a device budget that holds its LoRA base and state and the larger full state, and half of
    the smaller one (so the two full states do not fit side by side)."""
    from plexrl.job.spec import prepare_job
    from plexrl.sizes import model_bytes

    specs = [prepare_job(job) for job in cluster.jobs]
    lora = [s for s in specs if s.config.model.lora is not None]
    full = sorted(s.state_bytes() for s in specs if s.config.model.lora is None)
    budget = sum(model_bytes(s.model_path, s.config.model.dtype) + s.state_bytes() for s in lora)
    budget += (full[-1] + full[0] // 2) if full else 0
    services = cluster.config.services.model_copy(update={"device_memory": budget})
    return dataclasses.replace(cluster, config=cluster.config.model_copy(update={"services": services}))


def service_line(runs: Sequence[Mux]) -> str:
    """Where one arm's service seconds went, over its runs (means)."""
    busy = statistics.mean(m.duty * m.makespan for m in runs)
    makespan = statistics.mean(m.makespan for m in runs)
    blocking = statistics.mean(m.swap[0] for m in runs)
    background = statistics.mean(m.swap[1] for m in runs)
    reasons = {k: statistics.mean(m.idle.get(k, 0.0) for m in runs) for m in runs for k in m.idle}
    return (f"makespan {makespan:.1f} s: busy {busy:.1f} s (duty cycle {busy / makespan:.0%}), swaps blocking "
            f"{blocking:.2f} s + in the background {background:.2f} s, idle {format_idle(reasons)}")  # fmt: skip


def summary(lean: list[dict[str, Alone]], arms: dict[str, list[Mux]]) -> None:
    """Per arm: cost next to its bound, each job's slowdown next to the slowdown bound and against time-slicing
    with the base moves, and where the service's seconds went."""
    from plexrl.accounting import cost_bound, slowdown_bound

    busy = [[a.svc * a.steps for a in r.values()] for r in lean]
    bound = [cost_bound(b, [a.steps for a in r.values()]) for b, r in zip(busy, lean, strict=True)]
    sd_bound = [slowdown_bound(b, [a.wall for a in r.values()]) for b, r in zip(busy, lean, strict=True)]
    ts = arms.get(BASE)
    jobs = list(lean[0])
    for arm, runs in arms.items():
        cps = [m.cps for m in runs]
        print(f"\n{arm}: {spread(cps)} acc-s/step, bound {spread(bound)} "
              f"(= {spread([c / b for c, b in zip(cps, bound, strict=True)])}x the bound)")  # fmt: skip
        print(f"  {'job':<8}{'steps':>6}{'alone s':>9}{'mux s':>9}{'slowdown vs alone':>26}{f'vs {BASE}':>28}")
        for j in jobs:
            sd = [m.completion[j] / r[j].wall for r, m in zip(lean, runs, strict=True)]
            vs = [m.completion[j] / t.completion[j] for m, t in zip(runs, ts, strict=True)] if ts else [float("nan")]
            alone, done = statistics.mean(r[j].wall for r in lean), statistics.mean(m.completion[j] for m in runs)
            print(f"  {j:<8}{lean[0][j].steps:>6}{alone:>9.1f}{done:>9.1f}{spread(sd):>26}{spread(vs):>28}")
        worst = [max(m.completion[j] / r[j].wall for j in jobs) for r, m in zip(lean, runs, strict=True)]
        print(f"  largest slowdown vs alone {spread(worst)}, bound {spread(sd_bound)} (slowdown_bound: "
              f"earliest-deadline-first on the busy seconds alone)")  # fmt: skip
        print(f"  service: {service_line(runs)}")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, help="iterations of every job (default: each job's in the config)")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of the arms (default 1)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the LoRA job's SmolLM2 copy "
                    "(default 2; 0: the real 30-layer model)")  # fmt: skip
    ap.add_argument("--driver", choices=["dask", "local"], help="the multiplexed arms' driver (default: config's)")
    ap.add_argument("--orderings", help="comma-separated PlexRL orderings (default: the config's)")
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "multiplex-agentic")
    ap.add_argument("--smoke", action="store_true", help="tiny jobs, 1 iteration, local driver (tests)")
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="plexrl-multiplex-agentic-") if args.smoke else None
    if tmp is not None:
        args.run_dir, args.iterations, args.reps, args.layers, args.driver = Path(tmp.name), 1, 1, 1, "local"
    if args.reps < 1 or args.layers < 0:
        ap.error("--reps must be at least 1 and --layers at least 0")
    logging.basicConfig(level=logging.WARNING)
    if not (DATA / "train.parquet").is_file():
        from real_model import write_data

        write_data(DATA)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    cluster = agentic_cluster(args, args.run_dir)
    from plexrl.job.spec import prepare_job
    from plexrl.runtime.jobs import configure_torch

    for job in cluster.jobs:
        prepare_job(job)  # warm starts first (cached), so no arm pays for them
    configure_torch(cluster.config.services.threads)
    first = [j for j in cluster.jobs if j.config.model.lora is not None] or cluster.jobs[:1]  # parquet, tokenizer
    run_alone(with_iterations(dataclasses.replace(cluster, jobs=first[:1]), 1), "local", "warm-up")
    orderings = [SLICING, *(args.orderings.split(",") if args.orderings else [cluster.config.ordering])]
    bases, moves = base_moves(cluster)
    lean: list[dict[str, Alone]] = []
    arms: dict[str, list[Mux]] = {o: [] for o in orderings}
    for i in range(args.reps):
        print(f"repetition {i + 1}/{args.reps}: {', '.join(j.config.name for j in cluster.jobs)}", flush=True)
        configure_torch(cluster.config.services.threads)
        lean.append(run_alone(cluster, "local", "alone"))
        for o in orderings:
            arms[o].append(run_mux(cluster, o))
    print("\n" + "\n".join(base_line(m, bases, moves) for m in arms[SLICING]))
    arms = {BASE: [with_base_moves(m, bases, moves) for m in arms[SLICING]], **arms}
    summary(lean, arms)
    against_slicing(lean, arms, BASE)
    print(f"({args.reps} repetition(s); mean +- sample sd [min, max])")
    if tmp is not None:
        tmp.cleanup()
    bad = [s for runs in arms.values() for m in runs for s in m.statuses] + [a.status for r in lean for a in r.values()]
    if any(s != "done" for s in bad):
        raise SystemExit("a job did not finish; the figures above are not comparable")


if __name__ == "__main__":
    main()
