"""Same accounting before and after a refactor: seeded SimExecutor runs (no retries, no checkpoints) through
the one `Runner` and planner, compared with a golden file of their accounting summaries.

Each case runs `grpo_like_jobs` on a virtual clock and records, per run: the clock at the end, the events the
planner handled, every job's status, service, iterations, placement and end times and the per-metric sums of
its history rows, the simulated services' reports (busy, blocking swap, prefetch, bytes moved, ...) and the
cluster accounting (`plexrl.accounting.account` over the timeline: busy / swap / idle per service, allocated
accelerator-seconds and cost per step per job). The cases cross every placement with every ordering, with
and without lookahead, on 1 or 2 services, and add late arrivals, a lost service, chunked rollouts and a
driver round trip.

A change that moves any of these (a different decision, one more swap, an event more) fails the test with
the first difference. When the change is MEANT to alter the schedule, regenerate the file and review its diff:

    .venv/bin/python tests/test_sim_golden.py --write
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from plexrl.accounting import JobFacts, account
from plexrl.hooks.timeline import TimelineRecorder
from plexrl.planner import Planner
from plexrl.planner.events import NodePlan
from plexrl.planner.placement import PLACEMENTS, placement_policy
from plexrl.planner.policies import ORDERINGS
from plexrl.runtime.runner import Budgets, Runner
from plexrl.runtime.sim import GB, SeededCosts, SimExecutor, SimJob, grpo_like_jobs

GOLDEN = Path(__file__).parent / "data" / "sim_accounting.json"
ORDERS = ("fifo", "hrrs", "hrrs-classic", "slowdown")
REL = 1e-9  # floats agree to this relative precision (a libm's last bit may differ across machines)


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    services: int
    ordering: str
    placement: str
    lookahead: bool
    arrivals: bool = False  # jobs arrive 0.5 s apart
    failure: float | None = None  # service-0 is lost at this virtual time
    chunks: int = 1  # rollouts run as this many chunks
    dispatch: float = 0.0  # seconds from submit until a node starts (a real driver's round trip)

    @property
    def name(self) -> str:
        extra = "/arrivals" if self.arrivals else ""
        extra += f"/lost@{self.failure:g}" if self.failure else ""
        extra += f"/chunks{self.chunks}" if self.chunks > 1 else ""
        extra += f"/rtt{self.dispatch:g}" if self.dispatch else ""
        return f"s{self.seed}/{self.services}svc/{self.ordering}/{self.placement}/look{int(self.lookahead)}{extra}"


def cases() -> list[Case]:
    """Every placement x ordering once (seeds, services and lookahead vary along them), then the extras."""
    out = []
    for i, (placement, ordering) in enumerate((p, o) for p in PLACEMENTS for o in ORDERS):
        out.append(Case(i % 3, 1 + i % 2, ordering, placement, bool((i // 2) % 2)))
    out += [
        Case(1, 2, "hrrs", "spread", True, arrivals=True),
        Case(2, 2, "fifo", "pack", False, failure=2.0),
        Case(0, 1, "slowdown", "spread+backfill", True, chunks=3),
        Case(1, 2, "hrrs", "spread+backfill", True, dispatch=0.003),
    ]
    return out


def jobs_of(case: Case) -> list[SimJob]:
    jobs = grpo_like_jobs(5, (3, 12), case.seed)
    if case.chunks > 1:
        jobs = [dataclasses.replace(j, nodes=_chunked(j.nodes, case.chunks)) for j in jobs]
    return jobs


def _chunked(nodes: Any, chunks: int) -> dict[str, NodePlan]:
    return {n: dataclasses.replace(p, chunks=chunks) if n == "rollout" else p for n, p in nodes.items()}


def summary(case: Case, tmp: Path) -> dict[str, Any]:
    """One case's accounting summary (plain JSON values)."""
    failures = {"service-0": case.failure} if case.failure is not None else None
    ex = SimExecutor(case.services, SeededCosts(seed=case.seed), cpu_slots=2, seed=case.seed, failures=failures,
                     dispatch=(case.dispatch, case.dispatch))  # fmt: skip
    timeline = TimelineRecorder(tmp / case.name.replace("/", "_"), draw=False)
    planner = Planner(clock=ex.clock, placement=placement_policy(case.placement), ordering=ORDERINGS[case.ordering](),
                      lookahead=case.lookahead, validate=True)  # fmt: skip
    runner = Runner(ex, planner, hooks=[timeline], budgets=Budgets(device=8 * GB))
    specs = jobs_of(case)
    arrivals = {s.job_id: 0.5 * k for k, s in enumerate(specs)} if case.arrivals else None
    runs = runner.run(specs, arrivals)
    t0 = timeline.t0 or 0.0
    end = ex.clock()
    facts = [
        JobFacts(
            r.job_id, r.service, r.iterations_done, (r.started_at or t0) - t0, (r.finished_at or end) - t0, r.status
        )
        for r in runs
    ]
    report = account(timeline.spans, facts, sorted(runner.services), end - t0)
    jobs = []
    for r in runs:
        sums: dict[str, float] = {}
        for row in r.history:
            for key, value in row.items():
                sums[key] = sums.get(key, 0.0) + value
        jobs.append({
            "job": r.job_id, "status": r.status, "error": r.error, "service": r.service,
            "iterations": r.iterations_done, "rows": len(r.history), "started": r.started_at,
            "finished": r.finished_at, "history_sums": dict(sorted(sums.items())),
        })  # fmt: skip
    return {
        "clock": end,
        "events": runner.events_handled,
        "sent_ahead": runner.planner.sent_ahead,
        "jobs": jobs,
        "services": runner.service_reports,
        "accounting": report.as_dict(),
    }


