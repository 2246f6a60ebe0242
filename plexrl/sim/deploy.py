"""Deployments as configurations: each `Deployment` kind becomes a node graph, a number of services (pools
of accelerators the planner schedules), per-job dedicated accelerators and a placement, and runs on the
REAL `Runner` and `Planner` over a `SimExecutor`. No deployment has code of its own beyond its graph, except
`plexrl-engine` (several jobs' rollouts in one engine at once, which a planner service cannot run: the
engine-level model of `plexrl.sim.engine`).

Graphs (`[svc]`: on the job's planner service; `[own]`: on the job's own rollout accelerators, which the
planner does not share; `[cpu]`: the CPU pool):

    colocated, plexrl-shared,
    time-slicing:                 rollout[svc] -> verify[cpu] -> switch[svc] -> train[svc]
    split-sync, plexrl:           rollout[own] -> verify[cpu] -> train[svc] -> sync[svc]
    split-async, plexrl one-step: rollout[own] -> verify[cpu] --+
                                  train[svc] (last step's batch) -+-> sync[svc]   (warm-up rollout first)

Agentic workloads (`tool_stall`) split the rollout in two around a `tool[cpu]` stall. `switch` is the
colocated engine switch (training state out, rollout weights in, and back); `sync` pushes new weights to
the rollout engines over the network.

LoRA scenarios (`Scenario.lora`): training at (4 + 2 x forward_passes) / (6 + 2 x forward_passes) of the
FLOPs, no optimizer offload, adapter-only weight sync; in the plexrl kinds the pool's jobs share one base,
so the planner moves each job's adapter and moments only.

Accounting: a service is allocated from the start until its last job ends, times its accelerators; a job's
own rollout accelerators from its placement to its end. Busy = node time on services + own-lane rollout time
(times their accelerators). Cost per step = allocated accelerator-hours / steps; bubble ratio = 1 - busy /
allocated; slowdown = a job's completion time / the same job's under the baseline deployment.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any

from plexrl.hooks.base import Hook
from plexrl.planner import ORDERINGS, NodePlan, Planner, placement_policy
from plexrl.planner.events import RunsOn
from plexrl.runtime.runner import Budgets, Runner
from plexrl.runtime.sim import SimExecutor, SimJob
from plexrl.sim.config import GB, Accelerator, Deployment, Efficiency, LoRA, Model, Scenario, TrainLayout, Workload
from plexrl.sim.costs import (
    Decoder,
    DoesNotFit,
    RolloutSample,
    SampledCosts,
    adapter_bytes,
    check_host,
    host_bytes,
    lognormal_draws,
    rollout_samples,
    switch_seconds,
    sync_seconds,
    train_seconds,
    train_state_bytes,
)

SLICING = "time-slicing"  # the llm-d / OpenRL design: colocated jobs sharing a pool by an exclusive FIFO lock
SHARED_ROLLOUT = ("colocated", "plexrl-shared", "plexrl-engine", SLICING)  # rollout runs on the pool (its service)
BASELINES = ("colocated", "split-sync", "split-async")
OVERLAPPED = "split-async"


@dataclass(frozen=True, slots=True)
class StepTable:
    """Seeded samples of one step's node durations (index i of every tuple is one step) and constants."""

    rollout: tuple[float, ...]
    train: tuple[float, ...]
    verify: tuple[float, ...]
    tool: tuple[float, ...]
    efficiency: float  # mean decoding efficiency of the rollouts
    tokens: float  # mean generated tokens per step
    decoder: Decoder
    tail: tuple[float, ...] = ()  # partial rollouts: the tail's seconds on the job's own accelerators


