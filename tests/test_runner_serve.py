"""`Runner.submit`, `Runner.stop` and `run(until_stopped=True)` on the simulator (virtual clock, no sleeps):
jobs arrive while the loop runs, from a hook (deterministic) and from another thread; stop closes what is open."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from plexrl.hooks.base import Hook, RunSummary
from plexrl.job.spec import JobRun
from plexrl.planner import Planner
from plexrl.planner.placement import placement_policy
from plexrl.runtime.runner import Runner
from plexrl.runtime.sim import SeededCosts, SimExecutor, grpo_like_jobs


def _jobs(n: int, seed: int = 0) -> list[Any]:
    return grpo_like_jobs(n, (3, 5), seed)


class Record(Hook):
    def __init__(self) -> None:
        self.ended: list[tuple[str, str]] = []
        self.summary: RunSummary | None = None

    def on_job_end(self, run: JobRun) -> None:
        self.ended.append((run.job_id, run.status))

    def on_end(self, summary: RunSummary) -> None:
        self.summary = summary


def test_submit_from_a_hook_then_stop_when_idle() -> None:
    """Job B is submitted when A ends; the loop keeps waiting after B ends until stopped from a hook."""
    a, b = _jobs(2)
    rec = Record()
    ex = SimExecutor(1, SeededCosts(seed=1))
    runner = Runner(ex, Planner(clock=ex.clock, validate=True), hooks=[rec])

    class Chain(Hook):
        def on_job_end(self, run: JobRun) -> None:
            if run.job_id == a.job_id:
                runner.submit(b)
            else:
                runner.stop("test over")  # nothing is open: stop just ends the idle wait

    runner.hooks.hooks.append(Chain())
    out = runner.run([a], until_stopped=True)
    assert [r.job_id for r in out] == [a.job_id]
    assert rec.ended == [(a.job_id, "done"), (b.job_id, "done")]
    assert runner.runs[b.job_id].iterations_done == b.iterations
    assert runner.runs[b.job_id].submitted_at == pytest.approx(runner.runs[a.job_id].finished_at)
    assert rec.summary is not None and [r.job_id for r in rec.summary.runs] == [a.job_id, b.job_id]
    with pytest.raises(ValueError, match="already submitted"):
        runner.submit(a)


def test_stop_closes_open_jobs_as_cancelled_and_reports_every_close() -> None:
    a, b = _jobs(2, seed=3)
    rec = Record()
    closed: list[tuple[str, str, str]] = []
    ex = SimExecutor(1, SeededCosts(seed=1))
    runner = Runner(
        ex, Planner(clock=ex.clock, validate=True, placement=placement_policy("isolated")), hooks=[rec],
        on_closed=lambda r: closed.append((r.job_id, r.status, r.error)),
    )  # fmt: skip

    class StopAfterFirstIteration(Hook):
        def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
            if iteration == 0:
                runner.stop("server stopping")

    runner.hooks.hooks.append(StopAfterFirstIteration())
    runner.run([a, b])  # one service, isolated placement by default: b waits unplaced behind a
    status = {r.job_id: r.status for r in runner.runs.values()}
    assert status == {a.job_id: "cancelled", b.job_id: "cancelled"}
    # both are reported through on_closed, the unplaced one included; hooks see only the placed one
    assert sorted(closed) == sorted(
        [(a.job_id, "cancelled", "server stopping"), (b.job_id, "cancelled", "server stopping")]
    )
    assert [j for j, _ in rec.ended] == [a.job_id] and runner.runs[b.job_id].started_at is None
    assert runner.runs[a.job_id].iterations_done == 1


def test_submit_and_cancel_from_another_thread() -> None:
    """The loop runs in a thread and idles between jobs; jobs and a cancel come from this thread."""
    jobs = _jobs(4, seed=5)
    done = threading.Event()
    ended: list[str] = []

    class Notify(Hook):
        def on_job_end(self, run: JobRun) -> None:
            ended.append(run.job_id)
            if len(ended) == 3:
                done.set()

    ex = SimExecutor(2, SeededCosts(seed=2))
    runner = Runner(ex, Planner(clock=ex.clock, validate=True), hooks=[Notify()])
    err: list[BaseException] = []

    def loop() -> None:
        try:
            runner.run([], until_stopped=True)
        except BaseException as exc:
            err.append(exc)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    for job in jobs[:3]:
        runner.submit(job)
    assert done.wait(timeout=60), f"jobs did not end: {ended}, errors {err}"
    runner.cancel("no-such-job")  # a cancel of an unknown job wakes the idle loop and changes nothing
    runner.submit(jobs[3])
    runner.cancel(jobs[3].job_id)
    runner.stop()
    t.join(timeout=60)
    assert not t.is_alive() and not err
    assert {r.job_id: r.status for r in runner.runs.values()} == {
        **{j.job_id: "done" for j in jobs[:3]},
        jobs[3].job_id: "cancelled",
    }


def test_a_long_running_loop_forgets_ended_jobs() -> None:
    """`forget_ended` (the server): after 30 jobs ran one after another (the last cancelled, one failed by a
    lost service), the runner, planner, cost model and executor hold nothing of them; hooks saw every end."""
    jobs = _jobs(30, seed=5)
    sim = SimExecutor(2, SeededCosts(seed=1), failures={"service-1": 3.0})
    rec = Record()
    runner = Runner(sim, Planner(clock=sim.clock, validate=True), hooks=[rec], forget_ended=True)
    pending = list(jobs[2:])

    class Next(Hook):
        def on_job_end(self, run: JobRun) -> None:
            if pending:
                runner.submit(pending.pop(0))
                if not pending:
                    runner.cancel(jobs[-1].job_id)
            if len(rec.ended) == len(jobs):
                runner.stop("test over")

    runner.hooks.hooks.append(Next())
    runner.run(jobs[:2], until_stopped=True)  # spread: job001 on service-1, lost at t=3
    statuses = [s for _, s in rec.ended]
    assert len(rec.ended) == 30 and statuses.count("done") >= 27 and "failed" in statuses, rec.ended
    assert (jobs[-1].job_id, "cancelled") in rec.ended and ("job001", "failed") in rec.ended
    assert runner.runs == {} and runner.planner.jobs == {} and sim.specs == {}
    assert not any(k[0] for k in runner.planner.costs.nodes)  # no job's own observations
    assert runner.planner.costs.by_name  # what they taught about each node name stays
