"""Decode-step preemption in the planner (pure: fake events, no cluster, no clock): a sliced service node that
reports `paused` is queued again on its job's service, another job's node may run between two of its slices,
its job's state is never evicted while it is paused, cancel and a lost service end it like any node, the
ordering is told what is left of it, and `validate()` catches a broken paused state. The SimExecutor side:
a node in `SimJob.slice_s` runs as slices through the real runner."""

from __future__ import annotations

import pytest
from conftest import Clock

from plexrl.planner import (
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
    RunNode,
    ServiceJoined,
    ServiceLost,
)
from plexrl.planner.state import Move

PLAN = JobPlan(
    nodes={
        "prompts": NodePlan("cpu"),
        "rollout": NodePlan("service", ("prompts",)),
        "verify": NodePlan("cpu", ("rollout",)),
        "train": NodePlan("service", ("verify",)),
    },
    iterations=1,
    order=("prompts", "rollout", "verify", "train"),
    state_bytes=100,
)


def planner(device: int | None = None) -> tuple[Planner, Clock]:
    clock = Clock(1.0)
    p = Planner(clock=clock, validate=True)
    p.handle(ServiceJoined("s0", device_bytes=device))
    return p, clock


def runs(out: list[object]) -> list[RunNode]:
    return [i for i in out if isinstance(i, RunNode)]


def done(p: Planner, ins: RunNode, duration: float = 1.0, paused: bool = False) -> list[object]:
    return p.handle(NodeFinished(ins.job_id, ins.iteration, ins.node, duration=duration, paused=paused))


def start_rollout(p: Planner, job: str) -> list[object]:
    """Submit `job` and finish its prompts node: what comes out (its rollout, if the service is free)."""
    (prompts,) = runs(p.handle(JobSubmitted(job, PLAN)))
    return done(p, prompts)


def test_a_paused_node_is_queued_again_until_its_last_slice_and_the_cost_model_learns_the_whole_node() -> None:
    p, _ = planner()
    (first,) = runs(start_rollout(p, "a"))
    assert (first.node, first.slice) == ("rollout", 0)
    (second,) = runs(done(p, first, 2.0, paused=True))
    assert (second.node, second.slice, second.swaps) == ("rollout", 1, ())
    assert p.jobs["a"].nodes["rollout"] == "running" and p.jobs["a"].slices["rollout"].slices == 1
    (third,) = runs(done(p, second, 2.0, paused=True))
    assert third.slice == 2
    (verify,) = runs(done(p, third, 1.0))  # the last slice: the node is done, its successor runs
    assert verify.node == "verify" and p.jobs["a"].slices == {}
    assert p.costs.predict("a", "rollout") == pytest.approx(5.0)  # every slice, as one node
    (train,) = runs(done(p, verify))
    out = done(p, train)
    assert IterationDone("a", 0) in out and JobDone("a", "s0") in out


def service_runs(out: list[object]) -> list[RunNode]:
    return [i for i in runs(out) if i.runs_on == "service"]


def paused_beside(p: Planner) -> RunNode:
    """a's rollout pauses after one slice while b's rollout waits (fifo: b's was ready first): b's runs,
    a's next slice waits, paused. Returns b's rollout."""
    (a1,) = runs(start_rollout(p, "a"))
    assert runs(start_rollout(p, "b")) == []  # b's rollout waits: a's slice runs
    (b1,) = runs(done(p, a1, 1.0, paused=True))
    assert (b1.job_id, b1.node) == ("b", "rollout")
    assert p.jobs["a"].nodes["rollout"] == "paused"
    return b1


def test_another_jobs_node_runs_between_two_slices() -> None:
    p, _ = planner()
    b1 = paused_beside(p)
    (a2,) = service_runs(done(p, b1, 1.0))
    assert (a2.job_id, a2.node, a2.slice) == ("a", "rollout", 1)


def test_a_paused_job_stays_on_device_and_a_job_that_does_not_fit_beside_it_waits() -> None:
    p, _ = planner(device=150)  # one state on device at a time
    (a1,) = runs(start_rollout(p, "a"))
    (prompts_b,) = runs(p.handle(JobSubmitted("b", PLAN)))
    assert p.services["s0"].state.where == {"a": "device", "b": "host"}
    assert runs(done(p, prompts_b)) == []
    # a pauses: b's rollout was queued first, but b cannot come on device without evicting paused a
    (a2,) = runs(done(p, a1, 1.0, paused=True))
    assert (a2.job_id, a2.slice, a2.swaps) == ("a", 1, ())
    verify_a, b1 = runs(done(p, a2, 1.0))  # a's rollout ended: now b may evict a
    assert (verify_a.job_id, verify_a.node, b1.job_id, b1.node) == ("a", "verify", "b", "rollout")
    assert Move("a", "device", "host", 100) in b1.swaps


