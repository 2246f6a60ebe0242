"""Multiplexing against a lean dedicated baseline and against PlexRL-isolated, side by side in one invocation.

The same job mix (a cluster config, default `configs/multiplex.yaml`) runs three ways in every repetition:
(a) lean: each job alone, in this process, on the local driver (`InlineExecutor`: no Dask, no scheduler round
    trips, no copies of a batch; the fastest way PlexRL or a plain loop runs one job), with the same torch
    threads for model work as the multiplexed service (`services.threads`); a job's cost = 1 service x its
    own wall time (placement to end); its completion time is the denominator of its slowdown. This is the
    dedicated baseline of docs/architecture.md, "Accounting" (the fastest way a user runs it alone);
(b) isolated on the config's driver (Dask by default): each job alone on its own service, one after another;
    the second column, for comparison with the figures published before the lean baseline existed;
(c) multiplexed: all jobs on the config's services with its placement, ordering and memory budgets;
    cost = services x the makespan (first placement to last end). `--orderings hrrs,slowdown` runs this arm
    once per ordering in every repetition, side by side against the same (a) and (b);
(d) time-slicing: the same as (c) with `ordering: time-slicing`, the llm-d / OpenRL design on our executor (a
    FIFO lock per service held for a phase, the whole state moved out and in at each hand-over, no prefetch,
    no lookahead, no ordering: `plexrl.planner.policies.TimeSlicing`); on by default, `--no-time-slicing` skips it.
Each multiplexed arm (c, d) also prints the llm-d / OpenRL figures (`benchmarks/_arms.py`): accelerator-seconds
against dedicated (one service per job, all held until the last job ends) and against one-after-another (the
jobs alone in turn on one service), each job's slowdown, the median switch (blocking swap seconds at a
hand-over) and hand-over gap, the median per-phase queue wait, the services' duty cycle (busy / makespan) and
whether every job's learning curve is identical to its lean run; then PlexRL / time-slicing with the goals
(cost <= 0.8x, no job slower than under time-slicing).
Prints per job: steps, wall alone (lean, isolated), multiplexed completion, slowdown against (a) and (b);
per run: accelerator-seconds per training step and the ratios multiplexed / lean and multiplexed / isolated,
and each figure next to its physical bound from the lean arm (`plexrl.accounting.cost_bound`: the jobs' busy
service seconds alone over their steps; `slowdown_bound`: the least slowdown earliest-deadline-first
feasibility allows) as measured / bound;
with `--reps N` (default 3) every headline figure as mean +- sample standard deviation [min, max]. Also the
service's busy / swap / startup / idle seconds (idle by what the jobs ran off the service meanwhile:
`_arms.idle_reasons`) and the swap figures of each multiplexed run (bytes moved,
blocking seconds, share of swap time hidden: background moves no node waited for). Identical seeds in (a),
(b) and (c); MLflow and progress bars off; warm starts are built (cached) before anything is timed.

Start-up: every arm's job wall time includes its own load (engine build). The process imports vLLM once
before the lean runs (as a long-running trainer would have it); a Dask worker imports it on its first load,
which the isolated and multiplexed runs pay (see the `startup` column of the accounting).

    .venv/bin/python benchmarks/multiplex.py [--config configs/multiplex.yaml] [--iterations 40] [--reps 3]
        [--engine auto|vllm|torch] [--driver dask|local] [--device cpu|cuda] [--orderings hrrs,slowdown]
        [--no-time-slicing] [--smoke]

`--smoke`: a tiny two-job mix (benchmarks/_tiny.py), 2 iterations, 1 repetition, everything on the local
driver (no Dask), in a temporary directory (the test suite runs it; its figures mean nothing).

Run it alone on the machine: other processes on the 2 cores distort every figure.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' helpers, run from anywhere

from _arms import (
    curve,
    format_idle,
    hand_overs,
    idle_reasons,
    job_ends,
    median,
    move_totals,
    phase_waits,
    plans_of,
    same_curve,
    switches,
)

from plexrl.cluster import LoadedCluster, load_cluster, run_cluster
from plexrl.services.records import format_summary


def with_iterations(cluster: LoadedCluster, iterations: int | None, engine: str | None = None) -> LoadedCluster:
    """A copy of `cluster` with every job's iterations (and engine) overridden, MLflow and progress bars off."""
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


