"""Which PlexRL layout would save the most? A grid search, in the simulator, over the rollout accelerators
per job (R), the jobs sharing one training pool (k) and the overlap (on-policy `none` or `one-step`), for
one scenario, against its strongest baseline (the cheapest of its tuned baselines, as `plexrl simulate`
finds it). Prints the best layouts within `--step` x the strongest baseline's step time (on- and off-policy
apart), with their saving and step-time ratio, so that a reader can see what reaching a saving goal costs.

    .venv/bin/python benchmarks/sim_layouts.py configs/sim/qwen25_7b.yaml --rollout 4,6,8,12,16 [--pools 1,2,3,4,6]
        [--top 6] [--step 1.1] [--smoke]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from plexrl.sim.config import Deployment, Scenario, load_sim
from plexrl.sim.costs import DoesNotFit
from plexrl.sim.deploy import BASELINES, StepTable, run_deployment
from plexrl.sim.scenario import run_one


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--rollout", type=ints, required=True, help="rollout accelerators per job, e.g. 4,8,16")
    ap.add_argument("--pools", type=ints, default=[1, 2, 3, 4, 6], help="jobs per training pool")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--step", type=float, default=1.1, help="step-time limit, x the strongest baseline's")
    ap.add_argument("--smoke", action="store_true", help="2 jobs, 3 steps, a small batch")
    args = ap.parse_args(argv)
    sc = load_sim(args.config, {"sweep_accelerators": []})
    if not isinstance(sc, Scenario):
        ap.error(f"{args.config} is a trace; give a scenario")
    if args.smoke:
        work = sc.workload.model_copy(update={"prompts": 32, "samples": 4, "steps": 3})
        sc = sc.model_copy(update={"jobs": 2, "rollout_samples": 2, "workload": work})
    t0 = time.perf_counter()
    tables: dict[object, StepTable] = {}
    bases = [run_one(sc, d, tables=tables) for d in sc.deployments if d.kind in BASELINES]
    base = min(bases, key=lambda r: r.gpu_hours_per_step)
    rows = []
    for r in args.rollout:
        for k in args.pools:
            for overlap in ("none", "one-step"):
                name = f"R{r}-k{k}" + ("-offpolicy" if overlap == "one-step" else "")
                d = Deployment.model_validate(
                    {"name": name, "kind": "plexrl", "jobs_per_pool": k, "rollout_accelerators": r, "overlap": overlap}
                )
                try:
                    res = run_deployment(sc, d, tables=tables)
                except DoesNotFit:
                    continue
                ratio = res.step_seconds / base.step_seconds
                saving = 1 - res.gpu_hours_per_step / base.gpu_hours_per_step
                rows.append((saving, d.name, ratio, res.decode_efficiency, d.off_policy))
    print(f"{sc.name}: {len(rows)} PlexRL layouts vs the strongest baseline, {base.name} {base.layout} "
          f"({base.gpu_hours_per_step:.2f} GPU-h/step, {base.step_seconds:.0f} s/step; "
          f"{time.perf_counter() - t0:.1f}s)")  # fmt: skip
    for off in (False, True):
        ok = sorted((r for r in rows if r[4] == off and r[2] <= args.step), reverse=True)
        print(f"{'off-policy' if off else 'on-policy'}, step <= {args.step:g}x: {len(ok)} layouts")
        print(f"  {'layout':<24}{'saving':>8}{'x step':>8}{'decode eff':>12}")
        for saving, name, ratio, eff, _ in ok[: args.top]:
            print(f"  {name:<24}{saving:>+8.1%}{ratio:>8.2f}{eff:>12.1%}")
    best = max(rows, default=None)
    if best is not None:
        print(f"cheapest at any step time: {best[1]} {best[0]:+.1%} at {best[2]:.2f}x")


if __name__ == "__main__":
    main()