def step_table(
    acc: Accelerator, model: Model, eff: Efficiency, work: Workload, layout: TrainLayout,
    rollout_acc: int, rollout_tp: int, k: int, seed: int, reserved: float = 0.0, tail: float = 0.0,
    tail_acc: int = 0, lora: LoRA | None = None,
) -> StepTable:  # fmt: skip
    if tail:
        from plexrl.sim.tail import tail_samples

        cut = tail_samples(acc, model, eff, work, rollout_acc, rollout_tp, k, seed, reserved, tail, tail_acc)
        samples = [RolloutSample(c.bulk, c.tokens, c.prompt_tokens, c.efficiency) for c in cut]
        tab = step_table(acc, model, eff, work, layout, rollout_acc, rollout_tp, k, seed, reserved, lora=lora)
        return dataclasses.replace(
            tab, rollout=tuple(c.bulk for c in cut), tail=tuple(c.tail for c in cut),
            efficiency=_mean_efficiency(samples),
        )  # fmt: skip
    samples, dec = rollout_samples(acc, model, eff, work, rollout_acc, rollout_tp, k, seed, reserved)
    rng = random.Random(f"step/{seed}/{model.name}")
    train = tuple(train_seconds(acc, model, eff, work, layout, s.tokens + s.prompt_tokens, lora) for s in samples)
    stall = work.tool_stall
    return StepTable(
        rollout=tuple(s.seconds for s in samples),
        train=train,
        verify=lognormal_draws(work.verify.median, work.verify.sigma, k, rng),
        tool=lognormal_draws(stall.median, stall.sigma, k, rng) if stall else (),
        efficiency=_mean_efficiency(samples),
        tokens=sum(s.tokens for s in samples) / len(samples),
        decoder=dec,
    )


def _mean_efficiency(samples: list[RolloutSample]) -> float:
    """Time-weighted: total tokens over total decode capacity of the rollouts."""
    return sum(s.efficiency * s.seconds for s in samples) / sum(s.seconds for s in samples)


def job_graph(
    kind: str, overlap: str, agentic: bool, tail: bool = False
) -> tuple[dict[str, NodePlan], tuple[str, ...], frozenset[str]]:
    """(nodes, baseline, dedicated) of one step under a deployment kind (see the module docstring)."""
    on_service = kind in SHARED_ROLLOUT
    roll: RunsOn = "service" if on_service else "cpu"
    nodes: dict[str, NodePlan] = {"rollout": NodePlan(roll, (), inline=False)}
    last = "rollout"
    if tail:
        if agentic or not on_service:
            raise ValueError("tail: only for a rollout on the pool and a workload without tool stalls")
        nodes["tail"] = NodePlan("cpu", ("rollout",), inline=False)  # on the job's own tail accelerators
        nodes["verify"] = NodePlan("cpu", ("tail",), inline=False)
        nodes["switch"] = NodePlan("service", ("verify",))
        nodes["train"] = NodePlan("service", ("switch",))
        return nodes, (), frozenset({"tail"})
    if agentic:
        nodes["tool"] = NodePlan("cpu", ("rollout",), inline=False)
        nodes["rollout2"] = NodePlan(roll, ("tool",), inline=False)
        last = "rollout2"
    nodes["verify"] = NodePlan("cpu", (last,), inline=False)
    rollouts = ("rollout", "rollout2") if agentic else ("rollout",)
    dedicated = frozenset() if on_service else frozenset(rollouts)
    if on_service:
        nodes["switch"] = NodePlan("service", ("verify",))
        nodes["train"] = NodePlan("service", ("switch",))
        return nodes, (), dedicated
    if kind == OVERLAPPED or overlap == "one-step":
        nodes["train"] = NodePlan("service", ())  # trains on the previous step's batch
        nodes["sync"] = NodePlan("service", ("train", "verify"))
        return nodes, rollouts, dedicated
    nodes["train"] = NodePlan("service", ("verify",))
    nodes["sync"] = NodePlan("service", ("train",))
    return nodes, (), dedicated


