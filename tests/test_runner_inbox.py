"""The runner's inbox (the only lock) and its arrivals, alone: no runner, no executor."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from plexrl.planner import JobCancelled
from plexrl.runtime.inbox import Arrivals, Inbox


@dataclass(frozen=True)
class Spec:
    job_id: str


def test_submit_refuses_a_name_in_use_or_already_queued_and_frees_it_when_told() -> None:
    box = Inbox()
    box.submit(Spec("a"))
    with pytest.raises(ValueError, match="'a' was already submitted"):
        box.submit(Spec("a"))  # queued
    assert box.take_submits() == [Spec("a")] and box.take_submits() == []
    box.name("a", True)  # the loop took it: its name is in use
    with pytest.raises(ValueError, match="unique name"):
        box.submit(Spec("a"))
    box.name("a", False)  # it failed or was cancelled: it may come again
    box.submit(Spec("a"))
    box.drop_submits()
    assert box.take_submits() == []


def test_cancels_are_taken_in_order_and_the_first_stop_reason_stands() -> None:
    box = Inbox()
    box.cancel("a", "x")
    box.cancel("b", "y")
    assert box.has_cancels()
    assert box.take_cancels() == [JobCancelled("a", "x"), JobCancelled("b", "y")] and not box.has_cancels()
    assert box.stopping is None
    box.stop("first")
    box.stop("second")
    assert box.stopping == "first"


def test_wait_returns_when_another_thread_submits() -> None:
    box = Inbox()
    box.wait(0.0)  # nothing queued: returns after the timeout
    done = threading.Event()

    def loop() -> None:
        box.wait()  # no timeout: until a request comes
        done.set()

    t = threading.Thread(target=loop)
    t.start()
    box.submit(Spec("late"))
    assert done.wait(timeout=10), "the waiting loop was not woken by submit"
    t.join(timeout=10)


def test_arrivals_come_in_time_order_ties_as_given_and_cancelled_ones_never() -> None:
    arr = Arrivals()
    arr.start([(2.0, "b"), (1.0, "a"), (2.0, "c"), (5.0, "d")])
    assert arr.next_time() == 1.0 and arr.waiting() == {"a", "b", "c", "d"}
    assert arr.due(0.5) == [] and arr.due(2.0) == ["a", "b", "c"]
    arr.drop({"d"})
    assert not arr and arr.due(10.0) == []
