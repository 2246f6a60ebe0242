"""The runner's carrier (`runtime/carrier.py`): one table from instruction to executor call, reports back as the
planner's events, and a job whose work fails outside a node fails alone. On a `SimExecutor` (the real part is
cheap), with no runner and no planner loop."""

from __future__ import annotations

import typing

from plexrl.hooks.base import HookList
from plexrl.planner import FailJob, JobFailed, JobSubmitted, PlaceJob, Planner, RunNode, StateMeasured
from plexrl.planner.events import Instruction
from plexrl.runtime.carrier import Carrier
from plexrl.runtime.inbox import Inbox
from plexrl.runtime.sim import SeededCosts, SimExecutor, grpo_like_jobs


def carrier(executor: SimExecutor) -> Carrier:
    return Carrier(executor, HookList(), Planner(clock=executor.clock), Inbox())


def test_every_instruction_has_exactly_one_handler() -> None:
    c = carrier(SimExecutor(1, SeededCosts()))
    assert set(c._table) == set(typing.get_args(Instruction))


def test_a_load_becomes_a_measured_state_and_a_failed_load_fails_the_job_alone() -> None:
    ex = SimExecutor(1, SeededCosts())
    c = carrier(ex)
    good, bad = grpo_like_jobs(2, (2, 2), seed=0)
    for spec in (good, bad):
        (submitted,) = c.ship(c.new_run(spec))
        assert isinstance(submitted, JobSubmitted) and submitted.job_id == spec.job_id
    assert c.carry_out(PlaceJob(good.job_id, "service-0")) == []
    (finished,) = ex.wait(float("inf"))
    assert c.collect(finished) == [StateMeasured("service-0", good.job_id, good.state_bytes)]
    assert c.runs[good.job_id].status == "running" and c.runs[good.job_id].service == "service-0"

    def broken(job_id: str, service_id: str, tier: str) -> int:
        raise OSError("no room on the device")

    ex.load = broken  # type: ignore[method-assign]
    (failed,) = c.carry_out(PlaceJob(bad.job_id, "service-0"))
    assert (
        isinstance(failed, JobFailed)
        and failed.reason == "loading the job on service-0: OSError: no room on the device"
    )
    # until the planner's FailJob comes back, the job's other instructions are dropped
    assert c.carry_out(RunNode(bad.job_id, 0, "prompts", "cpu")) == [] and not c.ledger
    c.carry_out(FailJob(bad.job_id, failed.reason, "service-0"))
    assert c.runs[bad.job_id].status == "failed" and c.runs[good.job_id].status == "running"
    assert bad.job_id not in c.failing


def test_a_job_that_cannot_be_shipped_fails_alone_and_its_name_is_free_again() -> None:
    ex = SimExecutor(1, SeededCosts())
    c = carrier(ex)
    (spec,) = grpo_like_jobs(1, (2, 2), seed=1)

    def refuse(spec: object) -> None:
        raise ValueError("the spec does not pickle")

    ex.ship = refuse  # type: ignore[method-assign]
    run = c.new_run(spec, late=True)
    assert c.ship(run) == []
    assert (
        run.status == "failed"
        and run.error == "could not ship the job to the executor: ValueError: the spec does not pickle"
    )
    c.inbox.submit(spec)  # its name may be used again (it failed)
    assert [s.job_id for s in c.inbox.take_submits()] == [spec.job_id]


class CohortKeeper(SimExecutor):
    """The simulator, with a `submit_cohort` that keeps what it was given (each task then runs as submitted)."""

    def __init__(self) -> None:
        super().__init__(1, SeededCosts())
        self.cohorts: list[list[object]] = []

    def submit_cohort(self, tasks: list[typing.Any]) -> list[int]:
        self.cohorts.append(list(tasks))
        return [self.submit(t) for t in tasks]


def placed(ex: SimExecutor) -> tuple[Carrier, list[str]]:
    c = carrier(ex)
    specs = grpo_like_jobs(2, (2, 2), seed=0)
    for spec in specs:
        c.ship(c.new_run(spec))
        c.carry_out(PlaceJob(spec.job_id, "service-0"))
    for f in ex.wait(float("inf")):
        c.collect(f)
    return c, [s.job_id for s in specs]


def test_a_cohort_goes_to_the_executor_as_one_call_and_a_failing_lead_leaves_the_others_running() -> None:
    from plexrl.planner import Move

    ex = CohortKeeper()
    c, (a, b) = placed(ex)
    swap = (Move(b, "host", "device", 1),)
    cohort = RunNode(a, 0, "rollout", "service", "service-0", swap, cohort=((b, 0, "rollout"),))
    assert c.carry_out(cohort) == []
    (sent,) = ex.cohorts
    assert [(t.job_id, t.swaps) for t in sent] == [(a, swap), (b, ())]  # type: ignore[attr-defined]
    nodes = [(p.job_id, p.node) for p in c.ledger.pending.values() if p.kind == "node"]
    assert sorted(nodes) == [(a, "rollout"), (b, "rollout")]  # a handle each
    c.failing.add(a)  # a's job is being failed: its cohort still runs b's rollout, with the cohort's swaps
    assert c.carry_out(cohort) == []
    assert [(t.job_id, t.swaps) for t in ex.cohorts[-1]] == [(b, swap)]  # type: ignore[attr-defined]


def test_an_executor_that_cannot_run_cohorts_fails_their_jobs_naming_the_local_driver() -> None:
    c, (a, b) = placed(SimExecutor(1, SeededCosts()))
    events = c.carry_out(RunNode(a, 0, "rollout", "service", "service-0", cohort=((b, 0, "rollout"),)))
    assert [e.job_id for e in events] == [a, b]  # type: ignore[union-attr]
    assert all(isinstance(e, JobFailed) and "driver: local" in e.reason for e in events)
