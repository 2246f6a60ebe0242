"""Retries are the planner's: a failed cpu node with runs left goes to `backoff`, `wake_at` says when the
planner needs a `Tick`, and the tick sends it again. Pure: events in, instructions out, a settable clock."""

from __future__ import annotations

import math

from conftest import Clock

from plexrl.planner import (
    FailJob,
    JobCancelled,
    JobPlan,
    JobSubmitted,
    NodeFinished,
    NodePlan,
    PlaceJob,
    Planner,
    RetryNode,
    RetryPlan,
    RunNode,
    ServiceJoined,
    Tick,
)
from plexrl.planner.gaps import due, next_use

# a[service] -> b[cpu] -> c[service]
NODES = {"a": NodePlan("service"), "b": NodePlan("cpu", ("a",)), "c": NodePlan("service", ("b",))}
RETRY = RetryPlan(attempts=3, delays=(10.0, 30.0))


def started(retry: RetryPlan | None = RETRY) -> tuple[Planner, Clock, list[object]]:
    clock = Clock()
    p = Planner(clock=clock, validate=True)
    p.handle(ServiceJoined("s0"))
    out = p.handle(JobSubmitted("j", JobPlan(NODES, iterations=2, order=("a", "b", "c"), retry=retry)))
    assert isinstance(out[0], PlaceJob) and out[1] == RunNode("j", 0, "a", "service", "s0")
    out = p.handle(NodeFinished("j", 0, "a", duration=1.0))
    assert out == [RunNode("j", 0, "b", "cpu")]
    return p, clock, out


def fail_b(p: Planner, error: str = "ConnectionError: flaky") -> list[object]:
    return p.handle(NodeFinished("j", 0, "b", ok=False, error=error, duration=0.5))


def test_a_failed_cpu_node_waits_in_backoff_then_runs_again_at_its_tick() -> None:
    p, clock, _ = started()
    clock.t = 5.0
    assert fail_b(p) == [RetryNode("j", 0, "b", 1, 3, 10.0, "ConnectionError: flaky")]
    job = p.jobs["j"]
    assert job.nodes["b"] == "backoff" and "b" not in job.cpu_started and p.wake_at == 15.0
    clock.t = 14.0
    assert p.handle(Tick()) == []  # not yet
    clock.t = 15.0
    assert p.handle(Tick()) == [RunNode("j", 0, "b", "cpu", attempt=2)]
    assert p.wake_at is None and job.nodes["b"] == "running"
    clock.t = 16.0
    assert fail_b(p) == [RetryNode("j", 0, "b", 2, 3, 30.0, "ConnectionError: flaky")]  # the second delay
    assert p.wake_at == 46.0
    clock.t = 46.0
    assert p.handle(Tick()) == [RunNode("j", 0, "b", "cpu", attempt=3)]
    out = p.handle(NodeFinished("j", 0, "b", duration=0.5))  # the third run succeeds: on to c
    assert out == [RunNode("j", 0, "c", "service", "s0")]
    assert job.runs == {}


def test_when_the_runs_run_out_the_job_fails_with_the_error_and_the_count() -> None:
    p, clock, _ = started(RetryPlan(attempts=2, delays=(1.0,)))
    fail_b(p)
    clock.t = 1.0
    assert p.handle(Tick()) == [RunNode("j", 0, "b", "cpu", attempt=2)]
    out = fail_b(p, "ValueError: still broken")
    assert len(out) == 1 and isinstance(out[0], FailJob)
    assert out[0].reason == "node 'b' (iteration 0): ValueError: still broken (after 2 runs)"
    assert p.jobs["j"].status == "failed" and p.wake_at is None


def test_without_a_retry_plan_the_first_failure_fails_the_job() -> None:
    p, _, _ = started(retry=None)
    [fail] = fail_b(p)
    assert isinstance(fail, FailJob) and fail.reason == "node 'b' (iteration 0): ConnectionError: flaky"


def test_service_nodes_are_not_retried() -> None:
    clock = Clock()
    p = Planner(clock=clock, validate=True)
    p.handle(ServiceJoined("s0"))
    p.handle(JobSubmitted("j", JobPlan(NODES, iterations=1, order=("a", "b", "c"), retry=RETRY)))
    [fail] = p.handle(NodeFinished("j", 0, "a", ok=False, error="OOM"))
    assert isinstance(fail, FailJob)


def test_a_job_cancelled_during_its_backoff_never_runs_the_node_again() -> None:
    p, clock, _ = started()
    fail_b(p)
    [cancel] = p.handle(JobCancelled("j"))
    assert isinstance(cancel, FailJob) and cancel.cancelled
    assert p.wake_at is None and p.jobs["j"].backoff == {}
    clock.t = 100.0
    assert p.handle(Tick()) == [] and p.finished


def test_a_job_in_backoff_is_not_due_now_for_eviction_prefetch_or_ordering() -> None:
    """`next_use` and `due` see a job in backoff as away until its backoff ends plus the node's time."""
    p, clock, _ = started()
    clock.t = 5.0
    fail_b(p)
    svc, job = p.services["s0"], p.jobs["j"]
    predict = p.costs.predict
    clock.t = 7.0
    expect = predict("j", "b") + (15.0 - 7.0)
    assert math.isclose(next_use(svc, p.jobs, predict, clock.t)["j"], expect)
    assert math.isclose(due(svc, p.jobs, predict, p.gap_after, clock.t)["j"], expect)
    assert job.cpu_started == {}  # it is not running: nothing of it is in flight on the CPU pool
