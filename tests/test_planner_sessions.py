"""Sessions as planner work (`planner/sessions.py`): a job whose plan is open runs the calls of its client one at a
time, in the order they come, each a service node ordered among every other job's nodes; between calls it is
idle and counts as away (first evicted, its client's time learnt), and it ends when closed. Pure: events in,
instructions out."""

from __future__ import annotations

import math

import pytest
from conftest import Clock

from plexrl.planner import (
    CallArrived,
    CheckpointFinished,
    FailJob,
    InvalidTransition,
    IterationDone,
    JobDone,
    JobPlan,
    JobSubmitted,
    NodeFinished,
    NodePlan,
    PlaceJob,
    Planner,
    RunCheckpoint,
    RunNode,
    ServiceJoined,
    SessionClosing,
    Tick,
)
from plexrl.planner.gaps import busy_fraction, next_use
from plexrl.planner.placement import SpreadBackfill
from plexrl.planner.sessions import CLIENT, only_idle_left

KINDS = ("forward_backward", "optim_step", "sample")


def session(every: int = 0, nbytes: int = 0) -> JobPlan:
    nodes = {k: NodePlan("service", commits=k == "optim_step") for k in KINDS}
    return JobPlan(nodes, 10**9, KINDS, state_bytes=nbytes, checkpoint_every=every, open=True, user="ann")


def dag(nbytes: int = 0) -> JobPlan:
    nodes = {"roll": NodePlan("service"), "verify": NodePlan("cpu", ("roll",))}
    return JobPlan(nodes, 3, ("roll", "verify"), state_bytes=nbytes, user="bob")


def sent(out: list[object]) -> list[tuple[str, int, str]]:
    return [(i.job_id, i.iteration, i.node) for i in out if isinstance(i, RunNode)]


def planner(device: int | None = None) -> tuple[Planner, Clock]:
    clock = Clock()
    p = Planner(clock=clock, validate=True)
    p.handle(ServiceJoined("s0", device_bytes=device))
    return p, clock


def test_calls_run_one_at_a_time_in_the_order_they_came_numbered_as_iterations() -> None:
    p, clock = planner()
    assert sent(p.handle(JobSubmitted("s", session()))) == []  # placed, idle: no call, no iteration
    assert p.jobs["s"].status == "running" and not p.jobs["s"].nodes
    out = p.handle(CallArrived("s", "forward_backward"))
    assert sent(out) == [("s", 0, "forward_backward")]
    with pytest.raises(InvalidTransition, match="while another is pending or running"):
        p.handle(CallArrived("s", "optim_step"))  # the runtime announces the next only after this one ends
    clock.t = 1.0
    out = p.handle(NodeFinished("s", 0, "forward_backward", duration=1.0))
    assert [i for i in out if isinstance(i, IterationDone)] == [IterationDone("s", 0)] and sent(out) == []
    assert only_idle_left(p.jobs.values())
    assert sent(p.handle(CallArrived("s", "optim_step"))) == [("s", 1, "optim_step")]
    p.handle(NodeFinished("s", 1, "optim_step", duration=0.5))
    with pytest.raises(InvalidTransition, match="no call kind"):
        p.handle(CallArrived("s", "bogus"))


def test_a_session_and_a_dag_job_interleave_on_one_service_by_the_ordering() -> None:
    p, _ = planner()
    p.handle(JobSubmitted("d", dag()))
    p.handle(JobSubmitted("s", session()))
    out = p.handle(CallArrived("s", "sample"))  # the DAG job's rollout runs: the call waits in the queue
    assert sent(out) == []
    assert [q.job_id for q in p.services["s0"].queue] == ["s"]
    out = p.handle(NodeFinished("d", 0, "roll", duration=1.0))  # the service frees: the call goes next
    assert ("s", 0, "sample") in sent(out) and ("d", 0, "verify") in sent(out)
    out = p.handle(NodeFinished("d", 0, "verify", duration=1.0))  # the DAG's next rollout waits for the call
    assert sent(out) == []
    out = p.handle(NodeFinished("s", 0, "sample", duration=1.0))
    assert sent(out) == [("d", 1, "roll")]


def test_an_idle_session_is_away_on_its_client_which_the_cost_model_learns() -> None:
    p, clock = planner()
    p.handle(JobSubmitted("s", session()))
    assert next_use(p.services["s0"], p.jobs, p.costs.predict, clock.t)["s"] < math.inf  # its client is its cpu
    assert CLIENT in p.jobs["s"].cpu_started
    clock.t = 4.0
    p.handle(CallArrived("s", "forward_backward"))
    assert p.costs.predict("s", CLIENT) == 4.0 and p.jobs["s"].work_done == 4.0
    clock.t = 5.0
    p.handle(NodeFinished("s", 0, "forward_backward", duration=1.0))
    assert busy_fraction(p.jobs["s"], p.costs.predict) == pytest.approx(1.0 / 5.0)
    clock.t = 9.0  # a call that came at 5.5, heard of at 9 (its runner was running a node in-process meanwhile)
    p.handle(CallArrived("s", "sample", at=5.5))
    a = p.costs.alpha  # (learnt: 0.5 s away, not 4)
    assert p.costs.predict("s", CLIENT) == pytest.approx((1 - a) * 4.0 + a * 0.5) and p.jobs["s"].work_done == 5.5


