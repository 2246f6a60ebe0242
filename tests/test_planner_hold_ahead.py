"""Lookahead held back for a preferred node due soon (`planner/ahead.py`) and the `io-first` ordering
(`policies.IoFirst`). Pure: the planner fed events on a settable clock, and the default multiplex mix's shape
in the simulator with a driver's round trip."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from conftest import Clock

from plexrl.planner import (
    FairShare,
    Hrrs,
    JobPlan,
    JobSubmitted,
    NodeFinished,
    NodePlan,
    Planner,
    RunNode,
    ServiceJoined,
)
from plexrl.planner.policies import ORDERINGS, IoFirst, OrderingView, Pace, QueuedNode

# a job behind a verifier: rollout -> verify (cpu) -> train; a compute-bound job: rollout -> train
JUDGED = {
    "rollout": NodePlan("service"),
    "verify": NodePlan("cpu", ("rollout",)),
    "train": NodePlan("service", ("verify",)),
}
COMPUTE = {"rollout": NodePlan("service"), "train": NodePlan("service", ("rollout",))}
JUDGED_PLAN = JobPlan(JUDGED, 3, tuple(JUDGED), state_bytes=100)
COMPUTE_PLAN = JobPlan(COMPUTE, 3, tuple(COMPUTE), state_bytes=100)


def runs(out: Sequence[object]) -> list[RunNode]:
    return [i for i in out if isinstance(i, RunNode)]


def three_jobs(hold: bool) -> tuple[Planner, Clock]:
    """j (judged) rolls out first, c1's rollout goes ahead, c2's queues; the cost model knows every node's time
    (j: 0.2 s on the service, verify 0.5 s; c1, c2: 1 s nodes)."""
    clock = Clock()
    p = Planner(clock=clock, validate=True, lookahead=True, hold_ahead=hold, ordering=IoFirst())
    for job, node, s in [("j", "rollout", 0.2), ("j", "verify", 0.5), ("j", "train", 0.2)] + [
        (c, n, 1.0) for c in ("c1", "c2") for n in ("rollout", "train")
    ]:
        p.costs.observe(job, node, s)
    p.handle(ServiceJoined("s0"))
    assert [r.job_id for r in runs(p.handle(JobSubmitted("j", JUDGED_PLAN)))] == ["j"]
    (ahead,) = runs(p.handle(JobSubmitted("c1", COMPUTE_PLAN)))
    assert ahead.job_id == "c1"  # nothing of j is due while its own node runs
    assert runs(p.handle(JobSubmitted("c2", COMPUTE_PLAN))) == []
    return p, clock


def test_lookahead_holds_a_compute_node_back_for_a_judged_node_due_before_the_running_one_ends() -> None:
    p, clock = three_jobs(hold=True)
    svc = p.services["s0"]
    clock.t = 0.2  # j's rollout ends: c1's runs (to ~1.2 s), j's verify (due at ~0.7 s) starts
    out = p.handle(NodeFinished("j", 0, "rollout", duration=0.2))
    assert [(r.job_id, r.node) for r in runs(out)] == [("j", "verify")]
    assert svc.running == ("c1", 0, "rollout") and svc.next is None and p.counts()["held_ahead"] >= 1
    clock.t = 0.7  # j's train is ready: it goes ahead of c2's rollout
    (train,) = runs(p.handle(NodeFinished("j", 0, "verify", duration=0.5)))
    assert (train.job_id, train.node) == ("j", "train") and svc.next == ("j", 0, "train")
    clock.t = 1.2
    p.handle(NodeFinished("c1", 0, "rollout", duration=1.0))
    assert svc.running == ("j", 0, "train")  # it waited for c1's rollout only


def test_without_the_hold_the_judged_node_waits_behind_the_node_sent_ahead() -> None:
    p, clock = three_jobs(hold=False)
    svc = p.services["s0"]
    clock.t = 0.2
    out = p.handle(NodeFinished("j", 0, "rollout", duration=0.2))
    assert ("c2", "rollout") in [(r.job_id, r.node) for r in runs(out)] and svc.next == ("c2", 0, "rollout")
    clock.t = 0.7
    assert runs(p.handle(NodeFinished("j", 0, "verify", duration=0.5))) == []  # one ahead at a time
    clock.t = 1.2
    p.handle(NodeFinished("c1", 0, "rollout", duration=1.0))
    assert svc.running == ("c2", 0, "rollout") and p.counts()["held_ahead"] == 0


def test_no_hold_when_the_due_node_comes_after_the_running_one_or_the_ordering_would_not_pick_it() -> None:
    p, clock = three_jobs(hold=True)
    p.costs.observe("j", "verify", 5.0)
    p.costs.observe("j", "verify", 5.0)
    p.costs.observe("j", "verify", 5.0)
    assert p.costs.predict("j", "verify") > 1.5  # due after c1's rollout ends
    clock.t = 0.2
    out = p.handle(NodeFinished("j", 0, "rollout", duration=0.2))
    assert p.services["s0"].next == ("c2", 0, "rollout") and len(runs(out)) == 2
    # HRRS ranks one node at a time: j's train opens no gap, c2's rollout has waited; it goes ahead
    clock = Clock()
    p = Planner(clock=clock, validate=True, lookahead=True, ordering=Hrrs(), hold_ahead=True)
    for job, node, s in [("j", "rollout", 0.2), ("j", "verify", 0.5), ("j", "train", 0.2), ("c1", "rollout", 1.0),
                         ("c2", "rollout", 1.0)]:  # fmt: skip
        p.costs.observe(job, node, s)
    p.handle(ServiceJoined("s0"))
    p.handle(JobSubmitted("j", JUDGED_PLAN))
    p.handle(JobSubmitted("c1", COMPUTE_PLAN))
    p.handle(JobSubmitted("c2", COMPUTE_PLAN))
    clock.t = 0.2
    p.handle(NodeFinished("j", 0, "rollout", duration=0.2))
    assert p.services["s0"].next == ("c2", 0, "rollout") and p.counts()["held_ahead"] == 0


def test_io_first_serves_the_job_with_the_least_service_share_and_lets_a_long_wait_in() -> None:
    paces = {"judge": Pace(0.0, 0.0, 10.0, rest_service=4.0), "compute": Pace(0.0, 0.0, 10.0, rest_service=9.5)}
    view = OrderingView(None, lambda q: 0.25, lambda j: 0.0, pace=paces.__getitem__)
    queue = [QueuedNode("compute", 0, "rollout", 0.0, 0), QueuedNode("judge", 0, "train", 1.0, 1)]
    assert Hrrs().pick(queue, 1.0, view) == 0  # HRRS: compute has waited 4x its node's time
    assert IoFirst().pick(queue, 1.0, view) == 1 and ORDERINGS["io-first"]().name == "io-first"
    assert IoFirst(age=2.0).pick(queue, 1.0, view) == 0  # waited more than 2x its time: HRRS decides again
    assert IoFirst().pick(queue[:1], 1.0, view) == 0
    # the planner holds lookahead back by default with io-first (over fair share too), not with the others
    assert Planner(clock=Clock(), ordering=IoFirst()).hold_ahead
    assert Planner(clock=Clock(), ordering=FairShare(IoFirst())).hold_ahead
    assert not Planner(clock=Clock(), ordering=Hrrs()).hold_ahead
    assert not Planner(clock=Clock(), ordering=IoFirst(), hold_ahead=False).hold_ahead


def test_io_first_with_the_hold_shortens_the_default_mix_in_the_simulator() -> None:
    """The default multiplex mix's shape (node times from a measured run: a compute-bound job and two behind
    0.5 s and 0.8 s verifiers, 40 iterations) on one simulated service with a 30 ms round trip per node, four
    seeds. Seen: makespans hrrs 69.6 / 66.8 / 67.7 / 70.6 s, io-first with the hold 66.9 / 66.3 / 66.5 / 66.6 s
    (the service's work is 59.3 s); the slow judge's slowdown 1.17-1.22 -> 1.15-1.16. Without the hold
    io-first schedules as hrrs does here: the judged nodes wait behind the compute node sent ahead."""
    from plexrl.planner import Pack
    from plexrl.runtime import Runner
    from plexrl.runtime.sim import GRPO_ORDER, SeededCosts, SimExecutor, SimJob, grpo_nodes

    def job(name: str, rollout: float, train: float, verify: float) -> SimJob:
        means = {"prompts": 0.015, "rollout": rollout, "verify": verify, "advantage": 0.002, "train": train,
                 "evaluate": 0.27}  # fmt: skip
        return SimJob(name, grpo_nodes(every=20), 40, means, GRPO_ORDER, (), 6_000_000)

    jobs = [job("compute", 0.269, 0.216, 0.001), job("judge", 0.249, 0.251, 0.5), job("slow", 0.259, 0.199, 0.8)]

    def ends(specs: list[SimJob], ordering: object, hold: bool, seed: int) -> dict[str, float]:
        ex = SimExecutor(1, SeededCosts(seed=seed, jitter=0.1), dispatch=(0.03, 0.03))
        runner = Runner(
            ex, Planner(clock=ex.clock, placement=Pack(math.inf), ordering=ordering, lookahead=True, hold_ahead=hold)
        )  # type: ignore[arg-type]
        done = runner.run(specs)
        assert all(r.status == "done" and r.finished_at is not None for r in done)
        return {r.job_id: r.finished_at for r in done}  # type: ignore[misc]

    hrrs = io = 0.0
    for seed in range(4):
        a, b, c = ends(jobs, Hrrs(), False, seed), ends(jobs, IoFirst(), True, seed), ends(jobs, IoFirst(), False, seed)
        slow = ends(jobs[2:], Hrrs(), False, seed)["slow"]
        assert max(b.values()) <= max(a.values()) + 0.05 and b["slow"] / slow <= 1.16 < a["slow"] / slow, (seed, a, b)
        assert max(c.values()) == pytest.approx(max(a.values()), rel=0.01)
        hrrs, io = hrrs + max(a.values()), io + max(b.values())
    assert io < 0.98 * hrrs, (io, hrrs)
