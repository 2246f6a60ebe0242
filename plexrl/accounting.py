"""The accounting PlexRL is judged on (docs/architecture.md, "Accounting"), computed from timeline spans. Pure.

Per service: wall time allocated (the whole run), split into four disjoint buckets:
- `busy`: running a node (span kind `node`);
- `swap`: moving a job's state between tiers, the blocking part (span kind `swap`);
- `startup`: building a job's engine on its service and placing its first state there (span kind `load`:
  the torch engine, and for vLLM rollouts the vLLM import and engine start when it is the first job of its
  architecture on the service). A one-off cost of starting, not a state move;
- `idle`: the rest (never negative).
Weight loads into a generation engine (span kind `weights`: a weight sync after `train`, or another job's
weights into a shared vLLM engine) happen inside a rollout node's span: they are part of that node's `busy`
time and are NOT added again; `weights` reports how much of `busy` they took (a breakdown, not a bucket).

Per job: allocated accelerator-seconds = its own busy, swap and startup seconds on its service plus a share of
that service's idle time proportional to how long the job was placed there (so the jobs' allocations add up
to the services' time when every service held a job); steps; cost per step = allocated / steps; completion
time (submission to end). Spans on the `cpu` lane (the CPU pool) cost no accelerator time."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Protocol


class SpanLike(Protocol):
    job: str
    lane: str
    start: float
    end: float
    kind: str


@dataclass(frozen=True, slots=True)
class JobFacts:
    job_id: str
    service: str | None
    steps: int
    placed: float  # seconds since the run started
    finished: float
    status: str


@dataclass(frozen=True, slots=True)
class ServiceUsage:
    service: str
    allocated: float
    busy: float
    swap: float
    idle: float
    startup: float = 0.0  # building engines and placing first states (span kind `load`)
    weights: float = 0.0  # the part of `busy` spent loading weights into a generation engine

    @property
    def utilization(self) -> float:
        return self.busy / self.allocated if self.allocated > 0 else 0.0


@dataclass(frozen=True, slots=True)
class JobUsage:
    job_id: str
    service: str | None
    status: str
    steps: int
    busy: float
    swap: float
    allocated: float
    completion: float
    startup: float = 0.0

    @property
    def cost_per_step(self) -> float:
        return self.allocated / self.steps if self.steps else float("nan")


@dataclass(frozen=True, slots=True)
class ClusterReport:
    wall: float
    services: list[ServiceUsage]
    jobs: list[JobUsage]

    @property
    def accelerator_seconds(self) -> float:
        return sum(s.allocated for s in self.services)

    @property
    def steps(self) -> int:
        return sum(j.steps for j in self.jobs)

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall": self.wall,
            "accelerator_seconds": self.accelerator_seconds,
            "steps": self.steps,
            "services": [_row(s) for s in self.services],
            "jobs": [_row(j) | {"cost_per_step": j.cost_per_step} for j in self.jobs],
        }


def _row(obj: Any) -> dict[str, Any]:
    out = {name: getattr(obj, name) for name in obj.__slots__}
    if isinstance(obj, ServiceUsage):
        out["utilization"] = obj.utilization
    return out


def _inside_nodes(spans: list[Any]) -> list[bool]:
    """For each `weights` span (in order), whether it lies within a node span of its job on its lane."""
    nodes: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in spans:
        if s.kind == "node":
            nodes.setdefault((s.lane, s.job), []).append((s.start, s.end))
    for intervals in nodes.values():
        intervals.sort()
    out = []
    for s in spans:
        if s.kind != "weights":
            continue
        intervals = nodes.get((s.lane, s.job), [])
        i = bisect.bisect_right(intervals, (s.start, float("inf"))) - 1  # the last node starting at or before
        out.append(i >= 0 and intervals[i][0] <= s.start and s.end <= intervals[i][1])
    return out


def account(spans: list[Any], jobs: list[JobFacts], services: list[str], wall: float) -> ClusterReport:
    """`spans`: node, swap, load and weights spans (times since the run started); `wall`: the run's length.

    Contract: for every service, busy + swap + startup + idle == allocated (== wall) unless the spans
    overlap by more than the wall (then idle is 0); a weights span inside a node span of its job adds nothing
    to busy (it is already in the node's time) and is reported in `weights`; one outside every node span
    counts as busy (the service was loading weights for that job)."""
    buckets: dict[str, dict[tuple[str, str], float]] = {"busy": {}, "swap": {}, "startup": {}, "weights": {}}
    inside = iter(_inside_nodes(spans))
    for s in spans:
        if s.lane == "cpu":
            continue
        if s.kind == "weights":
            names = ["weights"] if next(inside) else ["weights", "busy"]
        else:
            names = [{"swap": "swap", "load": "startup"}.get(s.kind, "busy")]
        for name in names:
            table = buckets[name]
            table[(s.lane, s.job)] = table.get((s.lane, s.job), 0.0) + (s.end - s.start)

    def total(name: str, sid: str) -> float:
        return sum(v for (lane, _), v in buckets[name].items() if lane == sid)

    usage = []
    for sid in services:
        b, w, st = total("busy", sid), total("swap", sid), total("startup", sid)
        usage.append(ServiceUsage(sid, wall, b, w, max(wall - b - w - st, 0.0), st, total("weights", sid)))
    idle = {u.service: u.idle for u in usage}
    residence: dict[str, float] = {}
    for j in jobs:
        if j.service is not None:
            residence[j.service] = residence.get(j.service, 0.0) + max(j.finished - j.placed, 0.0)
    out = []
    for j in jobs:
        if j.service is None:
            out.append(JobUsage(j.job_id, None, j.status, j.steps, 0.0, 0.0, 0.0, j.finished))
            continue
        key = (j.service, j.job_id)
        b, w, st = (buckets[name].get(key, 0.0) for name in ("busy", "swap", "startup"))
        share = max(j.finished - j.placed, 0.0) / residence[j.service] if residence[j.service] > 0 else 0.0
        allocated = b + w + st + share * idle.get(j.service, 0.0)
        out.append(JobUsage(j.job_id, j.service, j.status, j.steps, b, w, allocated, j.finished, st))
    return ClusterReport(wall, usage, out)


def format_report(report: ClusterReport) -> str:
    lines = [f"cluster: {len(report.services)} services, wall {report.wall:.1f}s, "
             f"{report.accelerator_seconds:.1f} accelerator-seconds, {report.steps} steps"]  # fmt: skip
    lines.append(f"{'service':<12}{'busy s':>9}{'swap s':>9}{'startup s':>11}{'idle s':>9}{'util':>7}"
                 f"{'weight loads s':>16}")  # fmt: skip
    for s in report.services:
        lines.append(f"{s.service:<12}{s.busy:>9.1f}{s.swap:>9.2f}{s.startup:>11.2f}{s.idle:>9.1f}"
                     f"{s.utilization:>7.0%}{s.weights:>16.2f}")  # fmt: skip
    lines.append(
        f"{'job':<22}{'service':<12}{'status':<10}{'steps':>6}{'acc-s':>9}{'acc-s/step':>11}{'completion s':>14}"
    )
    for j in report.jobs:
        lines.append(
            f"{j.job_id:<22}{(j.service or '-'):<12}{j.status:<10}{j.steps:>6}{j.allocated:>9.1f}"
            f"{j.cost_per_step:>11.3f}{j.completion:>14.1f}"
        )
    return "\n".join(lines)


# -- physical bounds of a multiplexed run, from each job's figures alone -------------------------------------
def cost_bound(busy: list[float], steps: list[int]) -> float:
    """The least accelerator-seconds per step any schedule of these jobs can reach: the service time the jobs'
    nodes need (`busy[i]` seconds for job i, measured alone) spread over their steps, on fully busy services.
    It ignores swaps, start-up and a node running slower beside other work (all of which only raise the cost).

    >>> round(cost_bound([18.2, 20.4, 20.5], [40, 40, 40]), 4)
    0.4925
    """
    return sum(busy) / max(sum(steps), 1)


def slowdown_bound(busy: list[float], alone: list[float]) -> float:
    """The smallest slowdown s for which a schedule of these jobs on ONE service can finish every job i by
    s * alone[i]: earliest-deadline-first feasibility of the service demands `busy[i]` (all jobs start at 0):
    for the jobs sorted by deadline, the demand of the first k must fit before the k-th deadline, and no job
    finishes before its own time alone (s >= 1). What it ignores: that a job's service work comes in nodes
    between its CPU gaps (it cannot all run early), swaps, and a node running slower beside other work; so it
    is a lower bound, not a promise.

    >>> round(slowdown_bound([18.2, 20.4, 20.5], [18.6, 40.9, 53.0]), 3)
    1.115
    >>> slowdown_bound([1.0, 1.0], [10.0, 10.0])
    1.0
    """
    s, total = 1.0, 0.0
    for need, deadline in sorted(zip(busy, alone, strict=True), key=lambda p: p[1]):
        total += need
        s = max(s, total / deadline)
    return s
