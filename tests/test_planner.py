"""The planner as a pure state machine: feed events, compare instructions. No cluster, no clock."""

from __future__ import annotations

import pytest
from conftest import Clock

from plexrl.planner import (
    FailJob,
    InvalidTransition,
    Isolated,
    IterationDone,
    JobCancelled,
    JobDone,
    JobFailed,
    JobPlan,
    JobSubmitted,
    NodeFinished,
    NodePlan,
    PlaceJob,
    Planner,
    RunNode,
    ServiceJoined,
    ServiceLost,
)
from plexrl.planner.policies import Hrrs, OrderingView, QueuedNode

GRPO = JobPlan(
    nodes={
        "prompts": NodePlan("cpu"),
        "rollout": NodePlan("service", ("prompts",)),
        "verify": NodePlan("cpu", ("rollout",)),
        "advantage": NodePlan("cpu", ("rollout", "verify")),
        "train": NodePlan("service", ("advantage", "rollout")),
        "evaluate": NodePlan("service", ("train",), every=2),
    },
    iterations=3,
    order=("prompts", "rollout", "verify", "advantage", "train", "evaluate"),
)


def planner(**kw: object) -> Planner:
    return Planner(clock=Clock(1.0), validate=True, **kw)  # type: ignore[arg-type]


def finish(p: Planner, ins: RunNode, ok: bool = True) -> list[object]:
    return p.handle(NodeFinished(ins.job_id, ins.iteration, ins.node, ok=ok, error=None if ok else "boom"))


def drive(p: Planner, first: list[object]) -> list[object]:
    """Finish every RunNode in order (FIFO), as a synchronous driver would; return all instructions."""
    seen, todo = list(first), [i for i in first if isinstance(i, RunNode)]
    while todo:
        out = finish(p, todo.pop(0))  # type: ignore[arg-type]
        seen += out
        todo += [i for i in out if isinstance(i, RunNode)]
    return seen


def test_single_job_runs_nodes_in_dependency_order_with_periodic_eval() -> None:
    p = planner()
    assert p.handle(ServiceJoined("s0")) == []
    out = p.handle(JobSubmitted("a", GRPO))
    assert out == [PlaceJob("a", "s0"), RunNode("a", 0, "prompts", "cpu", None)]
    seen = drive(p, out)
    runs = [(i.iteration, i.node) for i in seen if isinstance(i, RunNode)]
    per_iter = ["prompts", "rollout", "verify", "advantage", "train"]
    assert runs == (
        [(0, n) for n in per_iter]
        + [(1, n) for n in [*per_iter, "evaluate"]]
        + [(2, n) for n in [*per_iter, "evaluate"]]
    )
    assert [i for i in seen if isinstance(i, IterationDone)] == [IterationDone("a", k) for k in range(3)]
    assert seen[-1] == JobDone("a", "s0")
    assert all(i.service_id == "s0" for i in seen if isinstance(i, RunNode) and i.runs_on == "service")
    assert p.jobs["a"].status == "done" and p.finished


def test_service_runs_one_node_at_a_time_fifo_across_jobs() -> None:
    p = planner()
    p.handle(ServiceJoined("s0"))
    a = p.handle(JobSubmitted("a", GRPO))
    b = p.handle(JobSubmitted("b", GRPO))
    ra = finish(p, a[1])  # a's prompts -> a's rollout starts
    assert ra == [RunNode("a", 0, "rollout", "service", "s0")]
    rb = finish(p, b[1])  # b's rollout is ready but the service is busy
    assert rb == []
    out = finish(p, ra[0])  # a's rollout done: a's verify (cpu) and b's rollout (service)
    assert RunNode("a", 0, "verify", "cpu", None) in out and RunNode("b", 0, "rollout", "service", "s0") in out


def test_failed_node_fails_only_that_job() -> None:
    p = planner()
    p.handle(ServiceJoined("s0"))
    a = p.handle(JobSubmitted("a", GRPO))
    b = p.handle(JobSubmitted("b", GRPO))
    out = finish(p, a[1], ok=False)
    assert out == [FailJob("a", "node 'prompts' (iteration 0): boom", "s0")]
    seen = drive(p, b[1:])
    assert seen[-1] == JobDone("b", "s0") and p.jobs["a"].status == "failed"


def test_isolated_placement_queues_jobs_until_a_service_frees() -> None:
    p = planner(placement=Isolated())
    p.handle(ServiceJoined("s0"))
    a = p.handle(JobSubmitted("a", GRPO))
    assert p.handle(JobSubmitted("b", GRPO)) == [] and p.jobs["b"].status == "queued"
    seen = drive(p, a)
    assert seen.index(PlaceJob("b", "s0")) == seen.index(JobDone("a", "s0")) + 1
    assert p.jobs["b"].status == "done" and seen[-1] == JobDone("b", "s0")


