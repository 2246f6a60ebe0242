"""Multiplexing vs isolation, side by side in one invocation, on a real Dask cluster.

The same job mix (a cluster config, default `configs/multiplex.yaml`) runs twice:
(a) isolated: each job alone on its own service, the jobs one after another (so they do not compete for
    this machine's cores); a job's isolated cost = 1 service x its own wall time (placement to end), and
    its isolated completion time is the denominator of its slowdown;
(b) multiplexed: all jobs on the config's services (fewer services than jobs), with its placement,
    ordering and memory budgets; cost = services x the run's wall time.
Prints per job: steps, isolated wall, multiplexed completion, slowdown; per run: accelerator-seconds per
training step and the ratio multiplexed / isolated; swap figures: bytes moved, blocking swap seconds, and
the share of swap time hidden by prefetch. Identical seeds in (a) and (b); MLflow and progress bars off.

    .venv/bin/python benchmarks/multiplex.py [--config configs/multiplex.yaml] [--iterations 40]
        [--engine auto|vllm|torch]

Where the idle gaps of the default mix come from: the GRPO job's own CPU nodes (prompt sampling, reward
verification, advantages: small) and its periodic evaluation; the two judged jobs wait for a remote
verifier's round trip (0.5 s and 0.8 s per batch; `remote_verify` models that latency, it is the one
modelled part). Run it alone on the machine: other processes on the 2 cores distort every figure.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import time
from typing import Any

from plexrl.cluster import LoadedCluster, load_cluster, run_cluster


def with_iterations(cluster: LoadedCluster, iterations: int | None, engine: str | None = None) -> LoadedCluster:
    jobs = []
    for job in cluster.jobs:
        job = copy.deepcopy(job)
        if iterations is not None:
            job.config.iterations = iterations
        if engine is not None:
            job.config.engine = engine  # type: ignore[assignment]
        job.config.tracking.mlflow = False
        job.config.tracking.progress = False
        job.config.tracking.log_model = False
        jobs.append(job)
    cfg = cluster.config.model_copy(update={"mlflow": False, "progress": False})
    return dataclasses.replace(cluster, config=cfg, jobs=jobs)


def swap_summary(reports: dict[str, dict[str, Any]]) -> tuple[float, float, float, int]:
    blocking = sum(r.get("blocking_swap_seconds", 0.0) for r in reports.values())
    prefetch = sum(r.get("prefetch_seconds", 0.0) for r in reports.values())
    waited = sum(r.get("prefetch_wait_seconds", 0.0) for r in reports.values())
    moved = sum(r.get("bytes_moved", 0) for r in reports.values())
    hidden = prefetch - waited
    total = blocking + prefetch
    return blocking, prefetch, (hidden / total if total > 0 else float("nan")), moved


def per_iteration(job: Any) -> float:
    times = job.series("time/iteration")
    return sum(times) / len(times) if times else float("nan")


def service_seconds(job: Any) -> float:
    """Mean seconds per iteration the job's service nodes themselves ran (no queueing, no swaps)."""
    names = [n.name for n in job.graph.nodes if n.placement == "service"]
    rows = job.history[1:]
    return sum(r.get(f"time/{n}", 0.0) for r in rows for n in names) / max(len(rows), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/multiplex.yaml")
    ap.add_argument("--iterations", type=int, default=40, help="iterations per job (default 40; None: config's)")
    ap.add_argument("--engine", choices=["auto", "vllm", "torch"], help="override the jobs' rollout engine")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cluster = with_iterations(load_cluster(args.config), args.iterations, args.engine)
    n_services = cluster.config.services.count
    # warm starts first (cached), so neither side pays for them
    from plexrl.job import prepare_job

    for job in cluster.jobs:
        prepare_job(job)

    iso: dict[str, dict[str, float]] = {}
    iso_cost = 0.0
    iso_steps = 0
    for job in cluster.jobs:
        alone_cfg = cluster.config.model_copy(
            update={"services": cluster.config.services.model_copy(update={"count": 1}), "placement": "isolated"}
        )
        one = dataclasses.replace(cluster, config=alone_cfg, jobs=[job])
        res = run_cluster(one)
        (h,) = res.jobs
        wall = (h.finished_at or 0.0) - (h.started_at or 0.0)
        iso[h.job_id] = {"wall": wall, "steps": h.iterations_done, "status": h.status, "svc": service_seconds(h)}
        iso_cost += wall
        iso_steps += h.iterations_done
        print(f"isolated {h.job_id:<18} {h.status:<6} {h.iterations_done:>4} steps {wall:7.1f}s "
              f"({per_iteration(h):.3f} s/iteration)", flush=True)  # fmt: skip

    t0 = time.time()
    res = run_cluster(cluster)
    mux_wall = time.time() - t0
    first = min(h.started_at or 0.0 for h in res.jobs)
    last = max(h.finished_at or 0.0 for h in res.jobs)
    makespan = last - first
    mux_cost = n_services * makespan
    mux_steps = sum(h.iterations_done for h in res.jobs)
    print()
    print(
        f"{'job':<20}{'steps':>6}{'isolated s':>12}{'mux completion s':>18}{'slowdown':>10}{'mux s/iteration':>17}"
        f"{'service s/it iso -> mux':>26}"
    )
    slowdowns = []
    for h in res.jobs:
        completion = (h.finished_at or 0.0) - first
        sd = completion / iso[h.job_id]["wall"]
        slowdowns.append(sd)
        print(f"{h.job_id:<20}{h.iterations_done:>6}{iso[h.job_id]['wall']:>12.1f}{completion:>18.1f}{sd:>10.2f}"
              f"{per_iteration(h):>17.3f}{iso[h.job_id]['svc']:>18.3f} -> {service_seconds(h):.3f}")  # fmt: skip
    iso_cps = iso_cost / iso_steps
    mux_cps = mux_cost / mux_steps
    print()
    print(f"isolated:    {len(cluster.jobs)} services-worth, {iso_cost:.1f} accelerator-s, {iso_cps:.3f} acc-s/step")
    print(f"multiplexed: {n_services} service(s), makespan {makespan:.1f}s (run {mux_wall:.1f}s incl. start-up), "
          f"{mux_cost:.1f} accelerator-s, {mux_cps:.3f} acc-s/step")  # fmt: skip
    for s in res.report.services:
        print(f"  {s.service}: busy {s.busy:.1f}s swap {s.swap:.2f}s idle {s.idle:.1f}s ({s.utilization:.0%} busy)")
    blocking, prefetch, hidden, moved = swap_summary(res.service_reports)
    print(f"  swaps: {moved / 2**20:.0f} MiB moved, blocking {blocking:.2f}s, prefetch {prefetch:.2f}s, "
          f"hidden by prefetch {hidden:.0%} of swap time")  # fmt: skip
    print()
    ratio = mux_cps / iso_cps
    worst = max(slowdowns)
    print(f"accelerator-seconds per step, multiplexed / isolated = {ratio:.3f} (goal <= 0.65); "
          f"largest slowdown {worst:.2f} (goal <= 1.25)")  # fmt: skip
    if any(h.status != "done" for h in res.jobs) or any(v["status"] != "done" for v in iso.values()):
        raise SystemExit("a job did not finish; the figures above are not comparable")


if __name__ == "__main__":
    main()
