"""Checkpoints are the planner's work (`JobPlan.checkpoint_every`, `planner/checkpoints.py`): after every k-th
iteration but the last the planner holds the job and runs its checkpoint on the job's service when that is
free; nothing else is sent there meanwhile, lookahead included. Pure: events in, instructions out."""

from __future__ import annotations

import pytest
from conftest import Clock

from plexrl.planner import (
    CheckpointFinished,
    FailJob,
    InvalidTransition,
    IterationDone,
    JobCancelled,
    JobDone,
    JobPlan,
    JobSubmitted,
    NodeFinished,
    NodePlan,
    Planner,
    RunCheckpoint,
    RunNode,
    ServiceJoined,
)
from plexrl.planner.checkpoints import due
from plexrl.planner.gaps import next_use

# a[service] -> b[cpu]
NODES = {"a": NodePlan("service"), "b": NodePlan("cpu", ("a",))}


def plan(every: int, iterations: int = 5) -> JobPlan:
    return JobPlan(NODES, iterations=iterations, order=("a", "b"), checkpoint_every=every)


def nodes(out: list[object]) -> list[tuple[str, int, str]]:
    return [(i.job_id, i.iteration, i.node) for i in out if isinstance(i, RunNode)]


def iteration(p: Planner, job: str, it: int) -> list[object]:
    """Run one iteration of `job` (its service node sent already): a ends, b ends; what the planner then says."""
    assert nodes(p.handle(NodeFinished(job, it, "a", duration=1.0))) == [(job, it, "b")]
    return p.handle(NodeFinished(job, it, "b", duration=1.0))


def test_the_cadence_is_every_kth_iteration_but_the_last_and_never_the_baseline() -> None:
    assert [i for i in range(-1, 6) if due(plan(2, 6), i)] == [1, 3]  # not 5: nothing would resume from it
    assert [i for i in range(-1, 6) if due(plan(1, 3), i)] == [0, 1]
    assert not any(due(plan(0), i) for i in range(5))


def test_a_job_is_held_for_its_checkpoint_and_goes_on_when_it_ends() -> None:
    clock = Clock()
    p = Planner(clock=clock, validate=True)
    p.handle(ServiceJoined("s0"))
    out = p.handle(JobSubmitted("j", plan(2)))
    assert nodes(out) == [("j", 0, "a")]
    assert nodes(iteration(p, "j", 0)) == [("j", 1, "a")]  # no checkpoint after iteration 0
    out = iteration(p, "j", 1)
    assert out == [IterationDone("j", 1), RunCheckpoint("j", 1, "s0")]  # held: iteration 2 does not start
    assert p.jobs["j"].checkpoint == 1 and p.services["s0"].checkpointing == ("j", 1)
    clock.t = 10.0
    before = p.usage.value("", 10.0)
    out = p.handle(CheckpointFinished("j", 1, duration=3.0))
    assert nodes(out) == [("j", 2, "a")] and p.jobs["j"].checkpoint is None
    assert p.usage.value("", 10.0) == pytest.approx(before + 3.0)  # its user's service time counts it
    assert nodes(iteration(p, "j", 2)) == [("j", 3, "a")]
    out = iteration(p, "j", 3)
    assert out == [IterationDone("j", 3), RunCheckpoint("j", 3, "s0")]
    p.handle(CheckpointFinished("j", 3))
    out = iteration(p, "j", 4)
    assert out == [IterationDone("j", 4), JobDone("j", "s0")]  # none after the last iteration


def test_a_failed_checkpoint_does_not_fail_the_job() -> None:
    p = Planner(clock=Clock(), validate=True)
    p.handle(ServiceJoined("s0"))
    p.handle(JobSubmitted("j", plan(1, 2)))
    assert RunCheckpoint("j", 0, "s0") in iteration(p, "j", 0)
    out = p.handle(CheckpointFinished("j", 0, ok=False, error="OSError: disk full"))
    assert nodes(out) == [("j", 1, "a")] and p.jobs["j"].status == "running"


def two_jobs(lookahead: bool) -> Planner:
    """Jobs j and k on one service, j checkpointed after every iteration; j's a runs."""
    p = Planner(clock=Clock(), validate=True, lookahead=lookahead)
    p.handle(ServiceJoined("s0"))
    assert nodes(p.handle(JobSubmitted("j", plan(1, 3)))) == [("j", 0, "a")]
    out = p.handle(JobSubmitted("k", JobPlan(NODES, iterations=3, order=("a", "b"))))
    assert nodes(out) == ([("k", 0, "a")] if lookahead else [])  # sent ahead, or queued behind j's a
    return p


@pytest.mark.parametrize("lookahead", [False, True])
def test_while_a_checkpoint_runs_the_service_gets_nothing_else_lookahead_included(lookahead: bool) -> None:
    p = two_jobs(lookahead)
    out = p.handle(NodeFinished("j", 0, "a", duration=1.0))
    assert nodes(out) == ([("j", 0, "b")] if lookahead else [("j", 0, "b"), ("k", 0, "a")])
    # k's a runs; j's b ends: j's checkpoint waits for k's a, and nothing is sent ahead of it
    out = p.handle(NodeFinished("j", 0, "b", duration=1.0))
    assert out == [IterationDone("j", 0)] and p.services["s0"].checkpoints == [("j", 0)]
    assert next_use(p.services["s0"], p.jobs, p.costs.predict, 0.0)["j"] == 0.0  # j's state is kept on device
    out = p.handle(NodeFinished("k", 0, "a", duration=1.0))
    assert nodes(out) == [("k", 0, "b")] and RunCheckpoint("j", 0, "s0") in out
    # k's b ends, its next a is ready: not sent while the checkpoint runs, even with lookahead
    out = p.handle(NodeFinished("k", 0, "b", duration=1.0))
    assert out == [IterationDone("k", 0)] and p.services["s0"].running is None
    assert p.services["s0"].next is None
    out = p.handle(CheckpointFinished("j", 0, duration=0.5))
    assert sorted(nodes(out)) == [("j", 1, "a"), ("k", 1, "a")] if lookahead else nodes(out) == [("k", 1, "a")]


def test_a_job_cancelled_during_its_checkpoint_frees_the_service_and_its_late_report_is_ignored() -> None:
    p = two_jobs(lookahead=False)
    p.handle(NodeFinished("j", 0, "a", duration=1.0))  # k's a starts
    p.handle(NodeFinished("k", 0, "a", duration=1.0))  # nothing queued: the service idles
    out = p.handle(NodeFinished("j", 0, "b", duration=1.0))
    assert RunCheckpoint("j", 0, "s0") in out
    assert nodes(p.handle(NodeFinished("k", 0, "b", duration=1.0))) == []  # k's a waits for the checkpoint
    out = p.handle(JobCancelled("j"))
    assert any(isinstance(i, FailJob) for i in out) and nodes(out) == [("k", 1, "a")]
    assert p.services["s0"].checkpointing is None
    assert p.handle(CheckpointFinished("j", 0)) == []


def test_a_checkpoint_that_was_not_running_is_an_invalid_transition() -> None:
    p = Planner(clock=Clock(), validate=True)
    p.handle(ServiceJoined("s0"))
    p.handle(JobSubmitted("j", plan(2)))
    with pytest.raises(InvalidTransition, match="was not running"):
        p.handle(CheckpointFinished("j", 0))