def alone(cluster: LoadedCluster, job: Any, driver: str) -> LoadedCluster:
    """The cluster config reduced to `job` alone on one service of `driver`."""
    cfg = cluster.config.model_copy(
        update={
            "services": cluster.config.services.model_copy(update={"count": 1}),
            "placement": "isolated",
            "driver": driver,
        }
    )
    return dataclasses.replace(cluster, config=cfg, jobs=[job])


def swap_summary(reports: dict[str, dict[str, Any]]) -> tuple[float, float, float, int]:
    """Blocking swap seconds (the nodes' swap spans: moves they made or waited for), background move seconds
    (prefetch and lookahead nodes' early swaps), the share of swap time hidden from the nodes (background
    seconds not waited for / (blocking + those); `plexrl.services.moves.hidden_share`), bytes moved."""
    from plexrl.services.moves import hidden_share

    blocking = sum(r.get("blocking_swap_seconds", 0.0) for r in reports.values())
    prefetch = sum(r.get("prefetch_seconds", 0.0) for r in reports.values())
    waited = sum(r.get("prefetch_wait_seconds", 0.0) for r in reports.values())
    moved = sum(r.get("bytes_moved", 0) for r in reports.values())
    return blocking, prefetch, hidden_share(blocking, prefetch, waited), moved


def per_iteration(job: Any) -> float:
    times = job.series("time/iteration")
    return sum(times) / len(times) if times else float("nan")


def service_seconds(job: Any) -> float:
    """Mean seconds per iteration the job's service nodes themselves ran (no queueing, no swaps)."""
    names = [n.name for n in job.graph.nodes if n.runs_on == "service"]
    rows = job.history[1:]
    return sum(r.get(f"time/{n}", 0.0) for r in rows for n in names) / max(len(rows), 1)


def spread(values: Sequence[float]) -> str:
    """`mean +- sd [min, max]` (sd: sample standard deviation; one value: just the value)."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    sd = statistics.stdev(values)
    return f"{statistics.mean(values):.3f} +- {sd:.3f} [{min(values):.3f}, {max(values):.3f}]"


@dataclasses.dataclass(slots=True)
class Alone:
    """One job run alone: wall time from placement to end, steps, status, service seconds per iteration."""

    wall: float
    steps: int
    status: str
    svc: float
    curve: list[dict[str, float]] = dataclasses.field(default_factory=list)  # its metrics without timing keys


def run_alone(cluster: LoadedCluster, driver: str, label: str) -> dict[str, Alone]:
    """Each job of `cluster` alone on one service of `driver`, one after another."""
    out: dict[str, Alone] = {}
    for job in cluster.jobs:
        (h,) = run_cluster(alone(cluster, job, driver)).jobs
        wall = (h.finished_at or 0.0) - (h.started_at or 0.0)
        out[h.job_id] = Alone(wall, h.iterations_done, h.status, service_seconds(h), curve(h.history))
        print(f"  {label:<9} {h.job_id:<20} {h.status:<6} {h.iterations_done:>4} steps {wall:7.1f}s "
              f"({per_iteration(h):.3f} s/iteration)", flush=True)  # fmt: skip
    return out


@dataclasses.dataclass(slots=True)
class Mux:
    """One multiplexed run: each job's completion time (from the first placement), service seconds per
    iteration, the accelerator-seconds per step and the jobs' statuses."""

    completion: dict[str, float]
    svc: dict[str, float]
    cps: float
    statuses: list[str]
    # the llm-d / OpenRL figures (`_arms.py`): (switch s, gap s) per hand-over, per-phase queue waits, busy /
    # (services x makespan), each job's metrics without timing keys
    hand_overs: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    waits: list[float] = dataclasses.field(default_factory=list)
    duty: float = float("nan")
    curves: dict[str, list[dict[str, float]]] = dataclasses.field(default_factory=dict)
    swap: tuple[float, float, float, int] = (0.0, 0.0, float("nan"), 0)  # blocking, background, hidden, bytes
    moves: dict[str, float] = dataclasses.field(default_factory=dict)  # move-record sums (`_arms.move_totals`)
    idle: dict[str, float] = dataclasses.field(default_factory=dict)  # idle seconds by reason (`_arms.idle_reasons`)
    # (from, to, when) of each hand-over and each job's last span end, on the spans' clock (`_arms.switches`)
    switches: list[tuple[str, str, float]] = dataclasses.field(default_factory=list)
    ends: dict[str, float] = dataclasses.field(default_factory=dict)
    makespan: float = float("nan")


