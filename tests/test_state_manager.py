"""The StateManager and the cost model as pure objects: budgets, victims by next use, spills, prefetch."""

from __future__ import annotations

import math

import pytest

from plexrl.planner import CostModel, Move, NoRoom, StateManager

MB = 2**20


def manager(device: int | None = 2 * MB, host: int | None = 2 * MB, disk: int | None = None) -> StateManager:
    return StateManager("s0", {"device": device, "host": host, "disk": disk})


def test_admit_fills_the_fastest_tier_with_room() -> None:
    sm = manager()
    assert [sm.admit(j, MB) for j in "abcde"] == ["device", "device", "host", "host", "disk"]
    assert sm.used("device") == 2 * MB and sm.free("host") == 0 and sm.free("disk") == math.inf
    assert not manager(device=MB).fits(2 * MB) and not manager(device=MB).can_ever_run(2 * MB)
    full = manager(disk=0)
    for j in "abcd":
        full.admit(j, MB)
    assert not full.fits(MB) and full.admit("e", MB) is None
    with pytest.raises(ValueError, match="already has state"):
        full.admit("a", MB)


def test_swap_in_evicts_the_job_needed_last_and_spills_only_when_host_is_full() -> None:
    sm = manager()
    for j in "abcd":
        sm.admit(j, MB)  # a, b on device; c, d on host
    moves = sm.make_resident("c", {"a": 5.0, "b": 1.0, "c": 0.0, "d": 3.0}, set())
    # a is needed last of the device residents; host is full (c leaves it only after a is out), so a goes
    # straight to disk
    assert moves == [Move("a", "device", "disk", MB), Move("c", "host", "device", MB)]
    assert sm.where == {"a": "disk", "b": "device", "c": "device", "d": "host"}
    sm.validate()
    assert sm.make_resident("c", {}, set()) == []  # already there
    sm.release("c")
    moves = sm.make_resident("a", {"a": 0.0, "b": 2.0, "d": 1.0}, set())
    assert moves == [Move("a", "disk", "device", MB)]  # room freed by c: no eviction
    sm.admit("e", MB)  # the device is full again (b, a); host has room
    assert sm.where["e"] == "host" and sm.used("host") == 2 * MB


def test_demotion_makes_room_one_tier_further_down() -> None:
    sm = manager(device=MB, host=MB, disk=None)
    sm.admit("a", MB)
    sm.admit("b", MB)
    sm.admit("c", MB)  # a device, b host, c disk
    moves = sm.make_resident("c", {"a": 1.0, "b": 9.0, "c": 0.0}, set())
    # a must leave the device; host is full and b is needed later than a, so b spills to disk, a to host
    assert moves == [Move("b", "host", "disk", MB), Move("a", "device", "host", MB), Move("c", "disk", "device", MB)]


def test_pinned_jobs_are_never_victims() -> None:
    sm = manager(device=MB, host=None)
    sm.admit("a", MB)
    sm.admit("b", MB)
    with pytest.raises(NoRoom, match="do not fit"):
        sm.make_resident("b", {"a": 9.0}, {"a"})
    assert sm.where == {"a": "device", "b": "host"}  # nothing half-moved


def test_prefetch_only_evicts_jobs_needed_later() -> None:
    sm = manager(device=2 * MB, host=None)
    for j in "abc":
        sm.admit(j, MB)  # a, b device; c host
    assert sm.prefetch("c", {"a": 0.0, "b": 0.5, "c": 1.0}, {"a"}) == []  # b is needed sooner than c
    assert sm.where["c"] == "host"
    moves = sm.prefetch("c", {"a": 0.0, "b": 4.0, "c": 1.0}, {"a"})
    assert moves == [Move("b", "device", "host", MB), Move("c", "host", "device", MB)]
    assert sm.prefetch("c", {}, set()) == []


def test_cost_model_learns_durations_and_bandwidth() -> None:
    cm = CostModel(alpha=0.5, prior_seconds=0.2, bandwidth=1e9)
    assert cm.predict("a", "rollout") == 0.2 and not cm.observed("a", "rollout")
    cm.observe("a", "rollout", 1.0)
    cm.observe("a", "rollout", 3.0)
    assert cm.predict("a", "rollout") == pytest.approx(2.0)
    assert cm.predict("b", "rollout") == pytest.approx(2.0)  # another job's observations are the prior
    assert cm.swap_seconds(10**9) == pytest.approx(1.0)
    cm.observe_swap(4 * 10**9, 1.0)
    assert cm.swap_seconds(4 * 10**9) == pytest.approx(1.0)
    cm.forget("a")
    assert not cm.observed("a", "rollout") and cm.predict("a", "rollout") == pytest.approx(2.0)


def test_a_new_engine_is_refused_where_it_would_leave_a_placed_state_no_room_to_run() -> None:
    """Found by the planner's property test: a 100-byte state on a 100-byte device, then a job whose vLLM-like
    engine (30 bytes) would stay on device: the first job could never run again."""
    sm = StateManager("s0", {"device": 100, "host": 1000, "disk": None})
    assert sm.admit("big", 100) == "device"
    assert sm.fits(0, ("engine", 30)) is False and sm.admit("small", 0, ("engine", 30)) is None
    assert sm.fits(0) is True  # without an engine it may come (on host)
    sm.release("big")
    assert sm.admit("small", 0, ("engine", 30)) == "device"