@dataclass(slots=True)
class DeploymentResult:
    """What one deployment of a scenario cost and how its jobs fared."""

    name: str
    kind: str
    services: int
    service_accelerators: int
    own_accelerators: int  # per job (rollout), 0 when the rollout runs on the service
    jobs: int
    steps: int
    makespan: float
    allocated: float  # accelerator-seconds
    busy: float  # accelerator-seconds
    swap_seconds: float  # blocking swap time summed over services
    decode_efficiency: float
    rollout: float = 0.0  # accelerator-seconds of rollout nodes
    jct: dict[str, float] = field(default_factory=dict)  # job -> completion time, s
    step_seconds: float = 0.0  # mean per-step time of a job
    utilisation: list[tuple[float, float]] = field(default_factory=list)  # (time, busy share) samples
    layout: str = ""  # the rollout layout it ran: "R16 TP1" / "TP2 resident"
    off_policy: bool = False
    candidates: list[tuple[str, float, float]] = field(default_factory=list)  # tuned: (layout, GPU-h/step, step s)
    tail_overlap: float = 0.0  # tail_shared: share of tail time two jobs of a pool were in their tails at once

    @property
    def accelerators(self) -> int:
        return self.services * self.service_accelerators + self.jobs * self.own_accelerators

    @property
    def gpu_hours_per_step(self) -> float:
        return self.allocated / 3600 / self.steps

    @property
    def bubble(self) -> float:
        """Share of allocated accelerator time with no node running."""
        return 1 - self.busy / self.allocated if self.allocated else 0.0

    @property
    def effective_bubble(self) -> float:
        """Share of allocated accelerator time not doing useful work: no node running, or decode capacity a
        rollout's long tail leaves unused (rollout time x (1 - decoding efficiency))."""
        useful = self.busy - self.rollout * (1 - self.decode_efficiency)
        return 1 - useful / self.allocated if self.allocated else 0.0


