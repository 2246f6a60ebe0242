"""Exclusive time-slicing (the llm-d / OpenRL design, `policies.TimeSlicing` + `StateManager(exclusive=True)`) as a
pure planner: feed events, compare instructions. No cluster; an injected clock."""

from __future__ import annotations

import itertools

import pytest
from conftest import Clock

from plexrl.planner import (
    Hrrs,
    JobDone,
    JobPlan,
    JobSubmitted,
    NodeFinished,
    NodePlan,
    Planner,
    RunNode,
    ServiceJoined,
    StateManager,
)
from plexrl.planner.policies import Fifo, TimeSlicing
from plexrl.planner.settings import policies_of
from plexrl.planner.state import Move

MB = 2**20

# a phase of two service nodes: rollout, then the reference logprobs right after it (no CPU work between)
PHASED = JobPlan(
    nodes={
        "rollout": NodePlan("service"),
        "ref": NodePlan("service", ("rollout",)),
        "verify": NodePlan("cpu", ("rollout",)),
        "train": NodePlan("service", ("verify", "ref")),
    },
    iterations=2,
    order=("rollout", "ref", "verify", "train"),
    state_bytes=10 * MB,
)
SIMPLE = JobPlan(
    nodes={
        "rollout": NodePlan("service"),
        "verify": NodePlan("cpu", ("rollout",)),
        "train": NodePlan("service", ("verify",)),
    },
    iterations=3,
    order=("rollout", "verify", "train"),
    state_bytes=10 * MB,
)


def planner(ordering: object, clock: Clock | None = None, **kw: object) -> Planner:
    return Planner(clock=clock or Clock(1.0), ordering=ordering, validate=True, **kw)  # type: ignore[arg-type]


def service_runs(out: list[object]) -> list[RunNode]:
    return [i for i in out if isinstance(i, RunNode) and i.runs_on == "service"]


def finish(p: Planner, i: RunNode, duration: float = 1.0) -> list[object]:
    return p.handle(NodeFinished(i.job_id, i.iteration, i.node, duration=duration))


def test_the_lock_holder_keeps_the_service_for_its_phase_while_fifo_hands_it_over() -> None:
    """a's rollout runs; b's rollout becomes ready (queued first); when a's rollout ends, a's ref (the same phase)
    runs before b's rollout under time-slicing, and after it under plain FIFO."""
    order = {}
    for name, policy in (("time-slicing", TimeSlicing()), ("fifo", Fifo())):
        p = planner(policy)
        p.handle(ServiceJoined("s0"))
        (ra,) = service_runs(p.handle(JobSubmitted("a", PHASED)))
        assert service_runs(p.handle(JobSubmitted("b", PHASED))) == []  # b's rollout waits for the lock
        out = finish(p, ra)
        order[name] = [(i.job_id, i.node) for i in service_runs(out)]
    assert order["time-slicing"] == [("a", "ref")]
    assert order["fifo"] == [("b", "rollout")]


def test_waiters_get_the_lock_in_ready_order_not_by_ratio() -> None:
    """HRRS serves the short, resident node first; time-slicing serves the node that became ready first."""
    picks = {}
    for name, policy in (("time-slicing", TimeSlicing()), ("hrrs", Hrrs())):
        clock = Clock(0.0)
        p = planner(policy, clock)
        p.handle(ServiceJoined("s0"))
        long = JobPlan.of({"gen": NodePlan("service")}, 1, state_bytes=MB, costs={"gen": 50.0})
        short = JobPlan.of({"gen": NodePlan("service")}, 1, state_bytes=MB, costs={"gen": 0.1})
        (first,) = service_runs(p.handle(JobSubmitted("x", short)))  # x holds the service
        clock.t = 1.0
        p.handle(JobSubmitted("long", long))  # ready at 1.0
        clock.t = 2.0
        p.handle(JobSubmitted("short", short))  # ready at 2.0
        clock.t = 3.0
        (nxt,) = service_runs(finish(p, first, 0.1))
        picks[name] = nxt.job_id
    assert picks == {"time-slicing": "long", "hrrs": "short"}


