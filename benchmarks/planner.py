"""Planner throughput: decisions (instructions returned by `Planner.handle`) per second with many GRPO-like
jobs multiplexed on many services, for every placement x ordering policy.

A seeded, synthetic driver with a virtual clock (no Dask, no torch, nothing sleeps): services join with a
`--device-gb` device budget (default 6: two 3 GB job states, or one 4 GB state) and unlimited host memory,
so the StateManager swaps; jobs (state 3 or 4 GB) arrive over the first 5 s with a GRPO-like plan
(prompts[cpu] -> rollout[service] -> verify[cpu] -> advantage[cpu] -> train[service] -> evaluate[service,
every 10]), 30% with a baseline evaluate, 20% with a heavy-tailed verify. In-flight RunNodes sit in a heap
keyed by their virtual finish time (swap time at 20 GB/s + a node duration drawn per job, iteration and node,
so every policy sees the same work); the earliest is popped, the clock advanced and a NodeFinished (with
duration and swap bytes/seconds) fed back, until every job is done.

Only the `planner.handle` calls are timed (perf_counter around each, summed); the simulation bookkeeping is
not (`wall s` is the whole run, for reference). decisions/s = instructions returned / handle seconds;
events/s = events handled / handle seconds. Rows run with `validate=False` (the production setting) plus one
reference row with `validate=True`; the last line compares the worst validate=False row with the goal.
A row whose handle time passes `--row-seconds` is cut there (marked `*`, rates over the events handled so
far: the busiest, early part of the run), so that a slow policy does not make the whole run take minutes;
`--row-seconds 0` runs every row to the end. Uncut rows handle the same events whatever the machine.
Columns: instr = instructions (decisions); moves = state moves in RunNode swaps + prefetches; sim s = virtual
time at the end; handle s = summed handle time; p99/max us = per-event handle latency.

    .venv/bin/python benchmarks/planner.py [--jobs 100] [--services 64] [--iterations 20-50] [--seed 0]
        [--device-gb 6] [--row-seconds 8] [--placements ...] [--orderings ...] [--validate-row spread/fifo]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import time
from dataclasses import dataclass

from plexrl.planner import (
    ORDERINGS,
    PLACEMENTS,
    JobDone,
    JobPlan,
    JobSubmitted,
    NodeFinished,
    NodePlan,
    Planner,
    RunNode,
    ServiceJoined,
)
from plexrl.planner.events import Event

GOAL = 10_000  # decisions per second
GB = 1_000_000_000
SWAP_BANDWIDTH = 20 * GB  # bytes/second of the simulated state moves
ORDER = ("prompts", "rollout", "verify", "advantage", "train", "evaluate")


def grpo_nodes(every: int) -> dict[str, NodePlan]:
    return {
        "prompts": NodePlan("cpu"),
        "rollout": NodePlan("service", ("prompts",)),
        "verify": NodePlan("cpu", ("rollout",)),
        "advantage": NodePlan("cpu", ("rollout", "verify")),
        "train": NodePlan("service", ("advantage", "rollout")),
        "evaluate": NodePlan("service", ("train",), every=every),
    }


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A synthetic job: its plan, arrival time and mean node durations (seconds)."""

    job_id: str
    plan: JobPlan
    arrival: float
    means: dict[str, float]
    long_tail: bool  # verify is heavy-tailed (Pareto) for this job: a slow reward model / sandbox


def make_jobs(n: int, iterations: tuple[int, int], seed: int) -> list[JobSpec]:
    rng = random.Random(seed)
    nodes = grpo_nodes(every=10)
    specs = []
    for i in range(n):
        plan = JobPlan(
            nodes,
            iterations=rng.randint(*iterations),
            order=ORDER,
            baseline=("evaluate",) if rng.random() < 0.3 else (),
            state_bytes=rng.choice((3 * GB, 4 * GB)),
        )
        means = {
            "prompts": rng.uniform(0.005, 0.02),
            "rollout": rng.uniform(0.1, 0.5),
            "verify": rng.uniform(0.02, 0.2),
            "advantage": rng.uniform(0.002, 0.01),
            "train": rng.uniform(0.1, 0.4),
            "evaluate": rng.uniform(0.1, 0.3),
        }
        specs.append(JobSpec(f"job{i:03d}", plan, rng.uniform(0.0, 5.0), means, rng.random() < 0.2))
    return specs


def duration(spec: JobSpec, iteration: int, node: str, seed: int) -> float:
    """Node run time, a pure function of (seed, job, iteration, node): the same for every policy."""
    rng = random.Random(f"{seed}/{spec.job_id}/{iteration}/{node}")
    mean = spec.means[node]
    if node == "verify" and spec.long_tail:
        return mean * rng.paretovariate(1.5) / 3  # mean of Pareto(1.5) is 3; rare draws are 10-100x
    return mean * rng.uniform(0.7, 1.3)


@dataclass(slots=True)
class Result:
    label: str
    events: int
    instructions: int
    moves: int
    makespan: float
    handle_s: float
    wall_s: float
    p99_us: float
    max_us: float
    cut: bool  # stopped at --row-seconds of handle time, before every job was done


