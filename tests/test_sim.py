"""`SimExecutor`: the real `Runner` and planner on a virtual clock. Deterministic, no sleeping, no torch."""

from __future__ import annotations

import importlib.util
import itertools
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from plexrl.accounting import JobFacts, account
from plexrl.hooks.timeline import Span, TimelineRecorder
from plexrl.planner import Move, NodePlan, Planner
from plexrl.runtime.executor import LoadReport, NodeReport, NodeTask
from plexrl.runtime.runner import Budgets, Runner
from plexrl.runtime.sim import GB, SeededCosts, SimExecutor, SimJob, grpo_like_jobs

ROOT = Path(__file__).resolve().parents[1]

# a[service] -> b[cpu] -> c[service]; durations are powers of two, so virtual times add up exactly
CHAIN = {"a": NodePlan("service"), "b": NodePlan("cpu", ("a",)), "c": NodePlan("service", ("b",))}
MEANS = {"a": 0.5, "b": 0.25, "c": 1.0}
EXACT = SeededCosts(jitter=0.0, swap_bandwidth=GB, load_bandwidth=GB)  # 1 GB moves or loads in 1 s


def chain_job(name: str, iterations: int = 3, state: int = GB) -> SimJob:
    return SimJob(name, CHAIN, iterations, MEANS, ("a", "b", "c"), state_bytes=state)


def service_spans(spans: list[Span]) -> dict[str, list[Span]]:
    lanes: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.lane != "cpu":
            lanes[s.lane].append(s)
    return lanes


def test_one_job_alone_takes_its_load_plus_its_chain_exactly() -> None:
    ex = SimExecutor(1, EXACT)
    runner = Runner(ex, Planner(clock=ex.clock, validate=True))
    [run] = runner.run([chain_job("solo", iterations=3, state=2 * GB)])
    assert run.status == "done" and run.iterations_done == 3
    assert ex.clock() == run.finished_at == 2.0 + 3 * (0.5 + 0.25 + 1.0)  # load 2 GB at 1 GB/s, then the chain
    assert [row["time/c"] for row in run.history] == [1.0, 1.0, 1.0]
    assert runner.service_reports["service-0"]["moves"] == 0


def test_many_jobs_finish_every_iteration_and_runs_are_deterministic() -> None:
    def once() -> tuple[float, list[tuple[str, str, int, str | None]]]:
        jobs = grpo_like_jobs(8, (2, 4), seed=3)
        ex = SimExecutor(3, SeededCosts(seed=3), cpu_slots=4)
        runs = Runner(ex, Planner(clock=ex.clock, lookahead=True, validate=True), budgets=Budgets(device=6 * GB)).run(
            jobs
        )
        for job, run in zip(jobs, runs, strict=True):
            assert run.status == "done", run.error
            assert run.iterations_done == job.iterations
            assert len(run.history) == job.iterations + (1 if job.baseline else 0)
        return ex.clock(), [(r.job_id, r.status, r.iterations_done, r.service) for r in runs]

    assert once() == once()


def test_a_service_runs_one_thing_at_a_time_and_cpu_slots_bound_the_pool(tmp_path: Path) -> None:
    timeline = TimelineRecorder(tmp_path, draw=False)
    ex = SimExecutor(2, SeededCosts(seed=1), cpu_slots=2)
    runner = Runner(
        ex, Planner(clock=ex.clock, lookahead=True, validate=True), hooks=[timeline], budgets=Budgets(device=6 * GB)
    )
    runs = runner.run(grpo_like_jobs(6, (3, 5), seed=1))
    assert all(r.status == "done" for r in runs)
    assert runner.planner.counts()["sent_ahead"] > 0  # nodes were sent to busy services
    lanes = service_spans(timeline.spans)
    assert {s.kind for spans in lanes.values() for s in spans} == {"node", "swap", "load"}
    for lane, spans in lanes.items():  # nodes, swaps and loads of one service never overlap
        spans.sort(key=lambda s: (s.start, s.end))
        for prev, nxt in itertools.pairwise(spans):
            assert nxt.start >= prev.end, f"{lane}: {prev} overlaps {nxt}"
    cpu = sorted((t, d) for s in timeline.spans if s.lane == "cpu" for t, d in ((s.start, 1), (s.end, -1)))
    running = peak = 0
    for _, d in cpu:  # ends sort before starts at the same instant
        running += d
        peak = max(peak, running)
    assert peak == 2


