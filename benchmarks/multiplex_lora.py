"""LoRA mixes: several LoRA jobs over ONE shared SmolLM2-derived base on one service, against each job alone.

The jobs are the real SmolLM2 job (`configs/grpo_smollm2_addition.yaml`: GRPO on two-digit addition from
verl-layout parquet, the real tokenizer and chat template) as LoRA jobs, each with its own seed and a remote
verifier (`--latency` seconds per batch, as a judge model or a sandbox fleet would take), on a SHORTENED
copy of SmolLM2-135M-Instruct: its embedding, first `--layers` decoder layers and final norm
(`benchmarks/_smol_short.py`, written once into `build/smollm2-short-<k>/`, ignored by git). The copy is for
speed on CPU; its rewards mean nothing, its costs are the real model's per layer. On one service the base is
loaded once and shared read-only; a switch between jobs moves only adapters and their AdamW moments
(`plexrl/engines/lora.py`); the device budget holds the base + `--resident` adapter states (default 1: every
switch swaps the adapters and their AdamW moments, megabytes, never the base; 0: no budget).

Arms in every repetition, seeds identical (benchmarks/multiplex.py's lean and multiplexed arms):
(a) alone: each job by itself in this process on the local driver (the dedicated baseline: its own service,
    its own copy of the base), its cost = 1 service x its wall time;
(b) PlexRL: all jobs on ONE service of the config's driver with each of `--orderings`; where the jobs' engine
    can run several jobs' rollouts in one call (`--engine vllm`: one LoRARequest per job,
    `plexrl/planner/batches.py`; the torch LoRA engine cannot, `JobSpec.batch_limit`), their rollouts are
    co-scheduled (`--batch-rollouts`, default auto: on with vLLM; `both` runs each ordering with and without);
(c) time-slicing (unless `--no-time-slicing`): the llm-d / OpenRL design on our executor (benchmarks/multiplex.py).
    As run, the shared base stays on the service and a hand-over moves only adapters and moments; an OpenRL
    job, a process of its own, moves its whole GPU state, base included. So the arm is also reported as
    `time-slicing+base`: every hand-over's base out and in added at the seconds this machine's swap path takes
    for the base's bytes (`benchmarks/_openrl.py`, measured first; not run inside the service), and PlexRL is
    compared against that one, and against it at the copy bound (the peer at its best).
Printed per arm: accelerator-seconds per step (and training steps per accelerator-second, multiplexed / alone,
goal >= 2.5x, the anchor being SkyRL's 2.81x experiment throughput on one node) next to its bound
(`plexrl.accounting.cost_bound`: the jobs' busy service seconds alone), every job's slowdown (multiplexed
completion / alone, goal <= 1.5) next to the slowdown bound, the move-record summary (`_arms.move_totals`),
the service's busy / swap / idle seconds with the idle seconds by reason, then benchmarks/multiplex.py's llm-d /
OpenRL figures and PlexRL / time-slicing+base per job (goals: cost <= 0.8x, no job slower).

One iteration of the first job alone runs untimed first (the process's one-time costs).

    .venv/bin/python benchmarks/multiplex_lora.py [--jobs 4] [--layers 4] [--iterations 20] [--reps 1]
        [--latency 1.0] [--batch 8] [--n 8] [--rank 16] [--resident 1] [--driver dask|local] [--orderings hrrs,deadline]
        [--engine torch|vllm] [--kv-cache-mb 256] [--batch-rollouts [auto|on|off|both]] [--smoke]

`--engine vllm`: the rollouts on one LoRA-enabled vLLM engine per service (`plexrl/engines/vllm_lora.py`: the
base loaded once, each job under its own LoRARequest, a weight sync registers the adapter only); the device
budget then counts that engine once beside the base and the resident adapter states. Co-scheduled rollouts
(arm `<ordering>+batched`, cluster `batch_rollouts: true`): the rollouts of jobs queued together on the
service run as ONE vLLM call, a LoRARequest per job; each job samples its own tokens (the alone arm is
unchanged). `--batch-rollouts` alone means `both`.

`--smoke`: 2 jobs on a 1-layer copy, 1 iteration of 2 prompts x 2 samples, local driver (the tests run it;
its figures mean nothing). Run it alone on the machine: other processes on the 2 cores distort every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' helpers, run from anywhere

from _openrl import base_line, base_moves, with_base_moves
from _smol_short import short_copy
from multiplex import SLICING, Alone, Mux, against_slicing, run_alone, run_mux, spread, with_iterations

from plexrl.cluster import LoadedCluster, load_cluster

ROOT = Path(__file__).resolve().parents[1]
BASE = f"{SLICING}+base"  # the time-slicing arm with an OpenRL job's base moves added (`benchmarks/_openrl.py`)
DATA = ROOT / "runs" / "data" / "addition"


def lora_cluster_file(args: argparse.Namespace, model: Path, run_dir: Path) -> Path:
    """Write the mix's cluster YAML into `run_dir`: `args.jobs` LoRA jobs on ONE service."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lora = {"r": args.rank, "alpha": 2.0 * args.rank, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    jobs = []
    for i in range(args.jobs):
        jobs.append({"config": str(ROOT / "configs" / "grpo_smollm2_addition.yaml"), "set": {
            "name": f"lora-{i}", "seed": i, "engine": args.engine, "run_dir": str(run_dir),
            "vllm.kv_cache_mb": args.kv_cache_mb,
            "model.pretrained": None, "model.path": str(model), "model.lora": lora,
            "data.train": str(DATA / "train.parquet"), "data.held_out": str(DATA / "test.parquet"),
            "pipeline.params.batch_size": args.batch, "pipeline.params.n": args.n,
            "pipeline.params.max_new_tokens": args.max_new_tokens, "pipeline.params.optimiser.minibatches": 1,
            "pipeline.params.optimiser.lr": 1e-4,
            "pipeline.params.eval_every": 10**6, "pipeline.params.eval_size": 4,
            "pipeline.params.verifier_latency_s": args.latency,
            "tracking.mlflow": False, "tracking.progress": False, "tracking.log_model": False,
        }})  # fmt: skip
    cluster = {
        "name": "multiplex-lora",
        "run_dir": str(run_dir),
        "driver": args.driver,
        "cpu_threads": 2,
        "services": {"count": 1, "device": "cpu", "threads": 1},
        "placement": "pack",
        "max_load": 64.0,
        "mlflow": False,
        "progress": False,
        "jobs": jobs,
    }
    if args.resident > 0:  # the base once + `resident` adapter states (+ a quarter of one: estimates move)
        from plexrl.sizes import lora_state_bytes, model_bytes

        state = lora_state_bytes(model, args.rank, lora["target_modules"])  # type: ignore[arg-type]
        budget = model_bytes(model) + args.resident * state + state // 4
        if args.engine == "vllm":  # the LoRA-enabled vLLM engine, once per service: its base, KV cache, slots
            from plexrl.engines.vllm_lora import lora_engine_bytes

            budget += lora_engine_bytes(model, args.rank, args.kv_cache_mb * 2**20)
        cluster["services"]["device_memory"] = budget  # type: ignore[index]
    path = run_dir / "multiplex-lora.yaml"
    path.write_text("# written by benchmarks/multiplex_lora.py\n" + yaml.safe_dump(cluster, sort_keys=False))
    return path


