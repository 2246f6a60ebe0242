"""Calibration: fit the simulator's costs from a RECORDED run (its timeline spans), then predict another run
of the same jobs, isolated and multiplexed, with the real runner and planner on a `SimExecutor`.

What is fitted, per job:
- each node's durations (the empirical distribution of its recorded spans; a simulated iteration draws one
  recorded iteration's durations for all its nodes, so correlated nodes stay correlated);
- the job's load time (engine start and first state placement: its `load` span);
- its state size (measured when it was loaded: its `load` span's bytes; else the plan's estimate);
and, for the run: the swap model (from the run's move records where given: `plexrl.sim.costs.fit_swap` over the
moves into kept buffers gives a bandwidth and a fixed cost per move, and the moves that made a buffer give the
first-touch rate the simulated run's first moves pay; without records, bytes / seconds over all blocking swap
spans), and the dispatch
latency of cpu and service nodes: the median gap between the moment a node could start (its inputs' end, or
the previous iteration's end for a first node) and its start, counting only service nodes whose service was
idle meanwhile, less their own swap-in (so the gap is the driver's round trip, not queueing; with none, the
cpu figure); and each job's start-up: how much longer than a round trip its first cpu node waited (the spec
reaching the CPU worker, imports there), added to that node in the prediction.

What a prediction reports is what `benchmarks/multiplex.py` measures: accelerator-seconds per step isolated
(each job alone on a service: its wall time from placement to end) and multiplexed (services x the makespan
from the first placement), their ratio, and each job's slowdown (multiplexed completion from the first
placement / isolated wall).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plexrl.planner import ORDERINGS, JobPlan, Planner, placement_policy
from plexrl.runtime.runner import Budgets, Runner
from plexrl.runtime.sim import SimExecutor, SimJob
from plexrl.sim.costs import _mix, fit_swap

MIN_SAMPLES = 30  # round trips observed before the prediction draws from them instead of using their median
FEW_SAMPLES = 10  # idle-service gaps needed before their median is trusted (else the cpu round trip is used)


@dataclass(slots=True)
class Fitted:
    """Costs fitted from one recorded run (see the module docstring)."""

    durations: dict[str, dict[int, dict[str, float]]]  # job -> iteration -> node -> seconds (recorded)
    load_seconds: dict[str, float]
    state_bytes: dict[str, int]
    swap_bandwidth: float  # bytes / s (inf when nothing was swapped)
    dispatch_cpu: float
    dispatch_service: float
    gaps: dict[str, int] = field(default_factory=dict)  # how many gaps each dispatch median was taken over
    startup: dict[str, tuple[int, str, float]] = field(default_factory=dict)  # job -> (iteration, node, extra s)
    cpu_gaps: list[float] = field(default_factory=list)  # observed round trips (the prediction draws from them)
    service_gaps: list[float] = field(default_factory=list)
    move_fixed_s: float = 0.0  # seconds each move pays besides its bytes (fitted from move records)
    fresh_moves: int = 0  # moves that made a buffer in the recorded run: the simulated run's first ones pay...
    fresh_bandwidth: float = float("inf")  # ...this rate (bytes / s): the first touch of the memory states need
    swap_from: str = "swap spans"  # what the swap model was fitted on

    def medians(self, job_id: str) -> dict[str, float]:
        per: dict[str, list[float]] = defaultdict(list)
        for nodes in self.durations[job_id].values():
            for node, sec in nodes.items():
                per[node].append(sec)
        return {node: statistics.median(v) for node, v in per.items()}


def _get(span: Any, name: str) -> Any:
    return span[name] if isinstance(span, Mapping) else getattr(span, name)


def fit(spans: Iterable[Any], plans: Mapping[str, JobPlan], moves: Iterable[Mapping[str, Any]] = ()) -> Fitted:
    """Fit from timeline spans (`hooks.timeline.Span` objects or their dicts from `timeline.json`) and, where
    given, the run's move records (`moves.json`; `ClusterResult.moves`) for the swap model."""
    rows = [
        {k: _get(s, k) for k in ("job", "iteration", "node", "lane", "start", "end", "kind", "nbytes")} for s in spans
    ]
    nodes = [r for r in rows if r["kind"] == "node" and r["job"] in plans]
    end_of: dict[tuple[str, int, str], float] = {(r["job"], r["iteration"], r["node"]): r["end"] for r in nodes}
    iter_end: dict[tuple[str, int], float] = {}
    for r in nodes:
        key = (r["job"], r["iteration"])
        iter_end[key] = max(iter_end.get(key, 0.0), r["end"])
    loads = {r["job"]: r for r in rows if r["kind"] == "load"}
    swaps = [r for r in rows if r["kind"] == "swap"]
    by_lane: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["kind"] in ("node", "swap", "load") and r["lane"] != "cpu":
            by_lane[r["lane"]].append(r)

    durations: dict[str, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    cpu_gaps, svc_gaps = [], []
    first_cpu: dict[
        str, tuple[float, int, str, float]
    ] = {}  # job -> (start, iteration, node, gap) of its first cpu node
    for r in nodes:
        job, it, name = r["job"], r["iteration"], r["node"]
        durations[job][it][name] = r["end"] - r["start"]
        plan = plans[job]
        deps = [d for d in plan.nodes[name].deps if (job, it, d) in end_of] if it >= 0 else []
        if deps:
            ready = max(end_of[job, it, d] for d in deps)
        elif (job, it - 1) in iter_end:
            ready = iter_end[job, it - 1]
        elif job in loads:
            ready = loads[job]["end"]
        else:
            continue
        gap = r["start"] - ready
        if gap < 0:
            continue
        if r["lane"] == "cpu":
            if job not in first_cpu or r["start"] < first_cpu[job][0]:
                first_cpu[job] = (r["start"], it, name, gap)
            cpu_gaps.append(gap)
            continue
        own_swap = 0.0
        busy = False
        for o in by_lane[r["lane"]]:
            if o is r or o["end"] <= ready or o["start"] >= r["start"]:
                continue
            if o["kind"] == "swap" and o["job"] == job:
                own_swap += o["end"] - o["start"]  # the node's own swap-in: part of its dispatch here, not a wait
            else:
                busy = True  # the service ran something else meanwhile: queueing, not a round trip
                break
        if not busy:
            svc_gaps.append(max(gap - own_swap, 0.0))
    dispatch_cpu = statistics.median(cpu_gaps) if cpu_gaps else 0.0
    # a job's first cpu node pays one-time costs (its spec reaching the CPU worker, imports there): beyond the
    # usual round trip, that is a start-up cost the prediction adds to the same node
    startup = {j: (it, name, max(gap - dispatch_cpu, 0.0)) for j, (_, it, name, gap) in first_cpu.items()}
    moved = sum(r["nbytes"] for r in swaps)
    seconds = sum(r["end"] - r["start"] for r in swaps)
    state = {j: r["nbytes"] for j, r in loads.items() if r["nbytes"]}  # measured when the job was loaded
    swap = _swap_model(moves, plans) or {  # without move records: the blocking swap spans
        "swap_bandwidth": moved / seconds if seconds > 0 and moved > 0 else float("inf")
    }
    return Fitted(
        durations={j: dict(v) for j, v in durations.items()},
        load_seconds={j: r["end"] - r["start"] for j, r in loads.items()},
        state_bytes={j: state.get(j, plans[j].state_bytes) for j in plans},
        **swap,
        dispatch_cpu=dispatch_cpu,
        dispatch_service=statistics.median(svc_gaps) if svc_gaps else dispatch_cpu,
        gaps={"cpu": len(cpu_gaps), "service": len(svc_gaps)},
        startup=startup,
        cpu_gaps=sorted(cpu_gaps),
        service_gaps=sorted(svc_gaps) or sorted(cpu_gaps),
    )


def _swap_model(moves: Iterable[Mapping[str, Any]], plans: Mapping[str, JobPlan]) -> dict[str, Any]:
    """`Fitted`'s swap fields from move records (none: {}). A move into a kept buffer costs its bytes at the
    fitted bandwidth plus a fixed cost (`fit_swap`: copy and wait seconds; its queueing the simulation makes
    itself); a move that made a buffer paid the first touch of that memory besides (on a CPU service a page
    fault per page; on CUDA a page-locked host buffer's registration): a run pays it once per buffer its states
    need, so the simulated run's first `fresh_moves` moves take their bytes at `fresh_bandwidth` instead."""
    recs = [m for m in moves if m["job"] in plans and m["nbytes"] > 0]
    kept = fit_swap([m for m in recs if not m["made"]])
    if not kept.moves:
        return {}
    made = [m for m in recs if m["made"]]
    fresh_s = sum(float(m["copy"]) + float(m["wait"]) for m in made)
    return {
        "swap_bandwidth": kept.bandwidth,
        "move_fixed_s": kept.fixed_s,
        "fresh_moves": len(made),
        "fresh_bandwidth": sum(m["nbytes"] for m in made) / fresh_s if fresh_s > 0 else float("inf"),
        "swap_from": f"move records: {kept.moves} moves into kept buffers, {len(made)} that made one",
    }


def swap_constants(records: Sequence[dict[str, Any]]) -> str:
    """What a run's move records (`moves.json`) say of the simulator's swap constants, as text: `fit_swap` over the
    moves into kept buffers (all, blocking, background), the first-touch rate of those that made a buffer, and the
    scenario's `host_gbps` / `switch_fixed_s` they stand for (docs/simulator.md)."""
    kept = [r for r in records if r["nbytes"] > 0 and not r["made"]]
    made = [r for r in records if r["nbytes"] > 0 and r["made"]]
    if not kept:
        return f"{len(records)} move records, none into a kept buffer: nothing to fit"
    lines = [f"{len(records)} move records: {len(kept)} into kept buffers, {len(made)} that made a buffer"]
    for label, bg in (("all", None), ("blocking", False), ("background", True)):
        f = fit_swap(kept, background=bg)
        if f.moves:
            lines.append(f"  {label:<10} {f.moves:4d} moves, {f.nbytes / 2**30:8.2f} GiB: "
                         f"{f.bandwidth / 1e9:7.2f} GB/s + {f.fixed_s * 1e3:.2f} ms a move")  # fmt: skip
    if made:
        secs = sum(float(r["copy"]) + float(r["wait"]) for r in made)
        nbytes = sum(r["nbytes"] for r in made)
        rate = nbytes / secs / 1e9 if secs > 0 else float("inf")
        lines.append(f"  made a buffer {len(made)} moves, {nbytes / 2**30:.2f} GiB in {secs:.2f} s: {rate:.2f} GB/s "
                     "(the first touch of that memory; once per buffer a run needs)")  # fmt: skip
    f = fit_swap(kept)
    lines.append(f"scenario constants (per accelerator): accelerator_set: {{host_gbps: {f.bandwidth / 1e9:.1f}}}; "
                 f"efficiency: {{switch_fixed_s: {f.fixed_s:.3f}}}")  # fmt: skip
    return "\n".join(lines)


def merge(fits: list[Fitted]) -> Fitted:
    """One `Fitted` from several recorded runs of disjoint jobs (e.g. each job recorded alone): their per-job
    figures side by side, the observed round trips pooled, the swap bandwidth the slowest seen."""
    cpu = sorted(g for f in fits for g in f.cpu_gaps)
    svc = sorted(g for f in fits for g in f.service_gaps)
    return Fitted(
        durations={j: d for f in fits for j, d in f.durations.items()},
        load_seconds={j: v for f in fits for j, v in f.load_seconds.items()},
        state_bytes={j: v for f in fits for j, v in f.state_bytes.items() if j in f.durations},
        swap_bandwidth=min((f.swap_bandwidth for f in fits), default=float("inf")),
        move_fixed_s=max((f.move_fixed_s for f in fits), default=0.0),
        fresh_moves=max((f.fresh_moves for f in fits), default=0),
        fresh_bandwidth=min((f.fresh_bandwidth for f in fits), default=float("inf")),
        swap_from="; ".join(sorted({f.swap_from for f in fits})),
        dispatch_cpu=statistics.median(cpu) if cpu else 0.0,
        dispatch_service=statistics.median(svc) if svc else 0.0,
        gaps={"cpu": len(cpu), "service": len(svc)},
        startup={j: v for f in fits for j, v in f.startup.items()},
        cpu_gaps=cpu,
        service_gaps=svc,
    )


@dataclass(slots=True)
class FittedCosts:
    """`SimCosts` from a `Fitted`: a simulated iteration of a job replays one recorded iteration's node
    durations (drawn by a seeded hash of (seed, job, iteration)); a node missing from the drawn iteration
    (it runs every k iterations) takes its median."""

    fitted: Fitted
    seed: int = 0
    _moves: int = 0  # moves simulated so far (the first `fitted.fresh_moves` pay the first touch)
    _iters: dict[str, list[int]] = field(default_factory=dict)
    _medians: dict[str, dict[str, float]] = field(default_factory=dict)

    def duration(self, job: SimJob, iteration: int, node: str) -> float:
        extra = self.fitted.startup.get(job.job_id)
        if extra is not None and extra[:2] == (iteration, node):
            return extra[2] + self._base(job, iteration, node)
        return self._base(job, iteration, node)

    def _base(self, job: SimJob, iteration: int, node: str) -> float:
        its = self._iters.get(job.job_id)
        if its is None:
            its = self._iters[job.job_id] = sorted(i for i in self.fitted.durations[job.job_id] if i >= 0)
            self._medians[job.job_id] = self.fitted.medians(job.job_id)
        rec = self.fitted.durations[job.job_id]
        if iteration < 0 and -1 in rec and node in rec[-1]:
            return rec[-1][node]
        pick = its[_mix((self.seed << 32) ^ (hash_job(job.job_id) + iteration)) % len(its)] if its else None
        if pick is not None and node in rec[pick]:
            return rec[pick][node]
        return self._medians[job.job_id].get(node, 0.0)

    def swap_seconds(self, nbytes: int) -> float:
        f = self.fitted
        self._moves += 1
        rate = f.fresh_bandwidth if self._moves <= f.fresh_moves else f.swap_bandwidth
        return nbytes / rate + (f.move_fixed_s if nbytes else 0.0)

    def load_seconds(self, job: SimJob, nbytes: int) -> float:
        return self.fitted.load_seconds.get(job.job_id, 0.0)


def hash_job(job_id: str) -> int:
    import zlib

    return zlib.crc32(job_id.encode())


@dataclass(slots=True)
class Prediction:
    """Isolated and multiplexed figures, as `benchmarks/multiplex.py` measures them."""

    iso_wall: dict[str, float]
    mux_completion: dict[str, float]
    steps: dict[str, int]
    services: int
    makespan: float

    @property
    def iso_cost_per_step(self) -> float:
        return sum(self.iso_wall.values()) / sum(self.steps.values())

    @property
    def mux_cost_per_step(self) -> float:
        return self.services * self.makespan / sum(self.steps.values())

    @property
    def ratio(self) -> float:
        return self.mux_cost_per_step / self.iso_cost_per_step

    def slowdowns(self) -> dict[str, float]:
        return {j: self.mux_completion[j] / self.iso_wall[j] for j in sorted(self.iso_wall)}


def predict(
    fitted: Fitted,
    plans: Mapping[str, JobPlan],
    *,
    services: int,
    placement: str,
    ordering: str,
    budgets: Budgets,
    max_load: float = 1.0,
    lookahead: bool = True,
    cpu_slots: int | None = None,
    seed: int = 0,
    empirical_dispatch: bool = True,
    isolated_fit: Fitted | None = None,
) -> Prediction:
    """Simulate the jobs isolated (each alone on one service) and multiplexed (on `services` services with the
    given policies and budgets), with costs from `fitted`. `empirical_dispatch`: draw each round trip from the
    observed ones (their long tail included) instead of using the medians, where at least `MIN_SAMPLES` were
    seen. `isolated_fit`: costs fitted from a recorded isolated run, for the isolated side (node times and
    round trips differ when a job has the machine to itself); default: `fitted` for both."""

    def dispatch_of(f: Fitted) -> tuple[Any, Any]:
        # a handful of samples (a multiplexed run has few idle-service gaps) is no distribution: use the median
        def pick(samples: list[float], median: float) -> Any:
            return samples if empirical_dispatch and len(samples) >= MIN_SAMPLES else median

        # under FEW_SAMPLES idle-service gaps say nothing; a service node's round trip is the same trip through
        # the scheduler and the runner as a cpu node's: use that
        service = f.dispatch_service if f.gaps.get("service", 0) >= FEW_SAMPLES else f.dispatch_cpu
        return pick(f.cpu_gaps, f.dispatch_cpu), pick(f.service_gaps, service)

    def jobs(ids: Iterable[str], f: Fitted) -> list[SimJob]:
        out = []
        for j in ids:
            plan = plans[j]
            out.append(
                SimJob(j, plan.nodes, plan.iterations, f.medians(j), plan.order, plan.baseline, f.state_bytes[j])
            )
        return out

    def runner(n: int, place: str, f: Fitted) -> tuple[Runner, SimExecutor]:
        ex = SimExecutor(n, FittedCosts(f, seed), cpu_slots=cpu_slots, dispatch=dispatch_of(f), seed=seed)
        planner = Planner(clock=ex.clock, placement=placement_policy(place, max_load), ordering=ORDERINGS[ordering](),
                          lookahead=lookahead)  # fmt: skip
        r = Runner(ex, planner, budgets=budgets)
        return r, ex

    iso: dict[str, float] = {}
    steps: dict[str, int] = {}
    alone = isolated_fit or fitted
    for j in sorted(plans):
        r, _ = runner(1, "isolated", alone)
        (run,) = r.run(jobs([j], alone))
        if run.status != "done":
            raise RuntimeError(f"simulated isolated run of {j} did not finish: {run.error}")
        iso[j] = (run.finished_at or 0.0) - (run.started_at or 0.0)
        steps[j] = run.iterations_done
    r, _ = runner(services, placement, fitted)
    runs = r.run(jobs(sorted(plans), fitted))
    bad = [(x.job_id, x.error) for x in runs if x.status != "done"]
    if bad:
        raise RuntimeError(f"simulated multiplexed run: jobs did not finish: {bad}")
    first = min(x.started_at or 0.0 for x in runs)
    completion = {x.job_id: (x.finished_at or 0.0) - first for x in runs}
    return Prediction(iso, completion, steps, services, max(completion.values()))