def test_swaps_are_charged_and_the_accounting_adds_up(tmp_path: Path) -> None:
    timeline = TimelineRecorder(tmp_path, draw=False)
    ex = SimExecutor(1, EXACT)
    runner = Runner(
        ex, Planner(clock=ex.clock, validate=True), hooks=[timeline], budgets=Budgets(device=GB)
    )  # holds one state
    runs = runner.run([chain_job("x"), chain_job("y")])
    assert all(r.status == "done" and r.iterations_done == 3 for r in runs)
    rep = runner.service_reports["service-0"]
    assert rep["moves"] > 0 and rep["blocking_swap_seconds"] == rep["bytes_moved"] / GB
    wall = ex.clock()
    facts = [
        JobFacts(r.job_id, r.service, r.iterations_done, r.started_at or 0.0, r.finished_at or wall, r.status)
        for r in runs
    ]
    report = account(timeline.spans, facts, ["service-0"], wall)
    [svc] = report.services
    assert svc.busy == 2 * 3 * (0.5 + 1.0)  # the service nodes of both jobs
    assert svc.swap == rep["blocking_swap_seconds"] > 0  # the swaps; the two 1 s loads are start-up
    assert svc.startup == 2.0
    assert svc.busy + svc.swap + svc.startup <= wall  # so idle is not clamped
    assert svc.busy + svc.swap + svc.startup + svc.idle == pytest.approx(svc.allocated)
    assert sum(j.allocated for j in report.jobs) == pytest.approx(svc.allocated)
    assert all(j.swap > 0 for j in report.jobs)


def test_a_lost_service_fails_only_its_jobs(tmp_path: Path) -> None:
    timeline = TimelineRecorder(tmp_path, draw=False)
    ex = SimExecutor(2, EXACT, failures={"service-0": 3.0})
    runner = Runner(ex, Planner(clock=ex.clock, validate=True), hooks=[timeline])
    runs = runner.run([chain_job(f"j{i}", iterations=4) for i in range(4)])
    lost = [r for r in runs if r.service == "service-0"]
    kept = [r for r in runs if r.service == "service-1"]
    assert lost and kept
    for r in lost:
        assert r.status == "failed" and "service-0" in r.error and "lost" in r.error
        assert r.iterations_done < 4
    assert all(r.status == "done" and r.iterations_done == 4 for r in kept)
    assert max(s.end for s in service_spans(timeline.spans)["service-0"]) <= 3.0  # dropped work never reported
    assert runner.service_reports["service-0"]["alive"] is False
    assert ex.lost() == []  # reported once


def test_executor_timings_of_swaps_prefetch_and_cpu_slots() -> None:
    ex = SimExecutor(1, SeededCosts(jitter=0.0, swap_bandwidth=GB, load_bandwidth=None), cpu_slots=1)
    a, b = SimJob("A", CHAIN, 1, {"a": 2.0, "b": 1.0, "c": 1.0}), SimJob("B", CHAIN, 1, MEANS)
    ex.ship(a)
    ex.ship(b)
    la, lb = ex.load("A", "service-0", "device"), ex.load("B", "service-0", "host")
    assert [f.handle for f in ex.wait(1.0)] == [la, lb] and ex.clock() == 0.0
    # A runs 0..2 and prefetches B (4 GB: lands at 4); B, sent ahead, waits for it: swap 2..4, runs 4..4.5
    h1 = ex.submit(NodeTask("A", 0, "a", "service-0", prefetch=(Move("B", "host", "device", 4 * GB),)))
    h2 = ex.submit(NodeTask("B", 0, "a", "service-0"))
    c1, c2 = ex.submit(NodeTask("A", 0, "b", None)), ex.submit(NodeTask("B", 0, "b", None))  # one slot: 0..1, 1..1.25
    # evicting B (4 s) before A's next node: swap 4.5..8.5, with B's measured size
    h3 = ex.submit(NodeTask("A", 0, "c", "service-0", swaps=(Move("B", "device", "host", 4 * GB),)))
    # a move from the wrong tier fails the node, as the real service does
    h4 = ex.submit(NodeTask("A", 0, "c", "service-0", swaps=(Move("B", "device", "disk", 4 * GB),)))
    got = {}
    while len(got) < 6:
        for f in ex.wait(1.0):
            got[f.handle] = (ex.clock(), f.report)
    assert all(isinstance(r, NodeReport) for _, r in got.values())
    assert [(t, r.start, r.end) for t, r in (got[c1], got[c2])] == [(1.0, 0.0, 1.0), (1.25, 1.0, 1.25)]
    r1, r2, r3, r4 = (got[h][1] for h in (h1, h2, h3, h4))
    assert (r1.start, r1.end, r1.swap_end - r1.swap_start) == (0.0, 2.0, 0.0)
    assert (r2.swap_start, r2.swap_end, r2.start, r2.end, r2.swap_bytes) == (2.0, 4.0, 4.0, 4.5, 0)
    assert (r3.swap_start, r3.swap_end, r3.end, r3.swap_bytes, r3.measured) == (4.5, 8.5, 9.5, 4 * GB, {"B": 4 * GB})
    assert r4.error is not None and r4.error.startswith("swap failed") and r4.end == 9.5
    rep = ex.close()["service-0"]
    assert (rep["prefetch_seconds"], rep["prefetch_wait_seconds"], rep["moves"]) == (4.0, 2.0, 2)


