"""Simulator speed: the three-month trace (200 jobs on 2,048 accelerators, `configs/sim/trace_3months.yaml`)
replayed under every placement policy with the real runner, planner, policies and StateManager on a
`SimExecutor`, timed; and the same trace at one step per node (no coarsening), to show what the
`steps_per_node` shortcut buys and what it changes in the results.

Goal: the whole replay (4 placements) in under 2 minutes on this machine. Run it alone (2 cores).

    .venv/bin/python benchmarks/simulate.py [--config configs/sim/trace_3months.yaml] [--fine] [--smoke]
        [--jobs N] [--placements isolated spread+backfill] [--loads 0.5,1,2]

`--fine`: also replay at steps_per_node=1 (slow: about 10x the events). `--smoke`: 12 jobs over 3 days
(the test suite runs it).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from plexrl.sim.config import Trace, load_sim
from plexrl.sim.trace import DAY, class_tables, load_sweep, run_policy, trace_jobs

GOAL_S = 120.0


def run(tr: Trace, label: str) -> tuple[float, dict[str, float]]:
    t0 = time.perf_counter()
    shared = trace_jobs(tr, class_tables(tr))
    iso_jobs = trace_jobs(tr, class_tables(tr, isolated=True), isolated=True)
    jobs = shared[0]
    steps = sum(j.iterations for j in jobs) * tr.steps_per_node
    setup = time.perf_counter() - t0
    print(f"{label}: {len(jobs)} jobs, {steps:,} steps, {tr.services} pools x {tr.service_accelerators} "
          f"accelerators, {tr.steps_per_node} step(s) per node; tables + jobs {setup:.1f}s")  # fmt: skip
    print(f"{'placement':<18}{'events':>9}{'wall s':>8}{'events/s':>10}{'makespan d':>12}{'vs isolated':>13}")
    makespans: dict[str, float] = {}
    for p in tr.placements:
        r = run_policy(tr, p, shared, iso_jobs)
        makespans[p] = r.makespan / DAY
        iso = makespans.get("isolated")
        ratio = f"{makespans[p] / iso:.1%}" if iso else ""
        print(f"{p:<18}{r.events:>9}{r.wall_s:>8.1f}{r.events / r.wall_s:>10.0f}{makespans[p]:>12.1f}{ratio:>13}",
              flush=True)  # fmt: skip
    total = time.perf_counter() - t0
    return total, makespans


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/sim/trace_3months.yaml")
    ap.add_argument("--fine", action="store_true", help="also replay at one step per node")
    ap.add_argument("--smoke", action="store_true", help="12 jobs over 3 days, short jobs")
    ap.add_argument("--jobs", type=int, help="override the trace's job count (e.g. a smaller --fine check)")
    ap.add_argument("--placements", nargs="*", help="override the trace's placements")
    ap.add_argument("--loads", help="load factors (jobs x f over the same days), e.g. 0.5,1,1.5: spread+backfill's "
                    "makespan / isolated's at each")  # fmt: skip
    args = ap.parse_args(argv)
    overrides: dict[str, object] = {}
    if args.jobs:
        overrides["jobs"] = args.jobs
    if args.placements:
        overrides["placements"] = args.placements
    tr = load_sim(args.config, overrides)
    if not isinstance(tr, Trace):
        ap.error(f"{args.config} is a scenario; give a trace config")
    if args.smoke:
        classes = [
            c.model_copy(update={"steps_median": 30, "workload": c.workload.model_copy(update={"prompts": 32})})
            for c in tr.classes
        ]
        tr = tr.model_copy(update={"jobs": 12, "days": 3.0, "classes": classes, "rollout_samples": 4})
    total, coarse = run(tr, "trace")
    verdict = "meets" if total <= GOAL_S else "BELOW"
    print(f"total wall {total:.1f} s for {len(tr.placements)} placements ({verdict} the {GOAL_S:.0f} s goal)")
    if args.loads:
        print("load factor  spread+backfill / isolated makespan")
        for f, ratio in load_sweep(tr, [float(x) for x in args.loads.split(",")]):
            print(f"{f:>11g}  {ratio:.1%}", flush=True)
    if args.fine:
        fine_total, fine = run(tr.model_copy(update={"steps_per_node": 1}), "trace, one step per node")
        print(f"one step per node: total wall {fine_total:.1f} s ({fine_total / total:.1f}x)")
        for p in tr.placements:
            print(
                f"  {p:<18} makespan {coarse[p]:.1f} d coarse vs {fine[p]:.1f} d fine ({coarse[p] / fine[p] - 1:+.1%})"
            )


if __name__ == "__main__":
    main()