def test_each_hand_over_moves_the_whole_state_out_and_in_with_no_prefetch() -> None:
    """The device holds two states. Time-slicing still moves the holder's state to host at every hand-over and
    the next one's in, and never prefetches; the planned mode keeps both resident after the first swap-ins."""
    moved: dict[str, list[Move]] = {}
    for name, policy in (("time-slicing", TimeSlicing()), ("hrrs", Hrrs())):
        p = planner(policy, exclusive=name == "time-slicing")
        p.handle(ServiceJoined("s0", device_bytes=20 * MB, host_bytes=100 * MB))
        todo = service_runs(p.handle(JobSubmitted("a", SIMPLE))) + service_runs(p.handle(JobSubmitted("b", SIMPLE)))
        runs = [(r, frozenset[str]()) for r in todo]  # each service node with the jobs ended before it was sent
        cpu: list[RunNode] = []
        ended: set[str] = set()
        while todo or cpu:
            i = todo.pop(0) if todo else cpu.pop(0)
            out = finish(p, i)
            ended |= {o.job_id for o in out if isinstance(o, JobDone)}
            runs += [(o, frozenset(ended)) for o in service_runs(out)]
            todo += service_runs(out)
            cpu += [o for o in out if isinstance(o, RunNode) and o.runs_on == "cpu"]
        assert p.finished
        service = [r for r, _ in runs]
        if name == "time-slicing":
            assert all(not r.prefetch for r in service)
            prev = None
            for r, gone in runs:
                if prev is not None and r.job_id != prev and prev not in gone:  # a hand-over: the holder out, whole
                    assert r.swaps == (Move(prev, "device", "host", 10 * MB), Move(r.job_id, "host", "device", 10 * MB))
                elif prev is not None and r.job_id == prev:
                    assert r.swaps == ()  # the same job takes the lock again: nothing moves
                prev = r.job_id
            assert sum(r.job_id != q.job_id for q, r in itertools.pairwise(service)) >= 2
        moved[name] = [m for r in service for m in (*r.swaps, *r.prefetch)]
    assert len(moved["hrrs"]) <= 1  # b admitted to device beside a (or swapped in once): no more moves
    assert len(moved["time-slicing"]) >= 4


def test_the_next_chunk_of_a_node_continues_the_phase() -> None:
    chunked = JobPlan(
        nodes={"rollout": NodePlan("service", chunks=2), "train": NodePlan("service", ("rollout",))},
        iterations=1,
        state_bytes=MB,
    )
    p = planner(TimeSlicing())
    p.handle(ServiceJoined("s0"))
    (first,) = service_runs(p.handle(JobSubmitted("a", chunked)))
    p.handle(JobSubmitted("b", chunked))  # b's first chunk waits
    (second,) = service_runs(finish(p, first))
    assert (second.job_id, second.chunk) == ("a", 1)
    (train,) = service_runs(finish(p, second))
    assert (train.job_id, train.node) == ("a", "train")  # train follows the rollout with no cpu work: same phase
    (other,) = service_runs(finish(p, train))
    assert (other.job_id, other.node, other.chunk) == ("b", "rollout", 0)


def test_exclusive_state_manager_keeps_one_state_on_device() -> None:
    sm = StateManager("s0", {"device": 30 * MB, "host": 30 * MB, "disk": None}, exclusive=True)
    assert sm.admit("a", 10 * MB) == "device"
    assert sm.admit("b", 10 * MB) == "host"  # room on device, but a holds it
    assert sm.prefetch("b", {"b": 1.0, "a": 9.0}, set()) == []
    assert sm.make_resident("b", {"a": 1.0}, set()) == [
        Move("a", "device", "host", 10 * MB),
        Move("b", "host", "device", 10 * MB),
    ]
    sm.validate()
    planned = StateManager("s0", {"device": 30 * MB, "host": 30 * MB, "disk": None})
    assert planned.admit("a", 10 * MB) == planned.admit("b", 10 * MB) == "device"


def test_policies_of_time_slicing_turns_off_lookahead_and_fair_share() -> None:
    from plexrl.runtime.config import RuntimeConfig

    kw = policies_of(RuntimeConfig(ordering="time-slicing", driver="local", fair_share=True))
    assert isinstance(kw["ordering"], TimeSlicing) and kw["exclusive"] is True
    dask = policies_of(RuntimeConfig(ordering="time-slicing"))
    assert dask["lookahead"] is False
    plain = policies_of(RuntimeConfig())
    assert plain["lookahead"] is True and plain["exclusive"] is False
    assert policies_of(RuntimeConfig(state_moves="exclusive"))["exclusive"] is True
    assert Planner.from_config(RuntimeConfig(ordering="time-slicing"), Clock()).exclusive


def test_time_slicing_refuses_co_scheduled_rollouts_naming_the_fix() -> None:
    from pydantic import ValidationError

    from plexrl.runtime.config import RuntimeConfig

    with pytest.raises(ValidationError, match="batch_rollouts: false"):
        RuntimeConfig(ordering="time-slicing", batch_rollouts=True)
