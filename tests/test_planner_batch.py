"""Co-scheduled rollouts (`Planner(batch_rollouts=True)`, `planner/batches.py`): the planner cohorts queued
batchable nodes of distinct jobs that share one engine key into one `RunNode`, within the device budget (sent
ahead too: tests/test_planner_batch_ahead.py), and frees the service once every member has finished. Pure:
events in, instructions out."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from conftest import Clock

from plexrl.planner import JobPlan, JobSubmitted, NodeFinished, NodePlan, PlaceJob, Planner, RunNode, ServiceJoined
from plexrl.planner.batches import shares

ENGINE = ("base+lora", 1000)
NODES = {"rollout": NodePlan("service", batchable=True), "train": NodePlan("service", ("rollout",))}


def plan(batch: int = 4, engine: tuple[str, int] | None = ENGINE, nodes: dict[str, NodePlan] = NODES) -> JobPlan:
    return JobPlan(nodes, iterations=2, order=tuple(nodes), state_bytes=100, engine=engine, batch=batch)


def runs(out: Sequence[object]) -> list[RunNode]:
    return [i for i in out if isinstance(i, RunNode)]


def planner(device: int | None = None, **kw: object) -> Planner:
    p = Planner(clock=Clock(), validate=True, batch_rollouts=True, **kw)  # type: ignore[arg-type]
    p.handle(ServiceJoined("s0", device_bytes=device))
    return p


def three_jobs(p: Planner, plans: dict[str, JobPlan] | None = None) -> RunNode:
    """a, b, c submitted in turn: a's rollout starts alone (the service was free); what runs when it ends."""
    plans = plans or {j: plan() for j in "abc"}
    out = p.handle(JobSubmitted("a", plans["a"]))
    assert runs(out) == [RunNode("a", 0, "rollout", "service", "s0", runs(out)[0].swaps)]
    for j in "bc":
        assert runs(p.handle(JobSubmitted(j, plans[j]))) == []  # the service is busy: queued
    (nxt,) = runs(p.handle(NodeFinished("a", 0, "rollout", duration=1.0)))
    return nxt


def test_queued_rollouts_of_one_engine_run_as_one_cohort_and_the_service_waits_for_every_member() -> None:
    p = planner()
    cohort = three_jobs(p)
    assert (cohort.job_id, cohort.node, cohort.cohort) == ("b", "rollout", (("c", 0, "rollout"),))
    assert p.counts()["cohorts_sent"] == 1 and p.counts()["cohort_members"] == 2
    svc = p.services["s0"]
    assert svc.cohort == {("b", 0, "rollout"), ("c", 0, "rollout")}
    assert [q.job_id for q in svc.queue] == ["a"]  # a's train waits; the cohort took c off the queue
    assert p.jobs["b"].nodes["rollout"] == p.jobs["c"].nodes["rollout"] == "running"
    # c ends first: the cohort still holds the service (b still runs), c's train queues behind a's
    assert runs(p.handle(NodeFinished("c", 0, "rollout", duration=0.4))) == []
    assert svc.running == ("b", 0, "rollout") and svc.cohort == {("b", 0, "rollout")}
    (after,) = runs(p.handle(NodeFinished("b", 0, "rollout", duration=0.6)))
    assert (after.job_id, after.node, after.cohort) == ("a", "train", ())  # free now: fifo, a's train first
    assert svc.cohort == set() and svc.running == ("a", 0, "train")


def test_the_lead_ending_first_hands_the_cohort_to_a_member_still_running() -> None:
    p = planner()
    three_jobs(p)
    assert runs(p.handle(NodeFinished("b", 0, "rollout", duration=0.6))) == []
    svc = p.services["s0"]
    assert svc.running == ("c", 0, "rollout") and svc.cohort == {("c", 0, "rollout")}
    assert len(runs(p.handle(NodeFinished("c", 0, "rollout", duration=0.4)))) == 1


def test_without_batch_rollouts_or_without_a_shared_batching_engine_every_rollout_runs_alone() -> None:
    off = Planner(clock=Clock(), validate=True)
    off.handle(ServiceJoined("s0"))
    assert three_jobs(off).cohort == () and off.counts()["cohorts_sent"] == 0
    # other engine keys, or an engine that cannot mix jobs (batch 0: a full-weights vLLM job), never join
    plans = {"a": plan(), "b": plan(), "c": plan(engine=("other", 1000))}
    assert three_jobs(planner(), plans).cohort == ()
    plans = {"a": plan(batch=0), "b": plan(batch=0), "c": plan(batch=0)}
    assert three_jobs(planner(), plans).cohort == ()


def test_the_engine_limit_caps_a_cohort() -> None:
    p = planner()
    plans = {j: plan(batch=2) for j in "abcd"}
    p.handle(JobSubmitted("a", plans["a"]))
    for j in "bcd":
        p.handle(JobSubmitted(j, plans[j]))
    (cohort,) = runs(p.handle(NodeFinished("a", 0, "rollout", duration=1.0)))
    assert cohort.cohort == (("c", 0, "rollout"),)  # b + c: two adapters per call, d waits
    assert sorted(q.job_id for q in p.services["s0"].queue) == ["a", "d"]


