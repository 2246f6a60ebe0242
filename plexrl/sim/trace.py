"""Trace replay: a seeded synthetic arrival trace of RLVR jobs on one cluster, under each placement policy, on
the real runner and planner over a `SimExecutor`.

The cluster's `cluster_accelerators` hold everything. `deployment: plexrl` (the paper's layout): a
`rollout_fleet` of them runs the jobs' own rollouts (each job holds `rollout_accelerators` of the fleet
from its placement to its end, and waits to be placed while the fleet is full), and the rest is
`(cluster - fleet) / service_accelerators` training pools (planner services); a job lives on one pool for its
whole life (strict affinity); graph rollout[own] -> (tool[cpu] -> rollout2[own]) -> verify[cpu] ->
train[pool] -> sync[pool]. `deployment: plexrl-shared`: rollout and training both on the pool
(rollout[pool] -> ... -> switch[pool] -> train[pool]). The sharing placements (pack, spread,
spread+backfill) let the planner interleave the jobs' nodes in each other's gaps; `time-slicing` admits as
spread+backfill and runs each pool as the llm-d / OpenRL design would (`deploy.py`). `isolated` is what a user
would book without PlexRL: each job its own allocation of its class's `train_accelerators` (plus its
`rollout_accelerators` under plexrl) out of the whole cluster, first come first served (a job waits until
enough accelerators are free and every earlier job has started); isolated jobs do not interact, so their
runs are the lone-run times of `alone_seconds`. `steps_per_node` > 1 makes one simulated node stand for that
many steps (durations summed): fewer events, coarser interleaving.

Arrivals: `jobs` arrival times over `days`, a `burst` share of them in weekday working hours (9:00-18:00,
Monday to Friday) and the rest uniform; each job's class is drawn by `weight`, its steps lognormal around the
class's `steps_median`. Everything is a pure function of `seed`.

Per policy: makespan (first arrival to last completion), queueing delay (arrival to placement), slowdown
(completion time / the job's time alone on its allocation: an empty pool, or its own isolated one; for a
chain-shaped step exactly the sum of its node durations, with the load overlapping the first off-pool
nodes), and utilisation (busy accelerator-time, training and rollout, over the cluster's).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plexrl.hooks.base import Hook
from plexrl.planner import ORDERINGS, Planner, placement_policy
from plexrl.planner.placement import PlacementPolicy, ServiceView
from plexrl.runtime.runner import Budgets, Runner
from plexrl.runtime.sim import SimExecutor, SimJob
from plexrl.sim.config import GB, JobClass, Trace, TrainLayout
from plexrl.sim.costs import SampledCosts, switch_seconds, sync_seconds
from plexrl.sim.deploy import SLICING, StepTable, device_budget, job_graph, job_state, step_table

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


def class_layout(tr: Trace, c: JobClass, isolated: bool = False) -> TrainLayout:
    """Training on the whole pool, or (`isolated`) on the class's own `train_accelerators`."""
    size = c.train_accelerators if isolated else tr.service_accelerators
    if size % c.train_tp:
        raise ValueError(f"class {c.name}: train_tp {c.train_tp} does not divide {size} accelerators")
    return TrainLayout.model_validate({"tp": c.train_tp, "dp": size // c.train_tp, "zero": 2})


def rollout_accelerators(tr: Trace, c: JobClass, isolated: bool = False) -> int:
    if tr.deployment == "plexrl-shared":
        return c.train_accelerators if isolated else tr.service_accelerators
    return c.rollout_accelerators


def allocation(tr: Trace, c: JobClass) -> int:
    """Accelerators an isolated job of class `c` books: training, plus its own rollout under plexrl."""
    return c.train_accelerators + (c.rollout_accelerators if tr.deployment == "plexrl" else 0)


def class_tables(tr: Trace, isolated: bool = False) -> list[StepTable]:
    acc, eff = tr.accelerator, tr.efficiency
    return [
        step_table(acc, c.model, eff, c.workload, class_layout(tr, c, isolated), rollout_accelerators(tr, c, isolated),
                   c.rollout_tp, tr.rollout_samples, tr.seed + i)
        for i, c in enumerate(tr.classes)
    ]  # fmt: skip


def coarsen(samples: tuple[float, ...], k: int, rng: random.Random, n: int = 64) -> tuple[float, ...]:
    """Durations of `k` steps in a row: `n` sums of `k` draws from the per-step `samples`."""
    if k == 1 or not samples:
        return samples
    return tuple(sum(rng.choices(samples, k=k)) for _ in range(n))


def trace_jobs(
    tr: Trace, tables: list[StepTable] | None = None, isolated: bool = False
) -> tuple[list[SimJob], dict[str, float]]:
    """The trace's `SimJob`s and their arrival times (`isolated`: each on its own user-sized allocation)."""
    tables = tables or class_tables(tr, isolated)
    k = tr.steps_per_node
    rng = random.Random(f"coarsen/{tr.seed}")
    per_class = []
    for c, tab in zip(tr.classes, tables, strict=True):
        layout = class_layout(tr, c, isolated)
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
            if leading and node.runs_on == "service":
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
    busy: float  # accelerator-seconds of nodes on accelerators: pools (or isolated allocations) and rollouts
    allocated: float  # cluster accelerators x makespan
    utilisation: list[tuple[float, float]] = field(default_factory=list)  # (day, busy share of the cluster)
    wall_s: float = 0.0
    events: int = 0
    fleet_peak: int = 0  # most rollout-fleet accelerators held at once (plexrl)


class FleetGate:
    """A placement policy that places a job only while its rollout accelerators are free in the fleet (held
    from placement to the job's end, as `ended` tells), and otherwise asks the wrapped policy."""

    def __init__(self, inner: PlacementPolicy, need: dict[str, int], fleet: int) -> None:
        self.inner, self.need, self.fleet = inner, need, fleet
        self.name = inner.name
        self.uses_load = True  # a refused job must be retried as jobs end, whatever the wrapped policy says
        self.in_use = self.peak = 0
        self._held: set[str] = set()
        self.ended: Callable[[str], bool] = lambda job_id: False

    def place(self, job_id: str, job_load: float, services: list[ServiceView]) -> str | None:
        for done in [j for j in self._held if self.ended(j)]:  # the planner retries placement before hooks run
            self.release(done)
        n = self.need.get(job_id, 0)
        if self.in_use + n > self.fleet:
            return None
        target = self.inner.place(job_id, job_load, services)
        if target is not None:
            self.in_use += n
            self.peak = max(self.peak, self.in_use)
            self._held.add(job_id)
        return target

    def release(self, job_id: str) -> None:
        if job_id in self._held:
            self._held.discard(job_id)
            self.in_use -= self.need.get(job_id, 0)


class _Release(Hook):
    def __init__(self, gate: FleetGate) -> None:
        self.gate = gate

    def on_job_end(self, run: Any) -> None:
        self.gate.release(run.job_id)


def busy_seconds(job: SimJob, costs: SampledCosts, own: int, pool: int) -> float:
    """Accelerator-seconds a job's nodes keep accelerators busy: own-lane nodes x `own`, service nodes x `pool`."""
    total = 0.0
    for it in range(job.iterations):
        for name, node in job.nodes.items():
            if name in job.dedicated:
                total += own * costs.duration(job, it, name)
            elif node.runs_on == "service":
                total += pool * costs.duration(job, it, name)
    return total


def replay_isolated(tr: Trace, jobs: list[SimJob], when: dict[str, float]) -> PolicyResult:
    """User-sized isolated allocations, first come first served on the whole cluster (see the module
    docstring). `jobs` are built with `trace_jobs(tr, isolated=True)`."""
    import time

    t0 = time.perf_counter()
    costs = SampledCosts(tr.seed, tr.accelerator.host_gbps * GB, tr.accelerator.disk_gbps * GB)
    cls = {a.job_id: tr.classes[a.cls] for a in arrivals(tr)}
    free, last_start = tr.cluster_accelerators, 0.0
    running: list[tuple[float, int]] = []
    queue: dict[str, float] = {}
    slowdown: dict[str, float] = {}
    ends: list[float] = []
    spans: list[tuple[float, float, int]] = []
    busy = 0.0
    for job in sorted(jobs, key=lambda j: (when[j.job_id], j.job_id)):
        c = cls[job.job_id]
        size = allocation(tr, c)
        if size > tr.cluster_accelerators:
            raise ValueError(f"class {c.name}: an isolated job needs {size} accelerators, more than the cluster")
        t = max(when[job.job_id], last_start)  # first come, first served
        while running and running[0][0] <= t:
            free += heapq.heappop(running)[1]
        while free < size:
            end, n = heapq.heappop(running)
            t, free = max(t, end), free + n
        alone = alone_seconds(job, costs)
        heapq.heappush(running, (t + alone, size))
        free -= size
        last_start = t
        queue[job.job_id] = t - when[job.job_id]
        slowdown[job.job_id] = (t + alone - when[job.job_id]) / alone
        ends.append(t + alone)
        own = c.rollout_accelerators if tr.deployment == "plexrl" else 0
        busy += busy_seconds(job, costs, own, c.train_accelerators)
        spans.append((t, t + alone, size))
    start = min(when.values())
    makespan = max(ends) - start
    util = [(d, min(1.0, u)) for d, u in _allocated(spans, start, start + makespan, 120, tr.cluster_accelerators)]
    return PolicyResult("isolated", makespan, queue, slowdown, busy, tr.cluster_accelerators * makespan, util,
                        time.perf_counter() - t0, len(jobs))  # fmt: skip


def _allocated(
    spans: list[tuple[float, float, int]], t0: float, t1: float, bins: int, cluster: int
) -> list[tuple[float, float]]:
    """Allocated share of the cluster per time bin (isolated: whole allocations, busy or not)."""
    width = (t1 - t0) / bins if t1 > t0 else 1.0
    acc = [0.0] * bins
    for s, e, n in spans:
        i = max(int((s - t0) / width), 0)
        while s < e and i < bins:
            edge = t0 + (i + 1) * width
            acc[i] += (min(e, edge) - s) * n
            s, i = edge, i + 1
    return [((t0 + (i + 0.5) * width) / DAY, a / width / cluster) for i, a in enumerate(acc)]


def replay(tr: Trace, placement: str, jobs: list[SimJob], when: dict[str, float], bins: int = 120) -> PolicyResult:
    """One placement policy over the whole trace."""
    import time

    if placement == "isolated":
        raise ValueError("isolated is replayed by replay_isolated (user-sized allocations), not on the pools")
    t0 = time.perf_counter()
    # `time-slicing`: the pools admit as spread+backfill and run their jobs under the llm-d / OpenRL design (a FIFO
    # lock per pool held for a phase, the whole state out and in at each hand-over plus switch_fixed_s each way)
    slicing = placement == SLICING
    fixed = tr.efficiency.switch_fixed_s if slicing else 0.0
    costs = SampledCosts(tr.seed, tr.accelerator.host_gbps * GB, tr.accelerator.disk_gbps * GB, fixed)
    ex = SimExecutor(tr.services, costs)
    busy_hook = _Busy()
    cls = {a.job_id: tr.classes[a.cls] for a in arrivals(tr)}
    own = {j: c.rollout_accelerators if tr.deployment == "plexrl" else 0 for j, c in cls.items()}
    gate = FleetGate(placement_policy("spread+backfill" if slicing else placement, tr.max_load), own, tr.rollout_fleet)
    ordering = ORDERINGS[SLICING if slicing else tr.ordering]()
    planner = Planner(clock=ex.clock, placement=gate, ordering=ordering, exclusive=slicing)
    runner = Runner(ex, planner, hooks=[busy_hook, _Release(gate)],
                    budgets=Budgets(device=device_budget(tr.accelerator, tr.efficiency, tr.deployment),
                                    copy_engine=True))  # fmt: skip
    jobs_seen = runner.planner.jobs
    gate.ended = lambda job_id: jobs_seen[job_id].status in ("done", "failed", "cancelled")
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
    busy = size * sum(e - s for s, e in busy_hook.spans)  # pool time
    busy += sum(own[j] * sec for j, sec in ex.dedicated_busy.items())  # the rollout fleet's
    util = _utilisation(busy_hook.spans, start, start + makespan, bins, size / tr.cluster_accelerators)
    return PolicyResult(
        placement, makespan, queue, slowdown, busy, tr.cluster_accelerators * makespan, util,
        time.perf_counter() - t0, runner.events_handled, gate.peak,
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


def run_policy(tr: Trace, placement: str, shared: tuple[list[SimJob], dict[str, float]] | None = None,
               isolated: tuple[list[SimJob], dict[str, float]] | None = None) -> PolicyResult:  # fmt: skip
    """One placement: `isolated` on user-sized allocations, the others on the pools."""
    if placement == "isolated":
        jobs, when = isolated or trace_jobs(tr, isolated=True)
        return replay_isolated(tr, jobs, when)
    jobs, when = shared or trace_jobs(tr)
    return replay(tr, placement, jobs, when)


def run_trace(tr: Trace) -> list[PolicyResult]:
    shared = trace_jobs(tr) if any(p != "isolated" for p in tr.placements) else None
    iso = trace_jobs(tr, isolated=True) if "isolated" in tr.placements else None
    return [run_policy(tr, p, shared, iso) for p in tr.placements]


def load_sweep(tr: Trace, factors: list[float], placement: str = "spread+backfill") -> list[tuple[float, float]]:
    """(load factor, makespan of `placement` / isolated's) with the trace's job count scaled by each factor
    over the same days: how much the ratio owes to how loaded the cluster is."""
    out = []
    for f in factors:
        t = tr.model_copy(update={"jobs": max(1, round(tr.jobs * f))})
        iso, shared = run_policy(t, "isolated"), run_policy(t, placement)
        out.append((f, shared.makespan / iso.makespan))
    return out
