"""Fair share with the SERVER's own defaults: one user's short job among another user's long jobs, in the simulator
(the real `Runner` and a `Planner` built from `ServerConfig().cluster`, the runtime section `plexrl serve` runs
with: one service, `spread+backfill` with `max_load` 1, hrrs ordering, fair share on; a `SimExecutor`: virtual
clock, seeded costs; nothing sleeps).

Two scenarios, each run twice: with the server's defaults (`fair`) and with `fair_share: false` (`arrival`: jobs
weighed in arrival order, as the issue found them):
- `lock-out`: bob submits 3 jobs of `--long` iterations (default 250), then ann 1 job of `--short` (default 5):
  the issue's "ann's 5-iteration job ran after all three of bob's";
- `many`: bob submits `--others` (default 20) GRPO-like jobs of 40-60 iterations, then ann 1 of them.
Columns: ann's wait before her job was first placed, her completion time over her job's time alone (slowdown),
bob's mean completion time and the makespan (virtual seconds). The last lines give ann's slowdown, arrival over
fair, per scenario.

    .venv/bin/python benchmarks/fair_share.py [--long 250] [--short 5] [--others 20] [--seed 3] [--smoke]

`--smoke`: 3 short jobs of bob's (well under a second; the test suite runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from plexrl.planner import Planner
from plexrl.runtime import Runner
from plexrl.runtime.build import budgets_of
from plexrl.runtime.sim import SeededCosts, SimExecutor, SimJob, grpo_like_jobs
from plexrl.server.config import ServerConfig


def run(specs: list[SimJob], section: Any) -> dict[str, tuple[float, float]]:
    """Each job's (wait before first placement, completion time), virtual seconds, on the section's services."""
    ex = SimExecutor(section.services.count, SeededCosts(seed=0))
    runner = Runner(ex, Planner.from_config(section, ex.clock), budgets=budgets_of(section))
    runs = runner.run(specs)
    bad = [r.job_id for r in runs if r.status != "done"]
    if bad:
        raise RuntimeError(f"jobs did not finish: {bad}")
    out = {}
    for r in runs:
        submitted = float(r.submitted_at or 0.0)
        placed = float(r.started_at if r.started_at is not None else submitted)
        out[r.job_id] = (placed - submitted, float(r.finished_at or 0.0) - submitted)
    return out


def scenario(name: str, ann: SimJob, bob: list[SimJob]) -> dict[str, float]:
    """Print the rows of one scenario; ann's slowdown per variant."""
    server = ServerConfig().cluster
    alone = run([ann], server)["ann"][1]
    shown = ", ".join(str(j.iterations) for j in bob[:4]) + (", ..." if len(bob) > 4 else "")
    print(f"\n{name}: ann 1 job ({ann.iterations} iterations, {alone:.1f} s alone), submitted after bob's "
          f"{len(bob)} ({shown} iterations)")  # fmt: skip
    print("| variant | ann waited s | ann's slowdown | bob's mean completion s | makespan s |")
    print("|---|---|---|---|---|")
    slowdown = {}
    arrival = server.model_copy(update={"fair_share": False})
    for variant, section in (("fair (server defaults)", server), ("arrival (fair_share: false)", arrival)):
        t = run([*bob, ann], section)
        waited, done = t["ann"]
        slowdown[variant] = done / alone
        mean_bob = sum(v[1] for k, v in t.items() if k != "ann") / len(bob)
        makespan = max(v[1] for v in t.values())
        print(f"| {variant} | {waited:.1f} | {slowdown[variant]:.2f} | {mean_bob:.1f} | {makespan:.1f} |")
    return slowdown


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=250, help="iterations of bob's jobs in the lock-out scenario")
    ap.add_argument("--short", type=int, default=5, help="iterations of ann's job in the lock-out scenario")
    ap.add_argument("--others", type=int, default=20, help="bob's jobs in the many-jobs scenario")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a tiny run for the tests")
    args = ap.parse_args(argv)
    long, short, others, iterations = (6, 2, 3, (3, 5)) if args.smoke else (args.long, args.short, args.others,
                                                                            (40, 60))  # fmt: skip
    base = grpo_like_jobs(4, (long, long), seed=args.seed)
    bob = [dataclasses.replace(j, user="bob", job_id=f"bob-{i}") for i, j in enumerate(base[1:])]
    ann = dataclasses.replace(base[0], user="ann", job_id="ann", iterations=short)
    lockout = scenario("lock-out", ann, bob)
    jobs = grpo_like_jobs(others + 1, iterations, seed=args.seed)
    bobs = [dataclasses.replace(j, user="bob", job_id=f"bob-{i}") for i, j in enumerate(jobs[1:])]
    many = scenario("many", dataclasses.replace(jobs[0], user="ann", job_id="ann"), bobs)
    print()
    for name, got in (("lock-out", lockout), ("many", many)):
        ratio = got["arrival (fair_share: false)"] / got["fair (server defaults)"]
        print(f"{name}: ann's slowdown, arrival / fair: {ratio:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