def test_cancel_while_paused_ends_the_job_and_drops_its_next_slice() -> None:
    p, _ = planner()
    b1 = paused_beside(p)
    out = p.handle(JobCancelled("a"))
    assert FailJob("a", "cancelled by user", "s0", cancelled=True) in out
    svc = p.services["s0"]
    assert all(q.job_id != "a" for q in svc.queue) and "a" not in svc.state.where
    assert service_runs(done(p, b1, 1.0)) == []  # b goes on to its cpu node; nothing of a runs again


def test_a_lost_service_while_paused_fails_the_job_like_any_node() -> None:
    p, _ = planner()
    paused_beside(p)
    out = p.handle(ServiceLost("s0", "worker died"))
    fails = {i.job_id: i for i in out if isinstance(i, FailJob)}
    assert set(fails) == {"a", "b"} and fails["a"].service_lost and "worker died" in fails["a"].reason
    assert p.handle(NodeFinished("a", 0, "rollout", duration=1.0, paused=True)) == []  # a late report: ignored


def test_the_ordering_is_told_what_is_left_of_a_paused_node() -> None:
    from plexrl.planner.slices import node_rest

    p, _ = planner()
    p.costs.observe("a", "rollout", 10.0)
    (a1,) = runs(start_rollout(p, "a"))
    runs(start_rollout(p, "b"))
    (b1,) = runs(done(p, a1, 3.0, paused=True))
    svc = p.services["s0"]
    (queued,) = svc.queue
    assert queued.job_id == "a" and p._ordering_view(svc).service_time(queued) == pytest.approx(7.0)  # 10 - 3
    assert p.costs.predict("a", "rollout") == pytest.approx(10.0)  # nothing learned from a slice
    (a2,) = service_runs(done(p, b1, 1.0))
    done(p, a2, 9.0, paused=True)  # 12 s so far, past the prediction: at least one slice like the last is left
    assert node_rest(p.jobs["a"], "rollout", p.costs.predict) == pytest.approx(9.0)


def test_only_a_service_node_can_pause_and_validate_catches_a_broken_paused_state() -> None:
    p, _ = planner()
    runs(p.handle(JobSubmitted("a", PLAN)))
    with pytest.raises(InvalidTransition, match="only a service node"):
        p.handle(NodeFinished("a", 0, "prompts", paused=True))
    p2, _ = planner()
    paused_beside(p2)
    p2.validate()
    state = p2.services["s0"].state
    state._put("a", "host")  # as if the planner had evicted a paused job
    with pytest.raises(InvalidTransition, match="paused while its state is off device"):
        p2.validate()
    state._put("a", "device")
    p2.services["s0"].queue.clear()
    with pytest.raises(InvalidTransition, match="paused but not queued"):
        p2.validate()


def test_the_sim_executor_runs_a_sliced_node_in_slices_with_another_jobs_nodes_between() -> None:
    from plexrl.runtime import Runner
    from plexrl.runtime.sim import SeededCosts, SimExecutor, SimJob

    nodes = dict(PLAN.nodes)
    means = {"prompts": 0.1, "rollout": 10.0, "verify": 0.5, "train": 1.0}
    sliced = SimJob("a", nodes, 2, means, PLAN.order, slice_s={"rollout": 2.5})
    other = SimJob("b", nodes, 2, {**means, "rollout": 1.0}, PLAN.order)
    executor = SimExecutor(1, SeededCosts(jitter=0.0, load_bandwidth=None))
    starts: list[tuple[str, str, float]] = []
    submit = executor.submit

    def watching(task):  # type: ignore[no-untyped-def]
        if task.service_id is not None:
            starts.append((task.job_id, task.node, executor.now))
        return submit(task)

    executor.submit = watching  # type: ignore[method-assign]
    ran = Runner(executor, Planner(clock=executor.clock, validate=True)).run([sliced, other])
    assert [r.status for r in ran] == ["done", "done"]
    a_rollouts = [s for s in starts if s[:2] == ("a", "rollout")]
    assert len(a_rollouts) == 8  # 10 s in slices of 2.5 s, two iterations
    between = [s for s in starts if s[0] == "b" and a_rollouts[0][2] < s[2] < a_rollouts[3][2]]
    assert between, starts  # b's nodes ran inside a's first rollout
    a = ran[0]
    assert [row["time/rollout"] for row in a.history] == pytest.approx([10.0, 10.0])  # the slices add up
    assert executor.close()["service-0"]["busy_seconds"] == pytest.approx(2 * (10.0 + 1.0) + 2 * (1.0 + 1.0))