def test_an_idle_session_is_evicted_first_when_another_job_needs_the_device() -> None:
    p, _ = planner(device=150)
    p.handle(JobSubmitted("s", session(nbytes=100)))
    p.handle(CallArrived("s", "sample"))
    p.handle(NodeFinished("s", 0, "sample", duration=1.0))  # idle now, its state on device
    out = p.handle(JobSubmitted("d", dag(nbytes=100)))  # admitted to host; its rollout needs the device
    run = [i for i in out if isinstance(i, RunNode)]
    assert [(m.job_id, m.src, m.dst) for m in run[0].swaps][:1] == [("s", "device", "host")]
    assert sent(out) == [("d", 0, "roll")]


def test_closing_ends_an_idle_session_at_once_a_busy_one_after_its_call() -> None:
    p, _ = planner()
    p.handle(JobSubmitted("a", session()))
    assert p.handle(SessionClosing("a")) == [JobDone("a", "s0")]
    p.handle(JobSubmitted("b", session()))
    p.handle(CallArrived("b", "sample"))
    assert p.handle(SessionClosing("b")) == []  # its call runs on
    out = p.handle(NodeFinished("b", 0, "sample", duration=1.0))
    assert IterationDone("b", 0) in out and JobDone("b", "s0") in out
    assert p.handle(CallArrived("b", "sample")) == []  # a late call of an ended session: nothing (the runtime fails it)


def test_a_session_closed_before_it_was_placed_is_cancelled() -> None:
    clock = Clock()
    p = Planner(clock=clock, validate=True)  # no service yet: it waits, queued
    p.handle(JobSubmitted("s", session()))
    p.handle(CallArrived("s", "sample"))  # (kept until it is placed)
    out = p.handle(SessionClosing("s"))
    assert [type(i) for i in out] == [FailJob] and out[0].cancelled  # type: ignore[attr-defined]


def test_a_call_that_came_before_placement_runs_once_placed() -> None:
    clock = Clock()
    p = Planner(clock=clock, validate=True)
    p.handle(JobSubmitted("s", session()))
    p.handle(CallArrived("s", "forward_backward"))
    assert sent(p.handle(ServiceJoined("s0"))) == [("s", 0, "forward_backward")]


def test_checkpoints_follow_the_calls_that_change_the_weights() -> None:
    p, _ = planner()
    p.handle(JobSubmitted("s", session(every=2)))
    kinds = ["forward_backward", "optim_step", "sample", "forward_backward", "optim_step", "optim_step", "optim_step"]
    checkpoints = []
    for i, kind in enumerate(kinds):
        p.handle(CallArrived("s", kind))
        out = p.handle(NodeFinished("s", i, kind, duration=1.0))
        held = [c for c in out if isinstance(c, RunCheckpoint)]
        checkpoints += held
        for c in held:
            p.handle(CheckpointFinished("s", c.iteration))
    # after the first optim_step (a session with no checkpoint has no change), then every second one
    assert checkpoints == [RunCheckpoint("s", 1, "s0"), RunCheckpoint("s", 4, "s0"), RunCheckpoint("s", 6, "s0")]


def test_a_failed_call_fails_the_session_like_any_node() -> None:
    p, _ = planner()
    p.handle(JobSubmitted("s", session()))
    p.handle(CallArrived("s", "sample"))
    out = p.handle(NodeFinished("s", 0, "sample", ok=False, error="engine died"))
    assert [type(i) for i in out] == [FailJob] and "engine died" in out[0].reason  # type: ignore[attr-defined]


def test_idle_sessions_loads_fall_so_a_queued_session_goes_in_at_its_wake_without_any_event() -> None:
    # the server's default placement: spread+backfill at max_load 1.0, one service; every session's predicted
    # load starts at the prior's 0.5 (a call 0.1 s, its client 0.1 s): two fill the service
    clock = Clock()
    p = Planner(clock=clock, placement=SpreadBackfill(max_load=1.0), validate=True)
    p.handle(ServiceJoined("s0"))
    for s in ("a", "b", "c"):
        p.handle(JobSubmitted(s, session()))
    assert [p.jobs[s].status for s in "abc"] == ["running", "running", "queued"]
    assert "waiting for room" in p.jobs["c"].reason
    # a and b stay idle (their clients went quiet, or never came back after a restart): their loads fall, 0.1 /
    # (0.1 + the time away), and c fits once they are at 0.25 each, at 0.3 s; the planner asks to be woken then
    wake = p.wake_at
    assert wake == pytest.approx(0.3, abs=1e-6)
    assert p.job_load("a") == pytest.approx(0.5) and p.job_load("a", at=0.9) == pytest.approx(0.1)
    clock.t = wake - 1e-3
    p.handle(Tick())
    assert p.jobs["c"].status == "queued"  # too early: a Tick before then changes nothing
    clock.t = wake
    out = p.handle(Tick())
    assert [(i.job_id, i.service_id) for i in out if isinstance(i, PlaceJob)] == [("c", "s0")]
    assert p.wake_at is None
    # a session whose client is back (its call announced or running) is not away: its load does not fall
    p.handle(CallArrived("a", "sample"))
    assert p.job_load("a", at=1e6) == p.job_load("a") > 0.2


def test_the_wake_time_of_idle_sessions_is_pure_arithmetic() -> None:
    import doctest

    from plexrl.planner import admission, sessions

    for module in (sessions, admission):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__