def test_blocking_swaps_wait_for_the_prefetch_queued_before_them() -> None:
    """As on the real service (`BackgroundMoves.wait_all`): a node's own swaps start only once every
    prefetch queued before them has landed, even a prefetch of another job (no tier over budget)."""
    ex = SimExecutor(1, SeededCosts(jitter=0.0, swap_bandwidth=GB, load_bandwidth=None))
    for name, means in (("A", {"a": 1.0, "b": 1.0, "c": 1.0}), ("B", MEANS), ("C", MEANS)):
        ex.ship(SimJob(name, CHAIN, 1, means))
    ex.load("A", "service-0", "device"), ex.load("B", "service-0", "device"), ex.load("C", "service-0", "host")
    ex.wait(1.0)
    # A runs 0..1 and evicts B in the background (4 GB: 0..4); A's next node swaps C in (1 GB) only after it
    ex.submit(NodeTask("A", 0, "a", "service-0", prefetch=(Move("B", "device", "host", 4 * GB),)))
    h = ex.submit(NodeTask("A", 0, "b", "service-0", swaps=(Move("C", "host", "device", GB),)))
    got = {}
    while h not in got:
        got.update({f.handle: f.report for f in ex.wait(10.0)})
    r = got[h]
    assert (r.swap_start, r.swap_end, r.start, r.end) == (1.0, 5.0, 5.0, 6.0)
    assert ex.close()["service-0"]["prefetch_wait_seconds"] == 3.0


def test_loads_occupy_their_service_and_lost_work_is_dropped() -> None:
    ex = SimExecutor(2, EXACT, failures={"service-1": 1.5})
    for name in ("A", "B"):
        ex.ship(chain_job(name))
    ex.load("A", "service-0", "device")
    ex.load("B", "service-1", "device")
    hb = ex.submit(NodeTask("B", 0, "a", "service-1"))  # after the 1 s load: 1.0..1.5, ends at the failure: kept
    ex.submit(NodeTask("B", 0, "c", "service-1"))  # 1.5..2.5: lost with its service, never returned
    assert ex.wait(0.25) == [] and ex.clock() == 0.25  # a finite timeout moves the clock only that far
    first = ex.wait(math.inf)
    assert ex.clock() == 1.0 and [type(f.report) for f in first] == [LoadReport, LoadReport]
    assert [f.handle for f in ex.wait(math.inf)] == [hb] and ex.clock() == 1.5
    assert ex.wait(math.inf) == [] and ex.lost() == [("service-1", "simulated failure at t=1.5")]
    assert ex.wait(2.0) == [] and ex.clock() == 3.5  # nothing in flight: a finite wait just passes time
    with pytest.raises(RuntimeError, match="nothing is in flight"):
        ex.wait(math.inf)


def test_the_simulator_imports_no_torch_and_no_dask() -> None:
    code = "import sys, plexrl.runtime.sim; bad = {'torch', 'distributed'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_benchmark_smoke_prints_dispatch_rates(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("bench_planner", ROOT / "benchmarks/planner.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    module.main(["--smoke"])
    out = capsys.readouterr().out
    assert "dispatches/s" in out and "spread/fifo validate" in out
    assert "worst validate=False:" in out and "service dispatches/s" in out