def report(lean: list[dict[str, Alone]], mux: list[Mux], ordering: str) -> None:
    """The per-job slowdowns and the throughput ratio, each next to its bound and goal."""
    from plexrl.accounting import cost_bound, slowdown_bound

    jobs = list(lean[0])
    print(f"\nordering {ordering}")
    print(f"{'job':<10}{'steps':>6}{'alone s':>9}{'mux s':>9}{'slowdown':>30}")
    for j in jobs:
        sd = [m.completion[j] / r[j].wall for r, m in zip(lean, mux, strict=True)]
        alone, done = statistics.mean(r[j].wall for r in lean), statistics.mean(m.completion[j] for m in mux)
        print(f"{j:<10}{lean[0][j].steps:>6}{alone:>9.1f}{done:>9.1f}{spread(sd):>30}")
    per_alone = [sum(a.steps for a in r.values()) / sum(a.wall for a in r.values()) for r in lean]
    per_mux = [1.0 / m.cps for m in mux]
    ratio = [m / a for m, a in zip(per_mux, per_alone, strict=True)]
    busy = [[a.svc * a.steps for a in r.values()] for r in lean]
    steps = [[a.steps for a in r.values()] for r in lean]
    best = [1.0 / cost_bound(b, s) / a for b, s, a in zip(busy, steps, per_alone, strict=True)]
    sd_bound = [slowdown_bound(b, [a.wall for a in r.values()]) for b, r in zip(busy, lean, strict=True)]
    worst = [max(m.completion[j] / r[j].wall for j in jobs) for r, m in zip(lean, mux, strict=True)]
    print(f"accelerator-seconds per step: {spread([m.cps for m in mux])}, bound "
          f"{spread([cost_bound(b, s) for b, s in zip(busy, steps, strict=True)])}")  # fmt: skip
    print(f"training steps per accelerator-second: alone {spread(per_alone)}, multiplexed {spread(per_mux)}")
    print(f"multiplexed / alone = {spread(ratio)}x (goal >= 2.5x), bound {spread(best)}x "
          f"(the jobs' busy service seconds alone: plexrl.accounting.cost_bound)")  # fmt: skip
    print(f"largest slowdown {spread(worst)} (goal <= 1.5), bound {spread(sd_bound)} (slowdown_bound: "
          f"earliest-deadline-first on those busy seconds)")  # fmt: skip
    statuses = [s for m in mux for s in m.statuses] + [a.status for r in lean for a in r.values()]
    if any(s != "done" for s in statuses):
        raise SystemExit("a job did not finish; the figures above are not comparable")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=4, help="LoRA jobs on the one service (default 4)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the SmolLM2 copy (default 4 of 30)")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--latency", type=float, default=1.0, help="remote verifier seconds per batch (default 1.0)")
    ap.add_argument("--batch", type=int, default=8, help="prompts per iteration")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (q/k/v/o of every layer)")
    ap.add_argument("--resident", type=int, default=1, help="adapter states the device holds beside the base "
                    "(default 1: every switch swaps adapters and moments; 0: no budget)")  # fmt: skip
    ap.add_argument("--driver", choices=["dask", "local"], default="dask")
    ap.add_argument(
        "--engine",
        choices=["torch", "vllm"],
        default="torch",
        help="the rollout engine: torch, or vLLM with one LoRARequest per job (default torch)",
    )
    ap.add_argument("--kv-cache-mb", type=int, default=256, help="the vLLM engine's KV cache (--engine vllm)")
    ap.add_argument("--orderings", default="hrrs", help="comma-separated orderings of the multiplexed arm")
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "multiplex-lora")
    ap.add_argument(
        "--batch-rollouts",
        nargs="?",
        const="both",
        default="auto",
        choices=["auto", "on", "off", "both"],
        help="PlexRL's arms: co-schedule the jobs' rollouts into one vLLM call (auto: with --engine vllm; "
        "both: each ordering with and without; alone: both)",
    )
    ap.add_argument("--no-time-slicing", action="store_true", help="skip the time-slicing arm (the llm-d / OpenRL "
                    "design on our executor, run by default beside the orderings)")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="2 jobs, 1 layer, 1 iteration of 2 x 2, local (tests)")
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="plexrl-multiplex-lora-") if args.smoke else None
    if tmp is not None:
        args.run_dir = Path(tmp.name)
        args.jobs, args.layers, args.iterations, args.reps = 2, 1, 1, 1
        args.batch, args.n, args.max_new_tokens, args.latency, args.driver = 2, 2, 4, 0.05, "local"
    if args.jobs < 1 or args.reps < 1:
        ap.error("--jobs and --reps must be at least 1")
    if args.batch_rollouts in ("on", "both") and args.engine != "vllm":
        ap.error("--batch-rollouts mixes LoRA adapters in one vLLM call: add --engine vllm")
    batch = "on" if args.batch_rollouts == "auto" and args.engine == "vllm" else args.batch_rollouts
    logging.basicConfig(level=logging.WARNING)
    if not (DATA / "train.parquet").is_file():
        from real_model import write_data

        write_data(DATA)
    model = short_copy(args.layers)
    cluster: LoadedCluster = with_iterations(
        load_cluster(lora_cluster_file(args, model, args.run_dir)), args.iterations
    )
    from plexrl.job.spec import prepare_job
    from plexrl.runtime.jobs import configure_torch

    for job in cluster.jobs:
        prepare_job(job)
    # untimed: one iteration of the first job alone pays the process's one-time costs (the parquet files, the
    # tokenizer, torch's first kernels), which would otherwise land on the first job's alone time
    configure_torch(cluster.config.services.threads)
    run_alone(with_iterations(dataclasses.replace(cluster, jobs=cluster.jobs[:1]), 1), "local", "warm-up")
    orderings = args.orderings.split(",")
    if not args.no_time_slicing and SLICING not in orderings:
        orderings.append(SLICING)  # the llm-d / OpenRL design on our executor, side by side
    # PlexRL's orderings with co-scheduled rollouts (one vLLM call per cohort, cluster batch_rollouts: true) where
    # the engine can; `both`: also one call per job, side by side against the same alone arm
    batched = dataclasses.replace(cluster, config=cluster.config.model_copy(update={"batch_rollouts": True}))
    arms: dict[str, LoadedCluster] = {}
    for o in orderings:
        if o == SLICING or batch in ("off", "both", "auto"):
            arms[o] = cluster
        if o != SLICING and batch in ("on", "both"):  # time-slicing: one job's node at a time
            arms[f"{o}+batched"] = batched
    print("co-scheduled rollouts: " + ("on (one vLLM call per cohort)" if batch in ("on", "both") else
          "off (the torch LoRA engine runs one job per call; co-scheduling needs --engine vllm)"))  # fmt: skip
    bases, moves = base_moves(cluster) if SLICING in orderings else ({}, {})
    lean: list[dict[str, Alone]] = []
    mux: dict[str, list[Mux]] = {o: [] for o in arms}
    for i in range(args.reps):
        print(
            f"repetition {i + 1}/{args.reps}: {args.jobs} LoRA jobs on a {args.layers}-layer SmolLM2 copy", flush=True
        )
        configure_torch(cluster.config.services.threads)
        lean.append(run_alone(cluster, "local", "alone"))
        for arm, loaded in arms.items():
            mux[arm].append(run_mux(loaded, arm.split("+")[0]))
    if SLICING in mux:  # what an OpenRL job's own base would add at each hand-over (`benchmarks/_openrl.py`)
        mux[BASE] = [with_base_moves(m, bases, moves) for m in mux[SLICING]]
        print("\n" + "\n".join(base_line(m, bases, moves) for m in mux[SLICING]))
    for arm in mux:
        report(lean, mux[arm], arm)
    against_slicing(lean, mux, BASE if BASE in mux else None)
    if BASE in mux:
        at_bound = [with_base_moves(m, bases, moves, bound=True) for m in mux[SLICING]]
        for arm in (a for a in mux if a.split("+")[0] != SLICING):
            ratio = [m.cps / t.cps for m, t in zip(mux[arm], at_bound, strict=True)]
            print(f"{arm} / {BASE} with its base moves at the copy bound (the peer at its best): cost {spread(ratio)}")
    print(f"({args.reps} repetition(s); mean +- sample sd [min, max]; base: {model})")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