@dataclasses.dataclass(slots=True)
class Rep:
    """One repetition's figures: the lean and isolated arms, and a multiplexed run per ordering."""

    lean: dict[str, Alone]
    iso: dict[str, Alone]
    mux: dict[str, Mux]

    def cost_per_step(self, arm: dict[str, Alone]) -> float:
        return sum(a.wall for a in arm.values()) / sum(a.steps for a in arm.values())


def run_mux(cluster: LoadedCluster, ordering: str) -> Mux:
    """(c) the mix on its services with `ordering` (`NAME/nohold`: that ordering, lookahead never held back)."""
    name, _, flag = ordering.partition("/")
    if flag not in ("", "nohold"):
        raise SystemExit(f"--orderings: {ordering!r}: give NAME or NAME/nohold")
    update = {"ordering": name, "hold_ahead": False if flag else None}
    cluster = dataclasses.replace(cluster, config=cluster.config.model_copy(update=update))
    t0 = time.time()
    res = run_cluster(cluster)
    wall = time.time() - t0
    first = min(h.started_at or 0.0 for h in res.jobs)
    last = max(h.finished_at or 0.0 for h in res.jobs)
    makespan = last - first
    cps = cluster.config.services.count * makespan / max(sum(h.iterations_done for h in res.jobs), 1)
    print(f"  multiplexed ({ordering}): makespan {makespan:.1f}s (run {wall:.1f}s incl. start-up), "
          f"{cps:.3f} acc-s/step")  # fmt: skip
    for s in res.report.services:
        print(f"    {s.service}: busy {s.busy:.1f}s (weight loads {s.weights:.2f}s of it) swap {s.swap:.2f}s "
              f"startup {s.startup:.2f}s idle {s.idle:.1f}s ({s.utilization:.0%} busy)")  # fmt: skip
    startup_timeline(res.spans)
    idle = idle_reasons(res.spans)
    print(f"    idle by what the jobs ran meanwhile (first span to last, services summed): {format_idle(idle)}")
    blocking, prefetch, hidden, moved = swap_summary(res.service_reports)
    print(f"    swaps: {moved / 2**20:.0f} MiB moved, blocking {blocking:.2f}s, in the background {prefetch:.2f}s "
          f"(prefetch and early swaps), hidden {hidden:.0%} of swap time", flush=True)  # fmt: skip
    moves = move_totals(res.service_reports)
    if moves:
        print(f"    move records: {format_summary(moves)}", flush=True)
    c = res.planner
    print(f"    planner: {c['sent_ahead']} nodes sent ahead ({c['held_ahead']} times held back), "
          f"{c['cohorts_sent']} co-scheduled cohorts of "
          f"{c['cohort_members']} rollouts", flush=True)  # fmt: skip
    busy = sum(s.busy for s in res.report.services)
    return Mux(
        {h.job_id: (h.finished_at or 0.0) - first for h in res.jobs},
        {h.job_id: service_seconds(h) for h in res.jobs},
        cps,
        [h.status for h in res.jobs],
        hand_overs(res.spans),
        phase_waits(res.spans, plans_of(res.jobs)),
        busy / (cluster.config.services.count * makespan) if makespan > 0 else float("nan"),
        {h.job_id: curve(h.history) for h in res.jobs},
        (blocking, prefetch, hidden, moved),
        moves,
        idle,
        switches(res.spans),
        job_ends(res.spans),
        makespan,
    )


