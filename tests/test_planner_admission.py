"""Job-level policy in the planner, tested by feeding events with no cluster and no clock of its own (docs
invariant 1): per-user admission and quotas as planner state (`planner/admission.py`: held jobs, their reasons
as `JobHeld` instructions, the quota's release as a `wake_at` instead of a poll), fair admission (users first,
and a user with no job running squeezed in past the load cap), whether a job of a lost service is placed again
(`FailJob.again`, from its plan's `attempt` and `attempts`), and the read API (`Planner.view`)."""

from __future__ import annotations

import math
from dataclasses import replace

from plexrl.planner import (
    FailJob,
    JobCancelled,
    JobHeld,
    JobPlan,
    JobSubmitted,
    NodePlan,
    PlaceJob,
    Planner,
    ServiceJoined,
    ServiceLost,
    SpreadBackfill,
    Tick,
)
from plexrl.planner.admission import UserLimits, share
from plexrl.planner.shares import Usage

PLAN = JobPlan(nodes={"rollout": NodePlan("service"), "train": NodePlan("service", ("rollout",))}, iterations=3,
               order=("rollout", "train"), state_bytes=10)  # fmt: skip


class Now:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def of(user: str, **changes: object) -> JobPlan:
    return replace(PLAN, user=user, **changes)  # type: ignore[arg-type]


def placed(out: list[object]) -> list[str]:
    return [i.job_id for i in out if isinstance(i, PlaceJob)]


def held(out: list[object]) -> dict[str, str]:
    return {i.job_id: i.reason for i in out if isinstance(i, JobHeld)}


def test_a_users_limit_holds_their_extra_jobs_and_lets_another_user_in() -> None:
    p = Planner(clock=Now(), user_limits=UserLimits(max_jobs=1), validate=True)
    p.handle(ServiceJoined("s0"))
    assert placed(p.handle(JobSubmitted("a1", of("ann")))) == ["a1"]
    out = p.handle(JobSubmitted("a2", of("ann")))
    assert placed(out) == [] and held(out) == {"a2": "waiting: user 'ann' has 1 job(s) running, the limit is 1"}
    assert set(p.view().unplaced()) == {"a2"} and {j.job_id: j.held for j in p.view().jobs}["a2"].startswith("waiting")
    out = p.handle(JobSubmitted("a3", of("ann")))
    assert placed(out) == [] and set(held(out)) == {"a3"}  # only the change is an instruction
    assert placed(p.handle(JobSubmitted("b1", of("bob")))) == ["b1"]  # another user's job goes in at once
    out = p.handle(JobCancelled("a2"))  # withdrawn while held: frees no slot, no longer held
    assert placed(out) == [] and held(out) == {"a2": ""}
    out = p.handle(JobCancelled("a1"))  # ann's running job ends: her next one goes in, in arrival order
    assert placed(out) == ["a3"] and held(out) == {"a3": ""}
    assert p.held == {} and p.view().unplaced() == {}


def test_a_quota_holds_a_user_over_it_and_lets_the_job_in_when_the_share_has_decayed_no_poll() -> None:
    now, usage = Now(), Usage(half_life=100.0)
    usage.add("ann", 300.0, now=0.0)  # ann's jobs used the one service hard
    p = Planner(clock=now, usage=usage, user_limits=UserLimits(max_share=0.5), validate=True)
    p.handle(ServiceJoined("s0"))
    assert placed(p.handle(JobSubmitted("a1", of("ann")))) == ["a1"]  # nothing running: one job always goes in
    out = p.handle(JobSubmitted("a2", of("ann")))
    why = held(out)["a2"]
    assert placed(out) == [] and "uses 208% of the accelerator-seconds" in why and "the quota is 50%" in why
    assert placed(p.handle(JobSubmitted("b1", of("bob")))) == ["b1"]  # bob is not over it
    release = p.wake_at
    assert release is not None and release > 0  # the planner says when, the runner sends a Tick then
    assert math.isclose(share(usage, "ann", release, 1), 0.5, rel_tol=1e-6) and share(usage, "ann", release, 1) < 0.5
    now.t = release - 1.0
    assert placed(p.handle(Tick())) == [] and p.wake_at == release  # too early: still held
    now.t = release
    out = p.handle(Tick())
    assert placed(out) == ["a2"] and held(out) == {"a2": ""} and p.wake_at is None


