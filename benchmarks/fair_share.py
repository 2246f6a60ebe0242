"""Fair share: one user's single job among another user's many jobs on ONE shared service, in the simulator
(the real `Runner` and `Planner` over a `SimExecutor`: virtual clock, seeded costs; nothing sleeps).

ann submits 1 GRPO-like job, bob submits `--others` (default 20), all at once, all packed on one service
(`Pack(inf)`): the worst case for ann. Each row is one ordering policy; columns: ann's completion time over
her job's time alone on the service (her slowdown), bob's mean completion time, and the makespan. The last
line compares ann's slowdown under `fair-hrrs` (the server's default: `FairShare(Hrrs())`) with plain hrrs.

    .venv/bin/python benchmarks/fair_share.py [--others 20] [--seed 3] [--smoke]

`--smoke`: 3 other jobs of 3-5 iterations (well under a second; the test suite runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any

from plexrl.planner import FairShare, Fifo, Hrrs, Pack, Planner
from plexrl.runtime import Runner
from plexrl.runtime.sim import SeededCosts, SimExecutor, SimJob, grpo_like_jobs


def completion(specs: list[SimJob], ordering: Any) -> dict[str, float]:
    """Each job's completion time (finished - submitted, virtual seconds), all on one service."""
    ex = SimExecutor(1, SeededCosts(seed=0))
    runner = Runner(ex, Planner(clock=ex.clock, placement=Pack(math.inf), ordering=ordering))
    runs = runner.run(specs)
    bad = [r.job_id for r in runs if r.status != "done"]
    if bad:
        raise RuntimeError(f"jobs did not finish: {bad}")
    return {r.job_id: float(r.finished_at or 0.0) - float(r.submitted_at or 0.0) for r in runs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--others", type=int, default=20, help="bob's jobs")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a tiny run for the tests")
    args = ap.parse_args(argv)
    others, iterations = (3, (3, 5)) if args.smoke else (args.others, (40, 60))
    jobs = grpo_like_jobs(others + 1, iterations, seed=args.seed)
    ann = dataclasses.replace(jobs[0], user="ann", job_id="ann")
    bob = [dataclasses.replace(j, user="bob") for j in jobs[1:]]
    alone = completion([ann], Hrrs())["ann"]
    print(f"ann: 1 job ({ann.iterations} iterations, {alone:.1f} s alone); bob: {len(bob)} jobs; one service")
    print("| ordering | ann's slowdown | bob's mean completion s | makespan s |")
    print("|---|---|---|---|")
    slowdown = {}
    for name, ordering in [("fifo", Fifo()), ("hrrs", Hrrs()), ("fair-fifo", FairShare(Fifo())),
                           ("fair-hrrs", FairShare(Hrrs()))]:  # fmt: skip
        t = completion([ann, *bob], ordering)
        slowdown[name] = t["ann"] / alone
        mean_bob = sum(v for k, v in t.items() if k != "ann") / len(bob)
        print(f"| {name} | {slowdown[name]:.2f} | {mean_bob:.1f} | {max(t.values()):.1f} |")
    print(f"ann's slowdown, fair-hrrs / hrrs: {slowdown['fair-hrrs'] / slowdown['hrrs']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
