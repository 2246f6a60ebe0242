"""Trace replay: a seeded synthetic arrival trace of RLVR jobs on one cluster, under each placement policy, on
the real runner and planner over a `SimExecutor`.

The cluster is `cluster_accelerators / service_accelerators` pools (planner services); a job lives on one
pool for its whole life (strict affinity). `deployment: plexrl` (the paper's layout): the pools train and
each job's rollout runs on `rollout_accelerators` of its own, outside the pools (a rollout fleet the replay
does not constrain); graph rollout[own] -> (tool[cpu] -> rollout2[own]) -> verify[cpu] -> train[pool] ->
sync[pool]. `deployment: plexrl-shared`: rollout and training both on the pool (rollout[pool] -> ... ->
switch[pool] -> train[pool]). `isolated` gives each job a pool of its own (a job waits while all are
taken): the per-job allocation the paper compares against; the other placements share pools, and the
planner interleaves the jobs' nodes in each other's gaps. `steps_per_node` > 1 makes one simulated node
stand for that many steps (durations summed): fewer events, coarser interleaving.

Arrivals: `jobs` arrival times over `days`, a `burst` share of them in weekday working hours (9:00-18:00,
Monday to Friday) and the rest uniform; each job's class is drawn by `weight`, its steps lognormal around the
class's `steps_median`. Everything is a pure function of `seed`.

Per policy: makespan (first arrival to last completion), queueing delay (arrival to placement), slowdown
(completion time / the job's time alone on an empty pool, which for a chain-shaped step is exactly the sum
of its node durations, with the load overlapping the first off-pool nodes), and utilisation over time (busy
pool accelerators / pool accelerators).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from plexrl.hooks.base import Hook
from plexrl.planner import ORDERINGS, placement_policy
from plexrl.runtime.runner import Budgets, Runner
from plexrl.runtime.sim import SimExecutor, SimJob
from plexrl.sim.config import GB, JobClass, Trace, TrainLayout
from plexrl.sim.costs import SampledCosts, switch_seconds, sync_seconds
from plexrl.sim.deploy import StepTable, device_budget, job_graph, job_state, step_table

DAY = 86_400.0


@dataclass(frozen=True, slots=True)
class Arrival:
    job_id: str
    at: float  # seconds after the trace starts
    cls: int  # index into Trace.classes
    steps: int


def arrivals(tr: Trace) -> list[Arrival]:
    """The trace's jobs in arrival order (see the module docstring)."""
    rng = random.Random(f"trace/{tr.seed}")
    weights = [c.weight for c in tr.classes]
    days = max(1, int(tr.days))
    workdays = [d for d in range(days) if d % 7 < 5] or list(range(days))
    times = []
    for _ in range(tr.jobs):
        if rng.random() < tr.burst:
            times.append(rng.choice(workdays) * DAY + rng.uniform(9, 18) * 3600)
        else:
            times.append(rng.uniform(0, tr.days * DAY))
    times.sort()
    out = []
    for i, t in enumerate(times):
        k = rng.choices(range(len(tr.classes)), weights)[0]
        c = tr.classes[k]
        steps = max(1, round(rng.lognormvariate(math.log(c.steps_median), c.steps_sigma)))
        out.append(Arrival(f"job{i:03d}", t, k, steps))
    return out


