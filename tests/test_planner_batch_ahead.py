"""Co-scheduled rollouts sent ahead (`Planner(batch_rollouts=True, lookahead=True)`, `planner/batches.py`):
while a node runs, the queued batchable rollouts of one engine go ahead as ONE cohort, every member resident
beside what runs, and run once it ends; an ended job leaves the cohort sent ahead. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from conftest import Clock

from plexrl.planner import JobCancelled, JobPlan, JobSubmitted, NodeFinished, NodePlan, Planner, RunNode, ServiceJoined

ENGINE = ("base+lora", 1000)
NODES = {"rollout": NodePlan("service", batchable=True), "train": NodePlan("service", ("rollout",))}


def runs(out: Sequence[object]) -> list[RunNode]:
    return [i for i in out if isinstance(i, RunNode)]


def four_jobs(device: int | None = None) -> tuple[Planner, RunNode]:
    """a's rollout runs, b's is sent ahead alone (nothing else was queued), c's and d's queue; when a's
    ends, b's runs and what the planner sends ahead is returned."""
    p = Planner(clock=Clock(), validate=True, batch_rollouts=True, lookahead=True)
    p.handle(ServiceJoined("s0", device_bytes=device))
    plan = JobPlan(NODES, iterations=2, order=tuple(NODES), state_bytes=100, engine=ENGINE, batch=4)
    assert [r.job_id for r in runs(p.handle(JobSubmitted("a", plan)))] == ["a"]
    (ahead,) = runs(p.handle(JobSubmitted("b", plan)))
    assert (ahead.job_id, ahead.cohort) == ("b", ())
    for j in "cd":
        assert runs(p.handle(JobSubmitted(j, plan))) == []  # one node or cohort ahead at a time
    (nxt,) = runs(p.handle(NodeFinished("a", 0, "rollout", duration=1.0)))
    return p, nxt


def test_queued_rollouts_go_ahead_as_one_cohort_and_run_when_the_node_before_them_ends() -> None:
    p, ahead = four_jobs()
    svc = p.services["s0"]
    assert (ahead.job_id, ahead.cohort) == ("c", (("d", 0, "rollout"),))
    assert svc.running == ("b", 0, "rollout") and svc.next == ("c", 0, "rollout")
    assert svc.next_cohort == {("c", 0, "rollout"), ("d", 0, "rollout")} and svc.cohort == set()
    assert p.counts()["cohorts_sent"] == 1 and p.counts()["cohort_members"] == 2 and p.counts()["sent_ahead"] == 2
    assert [q.job_id for q in svc.queue] == ["a"]  # a's train waits behind the cohort
    # b ends: the cohort runs, and a's train is sent ahead of... nothing: one ahead, after the cohort
    (train,) = runs(p.handle(NodeFinished("b", 0, "rollout", duration=1.0)))
    assert (train.job_id, train.node) == ("a", "train")
    assert svc.cohort == {("c", 0, "rollout"), ("d", 0, "rollout")} and svc.next_cohort == set()
    assert svc.running in svc.cohort and svc.next == ("a", 0, "train")
    assert runs(p.handle(NodeFinished("d", 0, "rollout", duration=0.5))) == []  # c still runs: the cohort holds
    p.handle(NodeFinished("c", 0, "rollout", duration=0.5))
    assert svc.running == ("a", 0, "train") and svc.cohort == set()


def test_a_cohort_sent_ahead_takes_only_the_members_that_fit_beside_what_runs() -> None:
    # the shared engine takes 1000 bytes of the device once; each job's state 100
    p, ahead = four_jobs(device=1300)  # b runs: two more fit beside it, a is evicted to make room
    assert (ahead.job_id, ahead.cohort) == ("c", (("d", 0, "rollout"),))
    assert not p.services["s0"].state.on_device("a")
    p, ahead = four_jobs(device=1200)  # room for one beside b: c goes ahead alone, d stays queued
    assert (ahead.job_id, ahead.cohort) == ("c", ())
    assert [q.job_id for q in p.services["s0"].queue if q.node == "rollout"] == ["d"]


def test_a_job_cancelled_in_a_cohort_sent_ahead_leaves_it_and_the_others_still_run() -> None:
    p, _ = four_jobs()
    svc = p.services["s0"]
    p.handle(JobCancelled("c"))
    assert svc.next == ("d", 0, "rollout") and svc.next_cohort == {("d", 0, "rollout")}
    (train,) = runs(p.handle(JobCancelled("d")))  # the slot ahead is free again: a's train takes it
    assert svc.next_cohort == set() and svc.next == ("a", 0, "train") == (train.job_id, 0, train.node)
    p.handle(NodeFinished("b", 0, "rollout", duration=1.0))
    assert svc.running == ("a", 0, "train") and svc.cohort == set()


# rollout -> verify (cpu) -> train
GAPPY = {
    "rollout": NodePlan("service", batchable=True),
    "verify": NodePlan("cpu", ("rollout",)),
    "train": NodePlan("service", ("verify",)),
}


def train_running(iterations: int) -> tuple[Planner, JobPlan, list[object]]:
    """Job c's rollout and verify have run: its train runs (what that last event sent is returned)."""
    p = Planner(clock=Clock(), validate=True, batch_rollouts=True, lookahead=True)
    p.handle(ServiceJoined("s0"))
    plan = JobPlan(GAPPY, iterations=iterations, order=tuple(GAPPY), state_bytes=100, engine=ENGINE, batch=4)
    p.handle(JobSubmitted("c", plan))
    p.handle(NodeFinished("c", 0, "rollout", duration=1.0))
    return p, plan, p.handle(NodeFinished("c", 0, "verify", duration=0.5))


def test_a_rollout_waits_to_go_ahead_when_a_partner_of_its_engine_is_due_before_the_running_node_ends() -> None:
    p, plan, out = train_running(iterations=2)
    (train,) = runs(out)
    assert (train.job_id, train.node) == ("c", "train")  # c's train runs; c's next service node is a rollout
    assert runs(p.handle(JobSubmitted("b", plan))) == []  # b's rollout is held, not sent ahead alone
    assert p.services["s0"].next is None
    (cohort,) = runs(p.handle(NodeFinished("c", 0, "train", duration=1.0)))
    assert (cohort.job_id, cohort.cohort) == ("b", (("c", 1, "rollout"),))  # one engine call for both


def test_a_rollout_with_no_partner_due_still_goes_ahead_alone() -> None:
    p, plan, _ = train_running(iterations=1)  # c's train runs: its last service node
    (ahead,) = runs(p.handle(JobSubmitted("b", plan)))
    assert (ahead.job_id, ahead.node, ahead.cohort) == ("b", "rollout", ())