def test_a_member_whose_state_does_not_fit_beside_the_others_stays_queued() -> None:
    # the device holds the engine and two states: b, and c beside it; with room for one state, c waits
    roomy = planner(device=ENGINE[1] + 2 * 100)
    cohort = three_jobs(roomy)
    assert cohort.cohort == (("c", 0, "rollout"),)
    assert {m.job_id for m in cohort.swaps if m.dst == "device"} <= {"b", "c"}
    tight = planner(device=ENGINE[1] + 100)
    cohort = three_jobs(tight)
    assert cohort.job_id == "b" and cohort.cohort == ()
    assert sorted(q.job_id for q in tight.services["s0"].queue) == ["a", "c"]
    assert tight.services["s0"].state.on_device("b") and not tight.services["s0"].state.on_device("c")


def test_one_job_never_joins_its_own_cohort() -> None:
    nodes = {
        "p": NodePlan("cpu"),
        "r1": NodePlan("service", ("p",), batchable=True),
        "r2": NodePlan("service", ("p",), batchable=True),
    }
    p = planner()
    out = p.handle(JobSubmitted("x", plan(nodes=nodes)))
    assert isinstance(out[0], PlaceJob) and runs(out) == [RunNode("x", 0, "p", "cpu")]
    (first,) = runs(p.handle(NodeFinished("x", 0, "p", duration=0.1)))
    assert (first.node, first.cohort) == ("r1", ())
    assert [q.node for q in p.services["s0"].queue] == ["r2"]


def test_a_node_sent_ahead_with_nothing_of_its_engine_queued_goes_alone() -> None:
    p = planner(lookahead=True)
    p.handle(JobSubmitted("a", plan()))
    (ahead,) = runs(p.handle(JobSubmitted("b", plan())))  # a runs: b is sent to run right after it
    assert ahead.job_id == "b" and ahead.cohort == ()
    assert p.services["s0"].next == ("b", 0, "rollout")
    assert runs(p.handle(JobSubmitted("c", plan()))) == []  # one node sent ahead at a time
    p.handle(NodeFinished("a", 0, "rollout", duration=1.0))
    assert p.counts()["cohorts_sent"] == 0 and p.services["s0"].cohort == set()


def test_each_member_is_learned_and_accounted_at_its_share_of_the_cohort() -> None:
    p = planner()
    p.usage.add("", 0.0, 0.0)
    three_jobs(p)
    before = p.usage.value("", 0.0)
    (b, c) = shares(10.0, 11.0, [3.0, 1.0])  # the executor's split of a 1 s call: b 3/4, c 1/4
    assert b == (10.0, 10.75) and c == (10.75, 11.0)
    p.handle(NodeFinished("c", 0, "rollout", duration=c[1] - c[0]))
    p.handle(NodeFinished("b", 0, "rollout", duration=b[1] - b[0]))
    assert p.costs.predict("b", "rollout") == pytest.approx(0.75)  # its share, not the cohort's 1 s
    assert p.costs.predict("c", "rollout") == pytest.approx(0.25)
    assert p.usage.value("", 0.0) - before == pytest.approx(1.0)  # the service's second counted once


def test_shares_tile_the_span() -> None:
    spans = shares(0.0, 2.0, [1, 0, 3])
    assert spans == [(0.0, 0.5), (0.5, 0.5), (0.5, 2.0)]
    assert shares(1.0, 2.0, [0, 0]) == [(1.0, 1.5), (1.5, 2.0)]


def test_a_member_cancelled_mid_cohort_leaves_it_and_the_others_finish() -> None:
    from plexrl.planner import JobCancelled

    p = planner()
    three_jobs(p)
    svc = p.services["s0"]
    p.handle(JobCancelled("b"))  # the lead: c now stands for the cohort
    assert svc.running == ("c", 0, "rollout") and svc.cohort == {("c", 0, "rollout")}
    (nxt,) = runs(p.handle(NodeFinished("c", 0, "rollout", duration=0.4)))
    assert nxt.job_id == "a" and svc.cohort == set()


def test_batch_rollouts_runs_on_either_driver_and_is_refused_on_worker_groups_naming_the_fix() -> None:
    from pydantic import ValidationError

    from plexrl.runtime import InlineExecutor
    from plexrl.runtime.build import build_runner
    from plexrl.runtime.config import RuntimeConfig

    for driver in ("dask", "local"):
        section = RuntimeConfig.model_validate({"driver": driver, "batch_rollouts": True})
        assert build_runner(section, [], InlineExecutor()).planner.batch_rollouts
    with pytest.raises(ValidationError, match=r"services\.ranks: 1 or batch_rollouts: false"):
        RuntimeConfig.model_validate({"driver": "dask", "batch_rollouts": True, "services": {"ranks": 2}})
