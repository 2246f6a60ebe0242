"""The accounting PlexRL is judged on (DESIGN.md), computed from timeline spans. Pure.

Per service: wall time allocated (the whole run), split into `busy` (running a node), `swap` (moving state,
blocking part, and a job's first load on its service) and `idle`; weight loads into a generation engine happen
inside a node's span and count once, as that node's busy time. Per job: allocated accelerator-seconds = its
own busy and swap seconds on its service plus a share of that service's idle time proportional to how long the
job was placed there (so the jobs' allocations add up to the services' time when every service held a job);
steps; cost per step = allocated / steps; completion time (submission to end)."""

from __future__ import annotations

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


def account(spans: list[Any], jobs: list[JobFacts], services: list[str], wall: float) -> ClusterReport:
    """`spans`: node and swap spans (times since the run started); `wall`: the run's length."""
    busy: dict[tuple[str, str], float] = {}
    swap: dict[tuple[str, str], float] = {}
    for s in spans:
        if s.lane == "cpu" or s.kind == "weights":
            continue  # weight loads lie inside their node's span: counted there once
        table = swap if s.kind in ("swap", "load") else busy
        table[(s.lane, s.job)] = table.get((s.lane, s.job), 0.0) + (s.end - s.start)
    usage = []
    for sid in services:
        b = sum(v for (lane, _), v in busy.items() if lane == sid)
        w = sum(v for (lane, _), v in swap.items() if lane == sid)
        usage.append(ServiceUsage(sid, wall, b, w, max(wall - b - w, 0.0)))
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
        b, w = busy.get((j.service, j.job_id), 0.0), swap.get((j.service, j.job_id), 0.0)
        share = max(j.finished - j.placed, 0.0) / residence[j.service] if residence[j.service] > 0 else 0.0
        out.append(
            JobUsage(j.job_id, j.service, j.status, j.steps, b, w, b + w + share * idle.get(j.service, 0.0), j.finished)
        )
    return ClusterReport(wall, usage, out)


def format_report(report: ClusterReport) -> str:
    lines = [f"cluster: {len(report.services)} services, wall {report.wall:.1f}s, "
             f"{report.accelerator_seconds:.1f} accelerator-seconds, {report.steps} steps"]  # fmt: skip
    lines.append(f"{'service':<12}{'busy s':>9}{'swap s':>9}{'idle s':>9}{'util':>7}")
    for s in report.services:
        lines.append(f"{s.service:<12}{s.busy:>9.1f}{s.swap:>9.2f}{s.idle:>9.1f}{s.utilization:>7.0%}")
    lines.append(
        f"{'job':<22}{'service':<12}{'status':<10}{'steps':>6}{'acc-s':>9}{'acc-s/step':>11}{'completion s':>14}"
    )
    for j in report.jobs:
        lines.append(
            f"{j.job_id:<22}{(j.service or '-'):<12}{j.status:<10}{j.steps:>6}{j.allocated:>9.1f}"
            f"{j.cost_per_step:>11.3f}{j.completion:>14.1f}"
        )
    return "\n".join(lines)