def startup_timeline(spans: Sequence[Any]) -> None:
    """Where the first seconds went (whether loads and first nodes overlap), on the run's clock from the runner's
    start (after the cluster started): each job's load on its service and its first service node."""
    loads = sorted((s for s in spans if s.kind == "load"), key=lambda s: s.start)
    first: dict[str, float] = {}
    for s in spans:
        if s.kind == "node" and s.lane != "cpu":
            first[s.job] = min(first.get(s.job, s.start), s.start)
    if not first:
        return
    parts = ", ".join(f"{s.job} load {s.start:.2f}-{s.end:.2f}s, first node {first.get(s.job, float('nan')):.2f}s"
                      for s in loads)  # fmt: skip
    print(f"    start-up: first service node at {min(first.values()):.2f}s; {parts}")


def one_rep(cluster: LoadedCluster, iso_driver: str, orderings: Sequence[str]) -> Rep:
    """(a) lean, (b) isolated on `iso_driver`, (c) multiplexed with each ordering: see the module docstring."""
    from plexrl.runtime.jobs import configure_torch

    configure_torch(cluster.config.services.threads)  # the lean runs' model work: the service's threads
    lean = run_alone(cluster, "local", "lean")
    iso = run_alone(cluster, iso_driver, "isolated")
    return Rep(lean, iso, {o: run_mux(cluster, o) for o in orderings})


def bounds(rep: Rep) -> tuple[float, float]:
    """(cost bound in accelerator-seconds per step, slowdown bound) of `rep`'s mix, from its lean arm."""
    from plexrl.accounting import slowdown_bound

    jobs = list(rep.lean.values())
    busy = [a.svc * a.steps for a in jobs]
    return cost_floor(rep.lean), slowdown_bound(busy, [a.wall for a in jobs])


def summarize(reps: list[Rep], iso_label: str) -> None:
    """Per ordering: the per-job table and the headline ratios over the repetitions."""
    lean_cps = [r.cost_per_step(r.lean) for r in reps]
    iso_cps = [r.cost_per_step(r.iso) for r in reps]
    for ordering in reps[0].mux:
        muxes = [r.mux[ordering] for r in reps]
        jobs = list(muxes[0].completion)
        print()
        print(f"ordering {ordering}")
        print(f"{'job':<20}{'steps':>6}{'lean s':>9}{f'{iso_label} s':>12}{'mux s':>9}{'slowdown vs lean':>34}"
              f"{f'vs {iso_label}':>34}{'service s/it lean -> mux':>27}")  # fmt: skip
        worst = [max(m.completion[j] / r.lean[j].wall for j in jobs) for r, m in zip(reps, muxes, strict=True)]
        for j in jobs:
            lean = [r.lean[j].wall for r in reps]
            iso = [r.iso[j].wall for r in reps]
            mux = [m.completion[j] for m in muxes]
            sd_lean = [m / a for m, a in zip(mux, lean, strict=True)]
            sd_iso = [m / a for m, a in zip(mux, iso, strict=True)]
            svc_lean, svc_mux = statistics.mean(r.lean[j].svc for r in reps), statistics.mean(m.svc[j] for m in muxes)
            svc = f"{svc_lean:.3f} -> {svc_mux:.3f}"
            print(f"{j:<20}{reps[0].lean[j].steps:>6}{statistics.mean(lean):>9.1f}{statistics.mean(iso):>12.1f}"
                  f"{statistics.mean(mux):>9.1f}{spread(sd_lean):>34}{spread(sd_iso):>34}{svc:>27}")  # fmt: skip
        mux_cps = [m.cps for m in muxes]
        print(f"accelerator-seconds per step: lean {spread(lean_cps)}, {iso_label} {spread(iso_cps)}, "
              f"multiplexed {spread(mux_cps)}")  # fmt: skip
        vs_lean = [m / b for m, b in zip(mux_cps, lean_cps, strict=True)]
        vs_iso = [m / b for m, b in zip(mux_cps, iso_cps, strict=True)]
        print(f"multiplexed / lean     = {spread(vs_lean)} (goal <= 0.65); largest slowdown vs lean {spread(worst)} "
              f"(goal <= 1.25)")  # fmt: skip
        print(f"multiplexed / {iso_label:<8} = {spread(vs_iso)}")
        # the physical limits of this mix, from the lean arm of the same repetition (plexrl/accounting.py)
        bound_cps = [bounds(r)[0] for r in reps]
        bound_sd = [bounds(r)[1] for r in reps]
        print(f"bounds: cost >= {spread(bound_cps)} acc-s/step (the jobs' busy service seconds alone / steps) = "
              f"{spread([b / c for b, c in zip(bound_cps, lean_cps, strict=True)])} of lean; slowdown >= "
              f"{spread(bound_sd)} (earliest-deadline-first on those busy seconds)")  # fmt: skip
        print(
            f"measured / bound: cost {spread([m / b for m, b in zip(mux_cps, bound_cps, strict=True)])} "
            f"(goal <= 1.05), largest slowdown {spread([w / b for w, b in zip(worst, bound_sd, strict=True)])}"
        )
    print(f"({len(reps)} repetition(s); mean +- sample sd [min, max])")