class _TailSpans(Hook):
    """Collects each job's tail spans, to measure how often a pool's tails overlapped."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = {}

    def after_node(
        self, run: Any, iteration: int, node: str, lane: str, start: float, end: float, metrics: Any
    ) -> None:
        if node == "tail":
            self.spans.setdefault(run.job_id, []).append((start, end))

    def overlap(self, service: dict[str, str]) -> float:
        """Seconds two or more jobs of one pool were in their tails at once / all tail seconds."""
        total = sum(e - s for v in self.spans.values() for s, e in v)
        if not total:
            return 0.0
        by: dict[str, list[tuple[float, int]]] = {}
        for job, v in self.spans.items():
            for s, e in v:
                by.setdefault(service[job], []).extend(((s, 1), (e, -1)))
        both = 0.0
        for events in by.values():
            events.sort()
            running, prev = 0, 0.0
            for t, d in events:
                if running >= 2:
                    both += (t - prev) * running
                running, prev = running + d, t
        return both / total


def job_state(
    kind: str, model: Model, layout: TrainLayout, rollout_tp: int, resident: bool = False, lora: LoRA | None = None
) -> int:
    """Per-accelerator bytes of a job's state the planner moves: the training state or, where rollout shares
    the service, the larger of it and the rollout engine's weights (the job's own `switch` swaps the two, so
    only one is on device when another job's turn comes), or both with a resident training state. LoRA jobs
    sharing a pool (plexrl kinds) share its base, resident once: each moves its adapter and moments only."""
    if lora is not None and kind.startswith("plexrl"):
        return adapter_bytes(layout, lora)
    state = train_state_bytes(model, layout, lora)
    if kind in SHARED_ROLLOUT:
        weights = int(model.params_b * 1e9 * 2 / rollout_tp)
        state = state + weights if resident else max(state, weights)
    return state


def device_budget(acc: Accelerator, eff: Efficiency, kind: str) -> int:
    """Per-accelerator device bytes for job states: what the engines may use minus the training reserve
    (where rollout shares the service, the reserve and the KV cache take turns with the resident job's
    weights, so the whole engine share is the budget)."""
    reserve = 0.0 if kind in SHARED_ROLLOUT else eff.train_reserve_gb * GB
    return int(acc.hbm_gb * GB * eff.memory_utilization - reserve)


def own_accelerators(sc: Scenario, dep: Deployment) -> int:
    if dep.kind in SHARED_ROLLOUT:
        return dep.tail_accelerators if dep.tail else 0
    return dep.rollout_accelerators or sc.rollout_accelerators


def accelerators_per_job(sc: Scenario, dep: Deployment) -> float:
    return own_accelerators(sc, dep) + pool_layout(sc, dep).accelerators / dep.jobs_per_pool


def pool_layout(sc: Scenario, dep: Deployment) -> TrainLayout:
    """The deployment's pool: the scenario's training layout with dp x `pool_scale` (elastic pools)."""
    return sc.train if dep.pool_scale == 1 else sc.train.model_copy(update={"dp": sc.train.dp * dep.pool_scale})


def scenario_jobs(sc: Scenario) -> int:
    if sc.jobs is not None:
        return sc.jobs
    base = next(d for d in sc.deployments if d.name == sc.baseline)
    return max(1, int(sc.cluster_accelerators // accelerators_per_job(sc, base)))


def run_deployment(
    sc: Scenario,
    dep: Deployment,
    acc: Accelerator | None = None,
    tables: dict[Any, StepTable] | None = None,
) -> DeploymentResult:
    """Simulate the scenario's jobs under one deployment (on `acc` if given) with the real runner and planner."""
    acc = acc or sc.accelerator
    model, eff, work, layout = sc.model, sc.efficiency, sc.workload, pool_layout(sc, dep)
    on_service = dep.kind in SHARED_ROLLOUT
    r_acc = layout.accelerators if on_service else own_accelerators(sc, dep)
    own = own_accelerators(sc, dep)
    r_tp = dep.rollout_tp or sc.rollout_tp
    resident = on_service and dep.resident
    lora = sc.lora
    reserved = float(train_state_bytes(model, layout, lora)) if resident else 0.0
    tables = {} if tables is None else tables
    key = (r_acc, r_tp, resident, dep.tail, own if dep.tail else 0, layout.accelerators)
    if key not in tables:
        tables[key] = step_table(acc, model, eff, work, layout, r_acc, r_tp, sc.rollout_samples, sc.seed, reserved,
                                 dep.tail, own, lora)  # fmt: skip
    tab = tables[key]
    n = scenario_jobs(sc)
    shared_base = lora is not None and dep.kind.startswith("plexrl")
    need = host_bytes(model, layout, r_tp, dep.jobs_per_pool, on_service, resident, lora, shared_base)
    check_host(acc, need, dep.name)
    agentic = work.tool_stall is not None
    nodes, baseline, dedicated = job_graph(dep.kind, dep.overlap, agentic, bool(dep.tail))
    half = tuple(x / 2 for x in tab.rollout) if agentic else tab.rollout
    samples = {"rollout": half, "rollout2": half, "train": tab.train, "verify": tab.verify, "tool": tab.tool,
               "tail": tab.tail}  # fmt: skip
    means = {
        "switch": switch_seconds(acc, model, eff, layout, r_tp, resident, lora),
        "sync": sync_seconds(acc, model, eff, min(layout.accelerators, r_acc), r_acc // r_tp, r_tp, lora),
    }
    state = job_state(dep.kind, model, layout, r_tp, resident, lora)
    order = tuple(nodes)
    jobs = [
        SimJob(f"job{i:03d}", nodes, work.steps, means, order, baseline, state, dedicated=dedicated,
               samples={k: v for k, v in samples.items() if k in nodes})
        for i in range(n)
    ]  # fmt: skip
    services = math.ceil(n / dep.jobs_per_pool)
    slicing = dep.kind == SLICING  # every hand-over: the whole state out and in, plus the fixed switch cost each way
    costs = SampledCosts(sc.seed, acc.host_gbps * GB, acc.disk_gbps * GB, eff.switch_fixed_s if slicing else 0.0)
    ex = SimExecutor(services, costs)
    shared = dep.kind.startswith("plexrl")
    placement = placement_policy(dep.placement if shared or slicing else "isolated")
    ordering = ORDERINGS[SLICING if slicing else dep.ordering if shared else "fifo"]()
    # no lookahead: it exists to hide a real driver's round trip (which the simulator does not model) and it
    # commits a service's next node before the running one ends, so a node that becomes ready meanwhile
    # (a 5 s weight sync that would free its job for a 500 s rollout) cannot overtake it
    spans = _TailSpans()
    planner = Planner(clock=ex.clock, placement=placement, ordering=ordering, exclusive=slicing)
    budgets = Budgets(device=device_budget(acc, eff, dep.kind), copy_engine=True)  # (GPUs: moves on a copy stream)
    runner = Runner(ex, planner, hooks=[spans], budgets=budgets)
    runs = runner.run(jobs)
    bad = [(r.job_id, r.error) for r in runs if r.status != "done"]
    if bad:
        raise RuntimeError(f"deployment {dep.name}: {len(bad)} jobs did not finish, e.g. {bad[:2]}")
    size = layout.accelerators
    last_end: dict[str, float] = {}
    allocated = busy = swap = 0.0
    for r in runs:
        assert r.service is not None and r.finished_at is not None and r.started_at is not None
        last_end[r.service] = max(last_end.get(r.service, 0.0), r.finished_at)
        allocated += (0 if dep.tail_shared else own) * (r.finished_at - r.started_at)
    allocated += (size + (own if dep.tail_shared else 0)) * sum(last_end.values())
    for rep in runner.service_reports.values():
        busy += size * rep["busy_seconds"]
        swap += rep["blocking_swap_seconds"]
    busy += own * sum(ex.dedicated_busy.values())
    rollout = sum(row.get("time/rollout", 0.0) + row.get("time/rollout2", 0.0) for r in runs for row in r.history)
    tail_time = sum(row.get("time/tail", 0.0) for r in runs for row in r.history)
    jct = {r.job_id: r.finished_at - (r.submitted_at or 0.0) for r in runs}  # type: ignore[operator]
    steps = sum(r.iterations_done for r in runs)
    overlap = spans.overlap({r.job_id: r.service or "" for r in runs}) if dep.tail_shared else 0.0
    return DeploymentResult(
        dep.name, dep.kind, services, size + (own if dep.tail_shared else 0), 0 if dep.tail_shared else own, n,
        steps, ex.clock(), allocated, busy, swap, tab.efficiency, rollout * (size if on_service else own)
        + tail_time * own, jct, tail_overlap=overlap,
        step_seconds=sum(jct.values()) / steps, layout=layout_label(dep, sc), off_policy=dep.off_policy,
    )  # fmt: skip


def layout_label(dep: Deployment, sc: Scenario) -> str:
    tp = dep.rollout_tp or sc.rollout_tp
    if dep.kind in SHARED_ROLLOUT:
        tail = f" tail {dep.tail:.0%}->{dep.tail_accelerators}" if dep.tail else ""
        tail += "/pool" if dep.tail_shared else ""
        return f"TP{tp} {'resident' if dep.resident else 'offloaded'}{tail}"
    return f"R{dep.rollout_accelerators or sc.rollout_accelerators} TP{tp}"


def tune_candidates(sc: Scenario, dep: Deployment) -> list[Deployment]:
    """The layouts `tune: true` searches for `dep` (the scenario's `tune:` grid)."""
    tps = sc.tune.rollout_tp or [dep.rollout_tp or sc.rollout_tp]
    if dep.kind in SHARED_ROLLOUT:
        grid = [{"rollout_tp": t, "resident": r} for t in tps for r in sc.tune.resident]
    else:
        pools = sc.tune.rollout_accelerators or [dep.rollout_accelerators or sc.rollout_accelerators]
        grid = [{"rollout_tp": t, "rollout_accelerators": r} for r in pools for t in tps if r % t == 0]
    return [dep.model_copy(update=g) for g in grid]


def tune_deployment(
    sc: Scenario, dep: Deployment, acc: Accelerator | None = None, tables: dict[Any, StepTable] | None = None
) -> DeploymentResult:
    """Search `dep`'s layout over the scenario's grid on `sc.tune.jobs` jobs, keep the cheapest (GPU-hours
    per step; ties: the faster step), and rerun it with every job. Layouts that do not fit are skipped."""
    tables = {} if tables is None else tables
    few = sc.model_copy(update={"jobs": min(sc.tune.jobs, scenario_jobs(sc))})
    tried: list[tuple[float, float, Deployment, str]] = []
    for cand in tune_candidates(sc, dep):
        try:
            r = run_deployment(few, cand, acc, tables)
        except DoesNotFit:
            continue
        tried.append((r.gpu_hours_per_step, r.step_seconds, cand, r.layout))
    if not tried:
        raise DoesNotFit(f"deployment {dep.name}: no layout of the tune grid fits; widen tune.rollout_tp")
    _, _, best, _ = min(tried, key=lambda t: (t[0], t[1]))
    out = run_deployment(sc, best, acc, tables)
    out.candidates = [(label, gph, step) for gph, step, _, label in tried]
    return out
