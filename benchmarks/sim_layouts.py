"""Which PlexRL layout would save the most? A grid search, in the simulator, over the rollout accelerators
per job (R), the jobs sharing one training pool (k) and the overlap (on-policy `none` or `one-step`), for
one scenario, against its baseline deployment. Prints the best layouts with their saving and the worst
job slowdown (vs the baseline), so that a reader can see what reaching a saving goal would cost.

    .venv/bin/python benchmarks/sim_layouts.py configs/sim/qwen25_7b.yaml --rollout 4,6,8,12,16 [--pools 1,2,3,4,6]
        [--top 6] [--smoke]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from plexrl.sim.config import Deployment, Scenario, load_sim
from plexrl.sim.costs import DoesNotFit
from plexrl.sim.deploy import StepTable, run_deployment


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--rollout", type=ints, required=True, help="rollout accelerators per job, e.g. 4,8,16")
    ap.add_argument("--pools", type=ints, default=[1, 2, 3, 4, 6], help="jobs per training pool")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--smoke", action="store_true", help="2 jobs, 3 steps, a small batch")
    args = ap.parse_args(argv)
    sc = load_sim(args.config, {"sweep_accelerators": []})
    if not isinstance(sc, Scenario):
        ap.error(f"{args.config} is a trace; give a scenario")
    if args.smoke:
        work = sc.workload.model_copy(update={"prompts": 32, "samples": 4, "steps": 3})
        sc = sc.model_copy(update={"jobs": 2, "rollout_samples": 2, "workload": work})
    t0 = time.perf_counter()
    tables: dict[tuple[int, int], StepTable] = {}
    base = run_deployment(sc, next(d for d in sc.deployments if d.name == sc.baseline), tables=tables)
    rows = []
    for r in args.rollout:
        for k in args.pools:
            for overlap in ("none", "one-step"):
                d = Deployment(name=f"R{r}-k{k}-{overlap}", kind="plexrl", jobs_per_pool=k, rollout_accelerators=r,
                               overlap=overlap)  # fmt: skip
                try:
                    res = run_deployment(sc, d, tables=tables)
                except DoesNotFit:
                    continue
                worst = max(res.jct[j] / base.jct[j] for j in res.jct)
                rows.append(
                    (1 - res.gpu_hours_per_step / base.gpu_hours_per_step, d.name, worst, res.decode_efficiency)
                )
    print(f"{sc.name}: {len(rows)} PlexRL layouts vs {sc.baseline} ({time.perf_counter() - t0:.1f}s)")
    print(f"{'layout':<24}{'saving':>8}{'worst slowdown':>16}{'decode eff':>12}")
    for saving, name, worst, eff in sorted(rows, reverse=True)[: args.top]:
        print(f"{name:<24}{saving:>+8.1%}{worst:>16.2f}{eff:>12.1%}")


if __name__ == "__main__":
    main()