SLICING = "time-slicing"  # the llm-d / OpenRL design on our executor (`plexrl.planner.policies.TimeSlicing`)


def openrl_figures(lean: Sequence[dict[str, Alone]], muxes: Sequence[Mux], label: str) -> None:
    """One arm's llm-d / OpenRL figures over the repetitions (see the module docstring)."""
    jobs = list(muxes[0].completion)
    steps = [sum(a.steps for a in r.values()) for r in lean]
    seq = [sum(a.wall for a in r.values()) / n for r, n in zip(lean, steps, strict=True)]
    ded = [len(r) * max(a.wall for a in r.values()) / n for r, n in zip(lean, steps, strict=True)]
    cps = [m.cps for m in muxes]
    switches = [h[0] for m in muxes for h in m.hand_overs]
    gaps = [h[1] for m in muxes for h in m.hand_overs]
    waits = [w for m in muxes for w in m.waits]
    same = all(same_curve(m.curves[j], r[j].curve) for r, m in zip(lean, muxes, strict=True) for j in jobs)
    slow = ", ".join(
        f"{j} {spread([m.completion[j] / r[j].wall for r, m in zip(lean, muxes, strict=True)])}" for j in jobs
    )
    print(f"  {label}: acc-s/step {spread(cps)} = {spread([c / d for c, d in zip(cps, ded, strict=True)])} of "
          f"dedicated, {spread([c / q for c, q in zip(cps, seq, strict=True)])} of one-after-another")  # fmt: skip
    print(f"    slowdowns vs lean: {slow}")
    print(f"    {len(switches)} hand-overs: median switch {median(switches):.3f}s (blocking swaps), median gap "
          f"{median(gaps):.3f}s; median per-phase queue wait {median(waits):.3f}s over {len(waits)} phases; duty "
          f"cycle {spread([m.duty for m in muxes])}; learning curves identical to lean: {same}")  # fmt: skip


def against_slicing(lean: Sequence[dict[str, Alone]], arms: dict[str, list[Mux]], reference: str | None = None) -> None:
    """Every arm's llm-d / OpenRL figures (`arms`: its runs, one per repetition of `lean`), then each other arm
    against `reference` (default: the first time-slicing arm), next to the goals."""
    print("\nthe llm-d / OpenRL figures (dedicated: one service per job, all held until the last ends; "
          "one-after-another: the jobs alone in turn on one service)")  # fmt: skip
    for arm, runs in arms.items():
        openrl_figures(lean, runs, arm)
    if reference is None:
        reference = next((arm for arm in arms if arm.split("+")[0] == SLICING), None)
    if reference is None:
        return
    ts = arms[reference]
    for arm, muxes in arms.items():
        if muxes is ts:
            continue
        cost = [m.cps / t.cps for m, t in zip(muxes, ts, strict=True)]
        worse = {
            j: [m.completion[j] / t.completion[j] for m, t in zip(muxes, ts, strict=True)] for j in muxes[0].completion
        }
        ok = all(max(v) <= 1.0 for v in worse.values())
        print(f"{arm} / {reference}: cost {spread(cost)} (goal <= 0.8); completion per job "
              f"{', '.join(f'{j} {spread(v)}' for j, v in worse.items())} (goal: none above 1: {ok})")  # fmt: skip
    floor = [cost_floor(alone) / t.cps for alone, t in zip(lean, ts, strict=True)]
    print(f"bound: no schedule on these services costs less than {spread(floor)} of {reference} (the jobs' service "
          f"seconds alone on fully busy services, `accounting.cost_bound`)")  # fmt: skip