def class_layout(tr: Trace, c: JobClass) -> TrainLayout:
    if tr.service_accelerators % c.train_tp:
        raise ValueError(
            f"class {c.name}: train_tp {c.train_tp} does not divide {tr.service_accelerators} accelerators"
        )
    return TrainLayout.model_validate({"tp": c.train_tp, "dp": tr.service_accelerators // c.train_tp, "zero": 2})


def rollout_accelerators(tr: Trace, c: JobClass) -> int:
    return tr.service_accelerators if tr.deployment == "plexrl-shared" else c.rollout_accelerators


def class_tables(tr: Trace) -> list[StepTable]:
    acc, eff = tr.accelerator, tr.efficiency
    return [
        step_table(acc, c.model, eff, c.workload, class_layout(tr, c), rollout_accelerators(tr, c), c.rollout_tp,
                   tr.rollout_samples, tr.seed + i)
        for i, c in enumerate(tr.classes)
    ]  # fmt: skip


def coarsen(samples: tuple[float, ...], k: int, rng: random.Random, n: int = 64) -> tuple[float, ...]:
    """Durations of `k` steps in a row: `n` sums of `k` draws from the per-step `samples`."""
    if k == 1 or not samples:
        return samples
    return tuple(sum(rng.choices(samples, k=k)) for _ in range(n))


def trace_jobs(tr: Trace, tables: list[StepTable] | None = None) -> tuple[list[SimJob], dict[str, float]]:
    """The trace's `SimJob`s and their arrival times."""
    tables = tables or class_tables(tr)
    k = tr.steps_per_node
    rng = random.Random(f"coarsen/{tr.seed}")
    per_class = []
    for c, tab in zip(tr.classes, tables, strict=True):
        layout = class_layout(tr, c)
        acc, model, eff = tr.accelerator, c.model, tr.efficiency
        agentic = c.workload.tool_stall is not None
        nodes, baseline, dedicated = job_graph(tr.deployment, "none", agentic)
        half = tuple(x / 2 for x in tab.rollout) if agentic else tab.rollout
        raw = {"rollout": half, "rollout2": half, "train": tab.train, "verify": tab.verify, "tool": tab.tool}
        samples = {name: coarsen(v, k, rng) for name, v in raw.items() if name in nodes}
        means = {
            "switch": k * switch_seconds(acc, model, eff, layout, c.rollout_tp),
            "sync": k
            * sync_seconds(
                acc,
                model,
                eff,
                min(layout.accelerators, ra := rollout_accelerators(tr, c)),
                ra // c.rollout_tp,
                c.rollout_tp,
            ),
        }
        state = job_state(tr.deployment, model, layout, c.rollout_tp)
        per_class.append((nodes, baseline, dedicated, samples, means, state))
    jobs, when = [], {}
    for a in arrivals(tr):
        nodes, baseline, dedicated, samples, means, state = per_class[a.cls]
        its = max(1, math.ceil(a.steps / k))
        jobs.append(SimJob(a.job_id, nodes, its, means, tuple(nodes), baseline, state, dedicated=dedicated,
                           samples=samples))  # fmt: skip
        when[a.job_id] = a.at
    return jobs, when


def alone_seconds(job: SimJob, costs: SampledCosts) -> float:
    """The job's completion time alone on an empty pool. Its step is a chain, so it is every node in turn,
    except that the load (on the pool) overlaps the first iteration's leading off-pool nodes."""
    total = lead = 0.0
    leading = True
    for it in range(job.iterations):
        for name, node in job.nodes.items():  # a chain: insertion order is the run order
            sec = costs.duration(job, it, name)
            total += sec
            if leading and node.placement == "service":
                leading = False
            if leading:
                lead += sec
    return max(costs.load_seconds(job, job.state_bytes), lead) + total - lead


class _Busy(Hook):
    """Collects service node spans (start, end) for utilisation over time."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def after_node(
        self, run: Any, iteration: int, node: str, lane: str, start: float, end: float, metrics: Any
    ) -> None:
        if lane != "cpu":
            self.spans.append((start, end))


@dataclass(slots=True)
class PolicyResult:
    placement: str
    makespan: float
    queue: dict[str, float]  # job -> arrival to placement, s
    slowdown: dict[str, float]  # job -> completion time / alone
    busy: float  # accelerator-seconds of service nodes
    allocated: float  # cluster accelerators x makespan
    utilisation: list[tuple[float, float]] = field(default_factory=list)  # (day, busy share of the cluster)
    wall_s: float = 0.0
    events: int = 0


def replay(tr: Trace, placement: str, jobs: list[SimJob], when: dict[str, float], bins: int = 120) -> PolicyResult:
    """One placement policy over the whole trace."""
    import time

    t0 = time.perf_counter()
    costs = SampledCosts(tr.seed, tr.accelerator.host_gbps * GB, tr.accelerator.disk_gbps * GB)
    ex = SimExecutor(tr.services, costs)
    busy_hook = _Busy()
    runner = Runner(
        ex, hooks=[busy_hook], placement=placement_policy(placement, tr.max_load), ordering=ORDERINGS[tr.ordering](),
        budgets=Budgets(device=device_budget(tr.accelerator, tr.efficiency, tr.deployment)),
    )  # fmt: skip
    runs = runner.run(jobs, arrivals=when)
    bad = [(r.job_id, r.error) for r in runs if r.status != "done"]
    if bad:
        raise RuntimeError(f"placement {placement}: {len(bad)} jobs did not finish, e.g. {bad[:2]}")
    start = min(when.values())
    makespan = max(r.finished_at or 0.0 for r in runs) - start
    queue = {r.job_id: (r.started_at or 0.0) - when[r.job_id] for r in runs}
    slowdown = {
        r.job_id: ((r.finished_at or 0.0) - when[r.job_id]) / alone_seconds(j, costs)
        for r, j in zip(runs, jobs, strict=True)
    }
    size = tr.service_accelerators
    busy = size * sum(e - s for s, e in busy_hook.spans)  # pool time; own rollout accelerators not counted
    util = _utilisation(busy_hook.spans, start, start + makespan, bins, size / tr.cluster_accelerators)
    return PolicyResult(
        placement, makespan, queue, slowdown, busy, tr.cluster_accelerators * makespan, util,
        time.perf_counter() - t0, runner.events_handled,
    )  # fmt: skip


def _utilisation(
    spans: list[tuple[float, float]], t0: float, t1: float, bins: int, share: float
) -> list[tuple[float, float]]:
    """Busy share of the cluster per time bin (each span weighs `share` = one pool's share of the cluster)."""
    width = (t1 - t0) / bins if t1 > t0 else 1.0
    acc = [0.0] * bins
    for s, e in spans:
        i = max(int((s - t0) / width), 0)
        while s < e and i < bins:
            edge = t0 + (i + 1) * width
            acc[i] += min(e, edge) - s
            s, i = edge, i + 1
    return [((t0 + (i + 0.5) * width) / DAY, share * a / width) for i, a in enumerate(acc)]


def run_trace(tr: Trace) -> list[PolicyResult]:
    tables = class_tables(tr)
    jobs, when = trace_jobs(tr, tables)
    return [replay(tr, p, jobs, when) for p in tr.placements]