def test_fair_admission_weighs_users_first_and_squeezes_in_a_user_with_nothing_running() -> None:
    """Without it (FIFO, the load cap kept): ann's two jobs fill the service and bob's single job waits behind
    her third."""
    # a load cap that admits two jobs of these (each predicted busy 100% of its iterations) per service
    unfair = Planner(clock=Now(), placement=SpreadBackfill(max_load=2.0), validate=True)
    fair = Planner(clock=Now(), placement=SpreadBackfill(max_load=2.0), fair_admission=True, validate=True)
    got = {}
    for name, p in (("unfair", unfair), ("fair", fair)):
        p.handle(ServiceJoined("s0"))
        out = p.handle(JobSubmitted("a1", of("ann"))) + p.handle(JobSubmitted("a2", of("ann")))
        out += p.handle(JobSubmitted("a3", of("ann"))) + p.handle(JobSubmitted("b1", of("bob")))
        got[name] = placed(out)
    assert got["unfair"] == ["a1", "a2"]  # the cap then keeps everyone out
    assert got["fair"] == ["a1", "a2", "b1"]  # bob runs nothing while ann runs two: he gets one in
    (svc,) = fair.view().services
    assert set(fair.view().unplaced()) == {"a3"} and svc.running == ("a1", "rollout")
    assert svc.waiting == (("a2", "rollout"), ("b1", "rollout"))


def test_a_job_of_a_lost_service_is_placed_again_while_it_has_attempts_left() -> None:
    p = Planner(clock=Now(), validate=True)
    p.handle(ServiceJoined("s0"))
    p.handle(ServiceJoined("s1"))
    p.handle(JobSubmitted("j1", of("", attempt=1, attempts=3)))
    p.handle(JobSubmitted("j2", of("", attempt=3, attempts=3)))
    p.handle(JobSubmitted("j3", of("")))  # one placement only (a cluster run's)
    lost = {j.service for j in p.jobs.values()}
    fails: dict[str, FailJob] = {}
    for service in sorted(s for s in lost if s):
        fails |= {i.job_id: i for i in p.handle(ServiceLost(service, "worker died")) if isinstance(i, FailJob)}
    assert set(fails) == {"j1", "j2", "j3"} and all(f.service_lost for f in fails.values())
    assert fails["j1"].again and not fails["j2"].again and not fails["j3"].again
    assert fails["j2"].reason.endswith("(attempt 3 of at most 3: not placed again)")
    assert fails["j3"].reason == "service 's0' lost: worker died" or "not placed again" not in fails["j3"].reason


def test_the_view_is_a_frozen_copy_of_queues_and_jobs() -> None:
    p = Planner(clock=Now(), validate=True)
    p.handle(ServiceJoined("s0"))
    p.handle(JobSubmitted("j1", of("ann")))
    p.handle(JobSubmitted("j2", of("bob")))
    view = p.view()
    (svc,) = view.services
    assert (svc.running, svc.waiting, view.unplaced()) == (("j1", "rollout"), (("j2", "rollout"),), {})
    assert [(j.job_id, j.user, j.status, j.service, j.iteration) for j in view.jobs] == [
        ("j1", "ann", "running", "s0", 0), ("j2", "bob", "running", "s0", 0)
    ]  # fmt: skip
    p.handle(JobCancelled("j2"))
    assert view.waiting() == {"s0": (("j2", "rollout"),)}  # the copy did not move
    assert p.view().waiting() == {"s0": ()} and p.view().jobs[1].status == "cancelled"
