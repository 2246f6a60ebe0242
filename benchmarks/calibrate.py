"""Calibration against reality: fit the simulator's costs from one REAL run of a cluster config, then predict
a SECOND real run of it (isolated and multiplexed, measured as `benchmarks/multiplex.py` measures them) and
print prediction vs measurement side by side with the errors.

1. fit run: the mix multiplexed, as configured (real Dask cluster, real models); its timeline is recorded;
2. target: each job alone on its own service (isolated), then the mix multiplexed: the figures to predict;
3. `plexrl.sim.calibrate.fit` on (1), `predict` with the config's placement, ordering, budgets, lookahead and
   CPU pool size; compare with (2): accelerator-seconds per step isolated and multiplexed, their ratio, and
   every job's slowdown. Goal: within 15%.

    .venv/bin/python benchmarks/calibrate.py [--config configs/multiplex.yaml] [--iterations 20]
        [--engine auto|vllm|torch] [--fit-isolated] [--save runs/calibrate/recording.pkl] [--replay FILE]

`--fit-isolated`: the fit run also records each job alone, and the isolated side of the prediction uses
that recording (a job alone has the machine to itself: its nodes and round trips are faster).

Run it alone on the machine (2 cores): the fit run and the target run must see the same machine.

`--moves FILE`: no run; fit the swap model to a run's move records (its `moves.json`, e.g. from the `mux` part of
`benchmarks/gpu_check.sh` on a GPU) and print the scenario constants they stand for (`host_gbps`,
`switch_fixed_s`; docs/simulator.md), with the first-touch rate of the moves that made a buffer.

`--smoke`: a tiny two-job mix (benchmarks/_tiny.py) on the local driver, 2 iterations, in a temporary
directory, nothing saved (the test suite runs it; its errors mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import pickle
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from plexrl.cluster import load_cluster, run_cluster
from plexrl.runtime.runner import Budgets
from plexrl.sim.calibrate import fit, merge, predict, swap_constants

HERE = Path(__file__).resolve().parent


def _multiplex_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_multiplex", HERE / "multiplex.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def record(args: argparse.Namespace) -> dict[str, Any]:
    """The real runs: the fit run (multiplexed, and each job alone with --fit-isolated) and the target run
    (each job alone, then multiplexed). Returns what the prediction needs, picklable."""
    mux = _multiplex_module()
    cluster = mux.with_iterations(load_cluster(args.config), args.iterations, args.engine)
    cfg = cluster.config
    from plexrl.job.spec import prepare_job

    for job in cluster.jobs:  # warm starts first (cached)
        prepare_job(job)
    t0 = time.time()
    fit_res = run_cluster(cluster)
    plans = {h.job_id: h.spec.plan() for h in fit_res.jobs}
    rec: dict[str, Any] = {"plans": plans, "mux_spans": [asdict(x) for x in fit_res.spans], "iso_spans": {},
                           "mux_moves": fit_res.moves}  # fmt: skip
    print(f"fit run: {time.time() - t0:.1f}s", flush=True)
    alone_cfg = cfg.model_copy(update={"services": cfg.services.model_copy(update={"count": 1}),
                                       "placement": "isolated"})  # fmt: skip
    if args.fit_isolated:
        for job in cluster.jobs:
            iso_res = run_cluster(dataclasses.replace(cluster, config=alone_cfg, jobs=[job]))
            rec["iso_spans"][job.config.name] = [asdict(x) for x in iso_res.spans]
    iso: dict[str, float] = {}
    steps: dict[str, int] = {}
    for job in cluster.jobs:
        (h,) = run_cluster(dataclasses.replace(cluster, config=alone_cfg, jobs=[job])).jobs
        iso[h.job_id] = (h.finished_at or 0.0) - (h.started_at or 0.0)
        steps[h.job_id] = h.iterations_done
    res = run_cluster(cluster)
    first = min(h.started_at or 0.0 for h in res.jobs)
    s = cfg.services
    rec["target"] = {
        "iso": iso,
        "steps": steps,
        "completion": {h.job_id: (h.finished_at or 0.0) - first for h in res.jobs},
    }
    rec["settings"] = {
        "services": s.count, "placement": cfg.placement, "ordering": cfg.ordering, "max_load": cfg.max_load,
        "lookahead": cfg.driver == "dask" and cfg.lookahead, "cpu_slots": cfg.cpu_threads,
        "budgets": tuple(int(b) if b is not None else None for b in (s.device_memory, s.host_memory, s.disk)),
    }  # fmt: skip
    return rec


def report(rec: dict[str, Any]) -> None:
    plans = rec["plans"]
    fitted = fit(rec["mux_spans"], plans, rec.get("mux_moves", ()))  # (a recording from before move records: spans)
    fresh = (f", the first {fitted.fresh_moves} at {fitted.fresh_bandwidth / 1e9:.2f} GB/s (buffers made)"
             if fitted.fresh_moves else "")  # fmt: skip
    print(f"fitted: round trip cpu {fitted.dispatch_cpu * 1e3:.1f} ms (median of {fitted.gaps['cpu']}), service "
          f"{fitted.dispatch_service * 1e3:.1f} ms (median of {fitted.gaps['service']}); swaps "
          f"{fitted.swap_bandwidth / 1e9:.2f} GB/s + {fitted.move_fixed_s * 1e3:.2f} ms a move{fresh} "
          f"({fitted.swap_from}); loads "
          + ", ".join(f"{j} {s:.1f}s" for j, s in sorted(fitted.load_seconds.items())))  # fmt: skip
    iso_fit = None
    if rec["iso_spans"]:
        iso_fit = merge([fit(spans, {j: plans[j]}) for j, spans in rec["iso_spans"].items()])
        print(f"fitted, isolated: round trip cpu {iso_fit.dispatch_cpu * 1e3:.1f} ms, service "
              f"{iso_fit.dispatch_service * 1e3:.1f} ms")  # fmt: skip
    st, tg = rec["settings"], rec["target"]
    pred = predict(
        fitted, plans, services=st["services"], placement=st["placement"], ordering=st["ordering"],
        budgets=Budgets(*st["budgets"]), max_load=st["max_load"], lookahead=st["lookahead"],
        cpu_slots=st["cpu_slots"], isolated_fit=iso_fit,
    )  # fmt: skip
    iso, completion, total = tg["iso"], tg["completion"], sum(tg["steps"].values())
    true_iso, true_mux = sum(iso.values()) / total, st["services"] * max(completion.values()) / total
    print()
    print(f"{'figure':<34}{'predicted':>11}{'measured':>11}{'error':>9}")
    rows = [
        ("isolated acc-s/step", pred.iso_cost_per_step, true_iso),
        ("multiplexed acc-s/step", pred.mux_cost_per_step, true_mux),
        ("ratio multiplexed / isolated", pred.ratio, true_mux / true_iso),
    ]
    for j, sd in pred.slowdowns().items():
        rows.append((f"slowdown {j}", sd, completion[j] / iso[j]))
    worst = 0.0
    for name, p, t in rows:
        worst = max(worst, abs(p / t - 1))
        print(f"{name:<34}{p:>11.3f}{t:>11.3f}{p / t - 1:>+9.1%}")
    print()
    print(f"largest error {worst:.1%} (goal <= 15%)")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/multiplex.yaml")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--engine", choices=["auto", "vllm", "torch"])
    ap.add_argument("--fit-isolated", action="store_true",
                    help="the fit run also records each job alone (for the isolated side)")  # fmt: skip
    ap.add_argument("--save", default="runs/calibrate/recording.pkl", help="where to keep the recorded runs")
    ap.add_argument("--replay", help="predict again from a saved recording (no real run)")
    ap.add_argument("--smoke", action="store_true", help="a tiny 2-job mix, local driver, 2 iterations (tests)")
    ap.add_argument("--moves", help="no run: fit the swap constants to a run's moves.json")
    args = ap.parse_args(argv)
    if args.moves:
        import json

        print(swap_constants(json.loads(Path(args.moves).read_text())))
        return
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        sys.path.insert(0, str(HERE))
        from _tiny import tiny_cluster_file

        with tempfile.TemporaryDirectory(prefix="plexrl-calibrate-") as tmp:
            args.config, args.iterations = str(tiny_cluster_file(tmp, driver="local")), 2
            report(record(args))
        return
    if args.replay:
        rec = pickle.loads(Path(args.replay).read_bytes())
    else:
        rec = record(args)
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_bytes(pickle.dumps(rec))
        print(f"recording saved to {args.save} (--replay it to predict again)")
    report(rec)


if __name__ == "__main__":
    main()
