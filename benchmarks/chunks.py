"""Chunked rollouts on a real service: how long one job's ready nodes wait behind another job's long-tailed
rollout, with the rollout run whole and in chunks, side by side in one run.

Arms, in each repetition:
(a) lean: each job alone, in-process (the local driver), one after another: the baseline of the slowdowns;
(b) multiplexed with every chunked node whole (`chunks` emptied);
(c) multiplexed with `--chunks C` on `--node` of `--job` (default: the copy job's rollout in 4 chunks).
For (b) and (c): each job's completion time over its lean time (slowdown), accelerator-seconds per step over
the lean arm's, and the chunked job's service seconds per iteration (a chunk runs to its own longest row, so
chunks can cost decode steps: the price of letting the other job in).

    .venv/bin/python benchmarks/chunks.py [--config configs/multiplex_chunks.yaml] [--iterations N]
        [--reps 1] [--job grpo-copy] [--node rollout] [--chunks 4] [--smoke]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import statistics
import tempfile
from collections.abc import Sequence

from multiplex import Alone, Mux, run_alone, run_mux, spread, with_iterations

from plexrl.cluster import LoadedCluster, load_cluster


def with_chunks(cluster: LoadedCluster, job_name: str, node: str, chunks: int) -> LoadedCluster:
    """A copy of `cluster` where job `job_name` runs `node` in `chunks` chunks (1: whole)."""
    jobs = []
    for job in cluster.jobs:
        job = copy.deepcopy(job)
        if job.config.name == job_name:
            job.config.chunks = {node: chunks} if chunks > 1 else {}
        jobs.append(job)
    return dataclasses.replace(cluster, jobs=jobs)


@dataclasses.dataclass(slots=True)
class Rep:
    lean: dict[str, Alone]
    arms: dict[int, Mux]  # chunks -> the multiplexed run


def summarize(reps: list[Rep], chunked: str) -> None:
    lean_cps = [sum(a.wall for a in r.lean.values()) / sum(a.steps for a in r.lean.values()) for r in reps]
    jobs = list(reps[0].lean)
    print()
    print(f"{'chunks':<8}{'job':<20}{'lean s':>9}{'mux s':>9}{'slowdown vs lean':>34}{'service s/it lean -> mux':>27}")
    for c in reps[0].arms:
        for j in jobs:
            lean = [r.lean[j].wall for r in reps]
            mux = [r.arms[c].completion[j] for r in reps]
            slow = [m / a for m, a in zip(mux, lean, strict=True)]
            svc = f"{statistics.mean(r.lean[j].svc for r in reps):.3f} -> "
            svc += f"{statistics.mean(r.arms[c].svc[j] for r in reps):.3f}"
            print(f"{c:<8}{j:<20}{statistics.mean(lean):>9.1f}{statistics.mean(mux):>9.1f}{spread(slow):>34}{svc:>27}")
    for c in reps[0].arms:
        cost = [r.arms[c].cps / b for r, b in zip(reps, lean_cps, strict=True)]
        worst = [max(r.arms[c].completion[j] / r.lean[j].wall for j in jobs) for r in reps]
        others = [max(r.arms[c].completion[j] / r.lean[j].wall for j in jobs if j != chunked) for r in reps]
        print(f"chunks {c}: multiplexed / lean = {spread(cost)}; largest slowdown {spread(worst)}; "
              f"largest slowdown of the other jobs {spread(others)}")  # fmt: skip
    print(f"({len(reps)} repetition(s); mean +- sample sd [min, max])")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/multiplex_chunks.yaml")
    ap.add_argument("--iterations", type=int, help="iterations of every job (default: the config's)")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of the three arms (default 1)")
    ap.add_argument("--job", default="grpo-copy", help="the job whose node runs in chunks")
    ap.add_argument("--node", default="rollout", help="the chunked node")
    ap.add_argument("--chunks", type=int, default=4, help="chunks of the chunked arm (default 4)")
    ap.add_argument("--smoke", action="store_true", help="a tiny 2-job mix, 2 iterations, local (tests)")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.chunks < 2:
        ap.error("--reps must be at least 1 and --chunks at least 2")
    logging.basicConfig(level=logging.WARNING)
    tmp = tempfile.TemporaryDirectory(prefix="plexrl-chunks-") if args.smoke else None
    if tmp is not None:
        from _tiny import tiny_cluster_file

        args.config, args.iterations, args.reps = str(tiny_cluster_file(tmp.name, driver="local")), 2, 1
        args.job, args.chunks = "tiny-0", 2
    cluster = with_iterations(load_cluster(args.config), args.iterations)
    names = [j.config.name for j in cluster.jobs]
    if args.job not in names:
        ap.error(f"--job {args.job!r} is not in {args.config} (jobs: {', '.join(names)})")
    from plexrl.job import prepare_job

    for job in cluster.jobs:
        prepare_job(job)  # warm starts first (cached), so no arm pays for them
    from plexrl.runtime.jobs import configure_torch

    reps = []
    for i in range(args.reps):
        print(f"repetition {i + 1}/{args.reps}", flush=True)
        configure_torch(cluster.config.services.threads)  # the lean runs' model work: the service's threads
        lean = run_alone(with_chunks(cluster, args.job, args.node, 1), "local", "lean")
        arms = {}
        for c in (1, args.chunks):
            print(f"  chunks {c} on {args.job}/{args.node}:", flush=True)
            arms[c] = run_mux(with_chunks(cluster, args.job, args.node, c), cluster.config.ordering)
        reps.append(Rep(lean, arms))
    summarize(reps, args.job)
    if tmp is not None:
        tmp.cleanup()
    bad = [s for r in reps for m in r.arms.values() for s in m.statuses] + [
        a.status for r in reps for a in r.lean.values()
    ]
    if any(s != "done" for s in bad):
        raise SystemExit("a job did not finish; the figures above are not comparable")


if __name__ == "__main__":
    main()
