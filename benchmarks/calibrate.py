"""Calibration against reality: fit the simulator's costs from one REAL run of a cluster config, then predict
a SECOND real run of it (isolated and multiplexed, measured as `benchmarks/multiplex.py` measures them) and
print prediction vs measurement side by side with the errors.

1. fit run: the mix multiplexed, as configured (real Dask cluster, real models); its timeline is recorded;
2. target: each job alone on its own service (isolated), then the mix multiplexed: the figures to predict;
3. `plexrl.sim.calibrate.fit` on (1), `predict` with the config's placement, ordering, budgets, lookahead and
   CPU pool size; compare with (2): accelerator-seconds per step isolated and multiplexed, their ratio, and
   every job's slowdown. Goal: within 15%.

    .venv/bin/python benchmarks/calibrate.py [--config configs/multiplex.yaml] [--iterations 20]
        [--engine auto|vllm|torch] [--fit-isolated]

`--fit-isolated`: the fit run also records each job alone, and the isolated side of the prediction uses
that recording (a job alone has the machine to itself: its nodes and round trips are faster).

Run it alone on the machine (2 cores): the fit run and the target run must see the same machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import sys
import time
from pathlib import Path
from typing import Any

from plexrl.cluster import load_cluster, run_cluster
from plexrl.hooks.timeline import TimelineRecorder
from plexrl.runtime.runner import Budgets, Runner
from plexrl.sim.calibrate import fit, merge, predict

HERE = Path(__file__).resolve().parent


def _multiplex_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_multiplex", HERE / "multiplex.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/multiplex.yaml")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--engine", choices=["auto", "vllm", "torch"])
    ap.add_argument("--fit-isolated", action="store_true",
                    help="the fit run also records each job alone (for the isolated side)")  # fmt: skip
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    mux = _multiplex_module()
    cluster = mux.with_iterations(load_cluster(args.config), args.iterations, args.engine)
    cfg = cluster.config
    from plexrl.job import prepare_job

    for job in cluster.jobs:  # warm starts first (cached)
        prepare_job(job)

    # 1. the fit run
    grabbed: dict[str, Any] = {}

    def grab(runner: Runner) -> None:
        grabbed["timeline"] = next(h for h in runner.hooks.hooks if isinstance(h, TimelineRecorder))

    t0 = time.time()
    fit_res = run_cluster(cluster, runner_hook=grab)
    plans = {h.job_id: h.spec.plan() for h in fit_res.jobs}
    fitted = fit(grabbed["timeline"].spans, plans)
    print(f"fit run: {time.time() - t0:.1f}s; dispatch round trip cpu {fitted.dispatch_cpu * 1e3:.1f} ms "
          f"(median of {fitted.gaps['cpu']}), service {fitted.dispatch_service * 1e3:.1f} ms (median of "
          f"{fitted.gaps['service']}); swaps {fitted.swap_bandwidth / 1e9:.2f} GB/s; loads "
          + ", ".join(f"{j} {s:.1f}s" for j, s in sorted(fitted.load_seconds.items())), flush=True)  # fmt: skip

    alone_cfg = cfg.model_copy(update={"services": cfg.services.model_copy(update={"count": 1}),
                                       "placement": "isolated"})  # fmt: skip
    iso_fit = None
    if args.fit_isolated:
        fits = []
        for job in cluster.jobs:
            run_cluster(dataclasses.replace(cluster, config=alone_cfg, jobs=[job]), runner_hook=grab)
            fits.append(fit(grabbed["timeline"].spans, {job.config.name: plans[job.config.name]}))
        iso_fit = merge(fits)
        print(f"fit run, isolated: round trip cpu {iso_fit.dispatch_cpu * 1e3:.1f} ms, service "
              f"{iso_fit.dispatch_service * 1e3:.1f} ms", flush=True)  # fmt: skip

    # 2. the target: isolated, then multiplexed
    iso: dict[str, float] = {}
    steps: dict[str, int] = {}
    for job in cluster.jobs:
        (h,) = run_cluster(dataclasses.replace(cluster, config=alone_cfg, jobs=[job])).jobs
        iso[h.job_id] = (h.finished_at or 0.0) - (h.started_at or 0.0)
        steps[h.job_id] = h.iterations_done
    res = run_cluster(cluster)
    first = min(h.started_at or 0.0 for h in res.jobs)
    completion = {h.job_id: (h.finished_at or 0.0) - first for h in res.jobs}
    total = sum(steps.values())
    true_iso, true_mux = sum(iso.values()) / total, cfg.services.count * max(completion.values()) / total

    # 3. the prediction
    s = cfg.services
    budgets = Budgets(*(int(b) if b is not None else None for b in (s.device_memory, s.host_memory, s.disk)))
    pred = predict(
        fitted, plans, services=s.count, placement=cfg.placement, ordering=cfg.ordering, budgets=budgets,
        max_load=cfg.max_load, lookahead=cfg.driver == "dask" and cfg.lookahead, cpu_slots=cfg.cpu_threads,
        isolated_fit=iso_fit,
    )  # fmt: skip

    def err(p: float, t: float) -> str:
        return f"{p / t - 1:+.1%}"

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
        print(f"{name:<34}{p:>11.3f}{t:>11.3f}{err(p, t):>9}")
    print()
    print(f"largest error {worst:.1%} (goal <= 15%)")


if __name__ == "__main__":
    main()