def first_difference(want: Any, got: Any, where: str = "") -> str | None:
    """Where two summaries differ (None: they agree; floats to `REL`)."""
    if isinstance(want, dict) and isinstance(got, dict):
        if sorted(want) != sorted(got):
            return f"{where}: keys {sorted(want)} != {sorted(got)}"
        for k in want:
            d = first_difference(want[k], got[k], f"{where}.{k}")
            if d is not None:
                return d
        return None
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return f"{where}: {len(want)} items != {len(got)}"
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            d = first_difference(w, g, f"{where}[{i}]")
            if d is not None:
                return d
        return None
    if isinstance(want, float) or isinstance(got, float):
        numbers = isinstance(want, int | float) and isinstance(got, int | float)
        # (nan: the cost per step of a job that failed before its first step)
        if numbers and (math.isclose(want, got, rel_tol=REL, abs_tol=1e-12) or (math.isnan(want) and math.isnan(got))):
            return None
        return f"{where}: golden {want!r}, now {got!r}"
    return None if want == got else f"{where}: golden {want!r}, now {got!r}"


def compute(tmp: Path) -> dict[str, Any]:
    return {c.name: json.loads(json.dumps(summary(c, tmp))) for c in cases()}


def test_simulated_accounting_matches_the_golden_file(tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    now = compute(tmp_path)
    assert sorted(now) == sorted(golden), "the cases changed; regenerate the golden file (the module says how)"
    for name in golden:
        diff = first_difference(golden[name], now[name], name)
        assert diff is None, (
            f"simulated accounting changed at {diff}. If the change is meant, regenerate the golden file with "
            "`.venv/bin/python tests/test_sim_golden.py --write` and review its diff"
        )


def test_the_comparison_sees_a_changed_schedule(tmp_path: Path) -> None:
    """The check can fail: one case under another placement, and a change of a float beyond `REL`."""
    (case,) = [c for c in cases() if c.name.startswith("s1/2svc/hrrs/spread/look1/arrivals")]
    base = json.loads(json.dumps(summary(case, tmp_path)))
    other = json.loads(json.dumps(summary(dataclasses.replace(case, placement="isolated"), tmp_path)))
    assert first_difference(base, other) is not None
    nudged = json.loads(json.dumps(base))
    nudged["clock"] *= 1 + 1e-6
    assert first_difference(base, nudged) == f".clock: golden {base['clock']!r}, now {nudged['clock']!r}"
    nudged["clock"] = base["clock"] * (1 + 1e-13)
    assert first_difference(base, nudged) is None


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: {sys.argv[0]} --write   (regenerates {GOLDEN})")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        data = compute(Path(tmp))
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(data)} cases to {GOLDEN}")