def test_cancel_and_lost_service() -> None:
    p = planner()
    p.handle(ServiceJoined("s0"))
    p.handle(ServiceJoined("s1"))
    a = p.handle(JobSubmitted("a", GRPO))
    b = p.handle(JobSubmitted("b", GRPO))
    assert a[0] == PlaceJob("a", "s0") and b[0] == PlaceJob("b", "s1")
    assert p.handle(JobCancelled("a")) == [FailJob("a", "cancelled by user", "s0", cancelled=True)]
    assert finish(p, a[1]) == []  # late report of a cancelled job is ignored
    assert p.handle(ServiceLost("s1", "worker died")) == [
        FailJob("b", "service 's1' lost: worker died", "s1", service_lost=True)
    ]
    assert p.jobs["a"].status == "cancelled" and p.jobs["b"].status == "failed" and p.finished


def test_illegal_moves_raise_with_history() -> None:
    p = planner()
    p.handle(ServiceJoined("s0"))
    a = p.handle(JobSubmitted("a", GRPO))
    with pytest.raises(InvalidTransition, match="recent history"):
        p.handle(NodeFinished("a", 0, "train"))
    with pytest.raises(InvalidTransition, match="submitted twice"):
        p.handle(JobSubmitted("a", GRPO))
    assert a  # the planner is still usable for other checks


def test_baseline_nodes_run_first_as_iteration_minus_one() -> None:
    plan = JobPlan(GRPO.nodes, iterations=1, order=GRPO.order, baseline=("evaluate",))
    p = planner()
    p.handle(ServiceJoined("s0"))
    out = p.handle(JobSubmitted("a", plan))
    assert out == [PlaceJob("a", "s0"), RunNode("a", -1, "evaluate", "service", "s0")]
    seen = drive(p, out)
    assert seen[2] == IterationDone("a", -1) and seen[3] == RunNode("a", 0, "prompts", "cpu", None)
    assert [i.node for i in seen if isinstance(i, RunNode) and i.iteration == 0][-1] == "evaluate"


def test_driver_reported_failure_ends_the_job() -> None:
    p = planner()
    p.handle(ServiceJoined("s0"))
    p.handle(JobSubmitted("a", GRPO))
    assert p.handle(JobFailed("a", "engine did not load")) == [FailJob("a", "engine did not load", "s0")]
    assert p.jobs["a"].status == "failed" and not p.services["s0"].jobs


def test_many_idle_iterations_in_a_row_do_not_recurse() -> None:
    plan = JobPlan({"probe": NodePlan("cpu", every=5000)}, iterations=6000)
    p = planner()
    p.handle(ServiceJoined("s0"))
    out = p.handle(JobSubmitted("a", plan))
    assert out[-1] == RunNode("a", 4999, "probe", "cpu", None)
    assert sum(isinstance(i, IterationDone) for i in out) == 4999
    seen = drive(p, out)
    assert seen[-1] == JobDone("a", "s0")


def _hrrs_reference(queue: list[QueuedNode], now: float, view: OrderingView, tie: float = 0.1) -> int:
    """HRRS written plainly (the definition), to check the planner's one-pass version against."""

    def ratio(q: QueuedNode) -> float:
        cost = max(view.service_time(q) + view.swap_time(q.job_id), 1e-3)
        return (max(now - q.ready_at, 0.0) + cost) / cost

    best = max(range(len(queue)), key=lambda i: (ratio(queue[i]), -queue[i].ready_at, -queue[i].seq))
    mine = [i for i, q in enumerate(queue) if q.job_id == view.resident]
    if mine and queue[best].job_id != view.resident:
        top = max(mine, key=lambda i: (ratio(queue[i]), -queue[i].seq))
        if ratio(queue[top]) * (1 + tie) >= ratio(queue[best]):
            return top
    return best


def test_hrrs_one_pass_pick_equals_its_definition() -> None:
    import random

    rng = random.Random(0)
    for _ in range(500):
        jobs = [f"j{k}" for k in range(rng.randint(1, 6))]
        queue, t = [], 0.0
        for seq in range(rng.randint(1, 12)):
            t += rng.choice([0.0, 0.0, rng.uniform(0, 2)])  # equal ready times happen
            queue.append(QueuedNode(rng.choice(jobs), 0, rng.choice(["rollout", "train"]), t, seq))
        times = {(j, n): rng.choice([0.0, 0.1, 0.5, rng.uniform(0, 3)]) for j in jobs for n in ("rollout", "train")}
        swaps = {j: rng.choice([0.0, 0.0, rng.uniform(0, 1)]) for j in jobs}
        view = OrderingView(rng.choice([None, *jobs]), lambda q, t=times: t[q.job_id, q.node], swaps.__getitem__)
        now = t + rng.uniform(0, 3)
        assert Hrrs().pick(queue, now, view) == _hrrs_reference(queue, now, view)


def test_a_resumed_jobs_cost_model_starts_from_its_checkpointed_node_times() -> None:
    from dataclasses import replace

    from plexrl.planner import JobPlan, JobSubmitted, NodePlan, Planner

    plan = JobPlan({"rollout": NodePlan("service"), "verify": NodePlan("cpu", ("rollout",))}, iterations=2)
    p = Planner(clock=lambda: 0.0)
    p.handle(JobSubmitted("fresh", plan))
    p.handle(JobSubmitted("resumed", replace(plan, costs=(("rollout", 2.5), ("gone", 1.0), ("verify", 0.25)))))
    assert p.costs.of_job("fresh") == {}
    assert p.costs.of_job("resumed") == {"rollout": 2.5, "verify": 0.25}  # a node the plan lacks is ignored