def simulate(
    placement: str,
    ordering: str,
    specs: list[JobSpec],
    services: int,
    device_bytes: int,
    seed: int,
    validate: bool,
    row_seconds: float = 0.0,
) -> Result:
    now = [0.0]
    planner = Planner(
        clock=lambda: now[0],
        placement=PLACEMENTS[placement](),
        ordering=ORDERINGS[ordering](),
        validate=validate,
    )
    by_id = {s.job_id: s for s in specs}
    seq = 0
    heap: list[tuple[float, int, Event]] = []  # (virtual time, tie-break, event)
    for k in range(services):
        heap.append((0.0, seq, ServiceJoined(f"s{k:03d}", device_bytes=device_bytes)))
        seq += 1
    for s in specs:
        heap.append((s.arrival, seq, JobSubmitted(s.job_id, s.plan)))
        seq += 1
    heapq.heapify(heap)
    lat: list[float] = []
    events = instructions = moves = done = 0
    handle_s = 0.0
    cut = False
    perf = time.perf_counter
    handle = planner.handle
    wall0 = perf()
    while heap:
        if row_seconds and handle_s > row_seconds:
            cut = True
            break
        t, _, event = heapq.heappop(heap)
        now[0] = t
        t0 = perf()
        out = handle(event)
        dt = perf() - t0
        lat.append(dt)
        handle_s += dt
        events += 1
        instructions += len(out)
        for ins in out:
            if isinstance(ins, RunNode):
                nbytes = sum(m.nbytes for m in ins.swaps)
                moves += len(ins.swaps) + len(ins.prefetch)
                swap_s = nbytes / SWAP_BANDWIDTH
                d = duration(by_id[ins.job_id], ins.iteration, ins.node, seed)
                fin = NodeFinished(ins.job_id, ins.iteration, ins.node, True, None, d, nbytes, swap_s)
                heapq.heappush(heap, (t + swap_s + d, seq, fin))
                seq += 1
            elif isinstance(ins, JobDone):
                done += 1
    wall = perf() - wall0
    if not cut and (not planner.finished or done != len(specs)):
        raise RuntimeError(f"{placement}/{ordering}: simulation stalled with {done}/{len(specs)} jobs done")
    lat.sort()
    return Result(
        f"{placement}/{ordering}" + (" validate" if validate else ""),
        events,
        instructions,
        moves,
        now[0],
        handle_s,
        wall,
        lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)] * 1e6,
        lat[-1] * 1e6,
        cut,
    )


def iteration_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return (int(lo), int(hi or lo))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--services", type=int, default=64)
    ap.add_argument("--iterations", type=iteration_range, default=(20, 50), help="per job, uniform in LO-HI (or N)")
    ap.add_argument("--device-gb", type=float, default=6.0, help="device budget per service (host unlimited)")
    ap.add_argument("--row-seconds", type=float, default=8.0, help="cut a row after this much handle time (0: never)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--placements", nargs="*", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    ap.add_argument("--orderings", nargs="*", default=list(ORDERINGS), choices=list(ORDERINGS))
    ap.add_argument(
        "--validate-row", default="spread/fifo", help="placement/ordering of the validate=True row ('' for none)"
    )
    args = ap.parse_args()
    specs = make_jobs(args.jobs, args.iterations, args.seed)
    runs = [(p, o, False) for p in args.placements for o in args.orderings]
    if args.validate_row:
        p, _, o = args.validate_row.partition("/")
        if p not in PLACEMENTS or o not in ORDERINGS:
            ap.error(f"--validate-row {args.validate_row!r}: want PLACEMENT/ORDERING, e.g. spread/fifo")
        runs.append((p, o, True))
    print(
        f"jobs {args.jobs}, services {args.services}, iterations {args.iterations[0]}-{args.iterations[1]}, "
        f"device {args.device_gb:g} GB per service (job states 3-4 GB), host unlimited, seed {args.seed}"
    )
    head = (
        f"{'policy':<32}{'events':>8}{'instr':>8}{'moves':>7}{'sim s':>8}{'handle s':>10}{'wall s':>8}"
        f"{'events/s':>10}{'decisions/s':>13}{'p99 us':>9}{'max us':>9}"
    )
    print(head)
    print("-" * len(head))
    results = []
    start = time.perf_counter()
    for p, o, validate in runs:
        r = simulate(p, o, specs, args.services, int(args.device_gb * GB), args.seed, validate, args.row_seconds)
        results.append((r, validate))
        events = f"{r.events}{'*' if r.cut else ''}"
        print(
            f"{r.label:<32}{events:>8}{r.instructions:>8}{r.moves:>7}{r.makespan:>8.1f}{r.handle_s:>10.3f}"
            f"{r.wall_s:>8.2f}{r.events / r.handle_s:>10.0f}{r.instructions / r.handle_s:>13.0f}"
            f"{r.p99_us:>9.0f}{r.max_us:>9.0f}",
            flush=True,
        )
    print(f"total wall {time.perf_counter() - start:.1f} s")
    if any(r.cut for r, _ in results):
        print(f"* cut after {args.row_seconds:g} s of handle time (--row-seconds); rates over the events handled")
    prod = [r for r, validate in results if not validate]
    if prod:
        worst = min(prod, key=lambda r: r.instructions / r.handle_s)
        rate = worst.instructions / worst.handle_s
        verdict = "meets" if rate >= GOAL else "BELOW"
        print(f"worst validate=False: {worst.label} {rate:,.0f} decisions/s ({verdict} the {GOAL:,} goal)")


if __name__ == "__main__":
    main()
