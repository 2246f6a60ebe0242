"""The runner's handle ledger alone, fed fake reports: which handles it keeps, which it hands back to forget,
and the planner events it makes. No executor, no runner."""

from __future__ import annotations

from plexrl.planner import NodeFinished
from plexrl.reports import NodeReport
from plexrl.runtime.executor import NodeTask
from plexrl.runtime.ledger import Ledger
from plexrl.runtime.records import Iteration, Pending


def node(job: str, name: str, lane: str = "s0", chunk: int = 0, chunks: int = 1) -> Pending:
    task = NodeTask(job, 0, name, lane, chunk=chunk, chunks=chunks)
    return Pending("node", job, lane, 0, name, task)


def report(job: str, name: str, start: float, end: float, error: str | None = None) -> NodeReport:
    return NodeReport(job, 0, name, error, start, end, swap_start=start, swap_end=start + 0.5, swap_bytes=7,
                      metrics={"loss": 1.5})  # fmt: skip


def test_a_finished_node_becomes_the_iterations_output_and_an_event() -> None:
    led = Ledger()
    led.iters["j"] = Iteration(0.0)
    led.sent(1, node("j", "train"))
    p = led.take(1)
    assert p is not None and not led and led.take(1) is None  # taken once; a late report finds nobody
    event, forget = led.node_report(1, p, report("j", "train", 1.0, 3.0))
    assert event == NodeFinished("j", 0, "train", True, None, 2.0, 7, 0.5) and forget == []
    it = led.iters["j"]
    assert it.outputs == {"train": 1} and it.metrics == {"train": {"loss": 1.5}} and it.seconds == {"train": 2.0}


def test_chunks_are_kept_until_the_last_one_joins_them() -> None:
    led = Ledger()
    led.iters["j"] = Iteration(0.0)
    for h, chunk in ((1, 0), (2, 1)):
        event, forget = led.node_report(h, node("j", "roll", chunk=chunk, chunks=3), report("j", "roll", 0, 1))
        assert event.ok and forget == []
    event, forget = led.node_report(3, node("j", "roll", chunk=2, chunks=3), report("j", "roll", 0, 1))
    it = led.iters["j"]
    assert forget == [1, 2] and it.outputs == {"roll": 3} and it.parts == {} and it.seconds == {"roll": 3.0}


def test_a_paused_slice_is_forgotten_and_its_seconds_add_up_to_the_last_slices() -> None:
    led = Ledger()
    led.iters["j"] = Iteration(0.0)
    for h in (1, 2):  # two slices of a sliced rollout that paused: no output, no metrics, seconds counted
        paused = NodeReport("j", 0, "roll", None, 0.0, 1.0, paused=True)
        event, forget = led.node_report(h, node("j", "roll"), paused)
        assert event == NodeFinished("j", 0, "roll", True, None, 1.0, paused=True) and forget == [h]
    event, forget = led.node_report(3, node("j", "roll"), report("j", "roll", 0, 1))
    it = led.iters["j"]
    assert not event.paused and forget == [] and it.outputs == {"roll": 3} and it.seconds == {"roll": 3.0}
    assert it.metrics == {"roll": {"loss": 1.5}}


def test_a_failed_node_hands_back_its_output_and_its_parts() -> None:
    led = Ledger()
    led.iters["j"] = Iteration(0.0)
    led.node_report(1, node("j", "roll", chunk=0, chunks=2), report("j", "roll", 0, 1))
    event, forget = led.node_report(2, node("j", "roll", chunk=1, chunks=2), report("j", "roll", 1, 2, "OOM"))
    assert event == NodeFinished("j", 0, "roll", ok=False, error="OOM", duration=1.0)
    assert forget == [2, 1] and led.iters["j"].outputs == {}


def test_a_report_of_a_job_with_no_iteration_is_forgotten_at_once() -> None:
    event, forget = Ledger().node_report(5, node("gone", "verify", lane="cpu"), report("gone", "verify", 0, 1))
    assert event.ok and forget == [5]


def test_drops_by_lane_by_job_after_a_failed_load_and_at_a_stop() -> None:
    led = Ledger()
    led.iters["a"] = Iteration(0.0)
    led.sent(1, node("a", "x", lane="s0"))
    led.sent(2, node("b", "y", lane="s1"))
    led.sent(3, Pending("load", "b", "s1"))
    led.sent(4, node("c", "z", lane="s1"))
    led.lost("s0")
    assert set(led.pending) == {2, 3, 4}
    assert led.drop_nodes("b") == [2] and set(led.pending) == {3, 4}  # the load itself was taken already
    assert led.drop_job("a") == [] and "a" not in led.iters
    assert sorted(led.drop_all()) == [3, 4] and not led
