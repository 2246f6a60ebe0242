"""Chunked and sliced rollouts on a real service: how long one job's ready nodes wait behind another job's
long-tailed rollout, with the rollout run whole, in chunks of prompts, and in slices of decode steps, side by
side in one run.

Arms, in each repetition:
(a) lean: each job alone, in-process (the local driver), one after another: the baseline of the slowdowns;
(b) multiplexed with every chunked node whole (`chunks` emptied);
(c) multiplexed with `--chunks C` on `--node` of `--job` (default: the copy job's rollout in 4 chunks);
(d) multiplexed with `--slices K` on the same node (decode-step preemption: its generation pauses every K
    decode steps, its KV cache kept, and the other job's ready node runs in between; 0 leaves the arm out).
For (b), (c) and (d): each job's completion time over its lean time (slowdown), accelerator-seconds per step
over the lean arm's, and the preempted job's service seconds per iteration (a chunk runs to its own longest
row, so chunks can cost decode steps: the price of letting the other job in; a slice costs a planner round
trip), next to the mix's bounds from the lean arm (`plexrl.accounting.cost_bound`, `slowdown_bound`).
The sliced job samples exactly what it samples whole (torch engine); a chunked one samples with per-chunk seeds.

    .venv/bin/python benchmarks/chunks.py [--config configs/multiplex_chunks.yaml] [--iterations N]
        [--reps 1] [--job grpo-copy] [--node rollout] [--chunks 4] [--slices 8] [--smoke]
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


def with_slices(cluster: LoadedCluster, job_name: str, node: str, steps: int) -> LoadedCluster:
    """A copy of `cluster` where job `job_name` runs `node` in slices of `steps` decode steps (chunks emptied)."""
    cluster = with_chunks(cluster, job_name, node, 1)
    for job in cluster.jobs:
        if job.config.name == job_name:
            job.config.slices = {node: steps}
    return cluster


@dataclasses.dataclass(slots=True)
class Rep:
    lean: dict[str, Alone]
    arms: dict[str, Mux]  # "whole" | "chunks C" | "slices K" -> the multiplexed run


def bounds(rep: Rep) -> tuple[float, float]:
    """(cost bound in accelerator-seconds per step, slowdown bound) of the mix, from `rep`'s lean arm."""
    from plexrl.accounting import cost_bound, slowdown_bound

    jobs = list(rep.lean.values())
    busy = [a.svc * a.steps for a in jobs]
    return cost_bound(busy, [a.steps for a in jobs]), slowdown_bound(busy, [a.wall for a in jobs])


def summarize(reps: list[Rep], preempted: str) -> None:
    lean_cps = [sum(a.wall for a in r.lean.values()) / sum(a.steps for a in r.lean.values()) for r in reps]
    jobs = list(reps[0].lean)
    print()
    print(f"{'arm':<11}{'job':<20}{'lean s':>9}{'mux s':>9}{'slowdown vs lean':>34}{'service s/it lean -> mux':>27}")
    for c in reps[0].arms:
        for j in jobs:
            lean = [r.lean[j].wall for r in reps]
            mux = [r.arms[c].completion[j] for r in reps]
            slow = [m / a for m, a in zip(mux, lean, strict=True)]
            svc = f"{statistics.mean(r.lean[j].svc for r in reps):.3f} -> "
            svc += f"{statistics.mean(r.arms[c].svc[j] for r in reps):.3f}"
            print(f"{c:<11}{j:<20}{statistics.mean(lean):>9.1f}{statistics.mean(mux):>9.1f}{spread(slow):>34}{svc:>27}")
    bound_cps = [bounds(r)[0] for r in reps]
    bound_sd = [bounds(r)[1] for r in reps]
    print(f"bounds: cost >= {spread([b / c for b, c in zip(bound_cps, lean_cps, strict=True)])} of lean (the jobs' "
          f"busy service seconds alone / steps); slowdown >= {spread(bound_sd)} (earliest-deadline-first)")  # fmt: skip
    for c in reps[0].arms:
        cost = [r.arms[c].cps / b for r, b in zip(reps, lean_cps, strict=True)]
        worst = [max(r.arms[c].completion[j] / r.lean[j].wall for j in jobs) for r in reps]
        others = [max(r.arms[c].completion[j] / r.lean[j].wall for j in jobs if j != preempted) for r in reps]
        to_cost = [r.arms[c].cps / b for r, b in zip(reps, bound_cps, strict=True)]
        to_sd = [w / b for w, b in zip(worst, bound_sd, strict=True)]
        print(f"{c}: multiplexed / lean = {spread(cost)}; largest slowdown {spread(worst)}; largest slowdown of "
              f"the other jobs {spread(others)}; measured / bound: cost {spread(to_cost)}, largest slowdown "
              f"{spread(to_sd)}")  # fmt: skip
    print(f"({len(reps)} repetition(s); mean +- sample sd [min, max])")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/multiplex_chunks.yaml")
    ap.add_argument("--iterations", type=int, help="iterations of every job (default: the config's)")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of the three arms (default 1)")
    ap.add_argument("--job", default="grpo-copy", help="the job whose node runs in chunks")
    ap.add_argument("--node", default="rollout", help="the chunked node")
    ap.add_argument("--chunks", type=int, default=4, help="chunks of the chunked arm (default 4)")
    ap.add_argument("--slices", type=int, default=8, help="decode steps per slice of the sliced arm (0: no such arm)")
    ap.add_argument("--smoke", action="store_true", help="a tiny 2-job mix, 2 iterations, local (tests)")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.chunks < 2 or args.slices < 0:
        ap.error("--reps must be at least 1, --chunks at least 2 and --slices at least 0")
    logging.basicConfig(level=logging.WARNING)
    tmp = tempfile.TemporaryDirectory(prefix="plexrl-chunks-") if args.smoke else None
    if tmp is not None:
        from _tiny import tiny_cluster_file

        args.config, args.iterations, args.reps = str(tiny_cluster_file(tmp.name, driver="local")), 2, 1
        args.job, args.chunks, args.slices = "tiny-0", 2, 2
    cluster = with_iterations(load_cluster(args.config), args.iterations)
    names = [j.config.name for j in cluster.jobs]
    if args.job not in names:
        ap.error(f"--job {args.job!r} is not in {args.config} (jobs: {', '.join(names)})")
    from plexrl.job.spec import prepare_job

    for job in cluster.jobs:
        prepare_job(job)  # warm starts first (cached), so no arm pays for them
    from plexrl.runtime.jobs import configure_torch

    reps = []
    for i in range(args.reps):
        print(f"repetition {i + 1}/{args.reps}", flush=True)
        configure_torch(cluster.config.services.threads)  # the lean runs' model work: the service's threads
        lean = run_alone(with_chunks(cluster, args.job, args.node, 1), "local", "lean")
        arms = {}
        variants = {"whole": with_chunks(cluster, args.job, args.node, 1)}
        variants[f"chunks {args.chunks}"] = with_chunks(cluster, args.job, args.node, args.chunks)
        if args.slices:
            variants[f"slices {args.slices}"] = with_slices(cluster, args.job, args.node, args.slices)
        for label, variant in variants.items():
            print(f"  {label} on {args.job}/{args.node}:", flush=True)
            arms[label] = run_mux(variant, cluster.config.ordering)
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