def cost_floor(alone: dict[str, Alone]) -> float:
    """The least accelerator-seconds per step of the mix `alone` ran (its jobs' service seconds alone spread over
    their steps): what the planner could reach with no swap, start-up or idle second."""
    from plexrl.accounting import cost_bound

    jobs = list(alone.values())
    return cost_bound([a.svc * a.steps for a in jobs], [a.steps for a in jobs])


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/multiplex.yaml")
    ap.add_argument("--iterations", type=int, default=40, help="iterations per job (default 40)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the three arms (default 3)")
    ap.add_argument("--engine", choices=["auto", "vllm", "torch"], help="override the jobs' rollout engine")
    ap.add_argument("--driver", choices=["dask", "local"], help="isolated and multiplexed arms (default: config's)")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="the services' device (default: the config's)")
    ap.add_argument("--orderings", help="comma-separated orderings of the multiplexed arm (NAME/nohold: lookahead "
                    "never held back), each run side by side "
                    "in every repetition (default: the config's)")  # fmt: skip
    ap.add_argument("--no-time-slicing", action="store_true", help="skip the time-slicing arm (the llm-d / OpenRL "
                    "design on our executor, run by default beside the orderings)")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="a tiny 2-job mix, 2 iterations, 1 rep, local (tests)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    tmp = tempfile.TemporaryDirectory(prefix="plexrl-multiplex-") if args.smoke else None
    if tmp is not None:
        from _tiny import tiny_cluster_file

        args.config = str(tiny_cluster_file(tmp.name, driver="local"))
        args.iterations, args.reps, args.driver = 2, 1, "local"
    cluster = with_iterations(load_cluster(args.config), args.iterations, args.engine)
    if args.driver is not None:
        cluster = dataclasses.replace(cluster, config=cluster.config.model_copy(update={"driver": args.driver}))
    if args.device is not None:
        services = cluster.config.services.model_copy(update={"device": args.device})
        cluster = dataclasses.replace(cluster, config=cluster.config.model_copy(update={"services": services}))
    driver = cluster.config.driver
    from plexrl.job.spec import prepare_job

    specs = [prepare_job(job) for job in cluster.jobs]  # warm starts first (cached), so no arm pays for them
    if any(s.generation == "vllm" for s in specs):
        from plexrl.engines.vllm_engine import _import_vllm

        _import_vllm()  # once per process, before anything is timed (see the module docstring)
    iso_label = "dask-iso" if driver == "dask" else "local-iso"
    orderings = args.orderings.split(",") if args.orderings else [cluster.config.ordering]
    if not args.no_time_slicing and SLICING not in orderings:
        orderings.append(SLICING)
    reps = []
    for i in range(args.reps):
        print(f"repetition {i + 1}/{args.reps}", flush=True)
        reps.append(one_rep(cluster, driver, orderings))
    summarize(reps, iso_label)
    against_slicing([r.lean for r in reps], {o: [r.mux[o] for r in reps] for o in orderings})
    if tmp is not None:
        tmp.cleanup()
    bad = [s for r in reps for m in r.mux.values() for s in m.statuses]
    bad += [a.status for r in reps for a in (*r.lean.values(), *r.iso.values())]
    if any(s != "done" for s in bad):
        raise SystemExit("a job did not finish; the figures above are not comparable")


if __name__ == "__main__":
    main()
