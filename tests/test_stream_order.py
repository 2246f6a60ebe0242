"""Stream ordering of a service's state moves (docs/gpu.md, "Streams and swaps"), checked on CPU through the calls the
service makes to its `StreamOrder` (`plexrl/services/streams.py`), recorded by `RecordingOrder`:

- every copy of a job's tensors, on the node's thread or the background thread, is issued after that thread
  waited for the job's LAST node event, and that event is the one the job's last node recorded (not its
  load's): on CUDA, a background eviction then never reads a state the optimizer is still writing;
- every device buffer a background swap-in allocates is marked for the compute stream (`record_stream` on
  CUDA), so the caching allocator cannot hand it to another job's copy while the compute stream uses it;
- a node's end time is taken after its device work is done (`node_end` returns first), so its GPU tail is
  booked to it and not to the next node's swap or busy time.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from conftest import TINY, Clock

from plexrl.job.load import load_job
from plexrl.job.spec import JobSpec, prepare_job
from plexrl.planner.state import Move
from plexrl.services.service import Service
from plexrl.services.streams import HostOrder, RecordingOrder, stream_order


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> JobSpec:
    cfg: dict[str, Any] = copy.deepcopy(TINY)
    cfg["run_dir"] = str(tmp_path_factory.mktemp("order") / "runs")
    cfg["tracking"]["mlflow"] = False
    return prepare_job(load_job(cfg))


class TimedOrder(RecordingOrder):
    """Also notes the service clock's reading when each node's device work was waited for."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock, self.ended_at = clock, list[float]()

    def node_end(self, job_ids: Any) -> None:
        super().node_end(job_ids)
        self.ended_at.append(self.clock())


def last_event(order: RecordingOrder, job_id: str) -> int:
    return max(value for call, _, job, value in order.log if call == "node_end" and job == job_id)


def test_background_copies_wait_for_the_jobs_last_node_and_their_buffers_are_marked(job: JobSpec) -> None:
    a, b = (dataclasses.replace(job, job_id=name) for name in ("a", "b"))
    order = RecordingOrder()
    svc = Service("s0", order=order, validate=True)
    svc.load_job(a)
    svc.load_job(b, tier="host")
    loaded = last_event(order, "a")
    res = svc.run_node("a", -1, "evaluate", {})  # a's node: its kernels may still run when it returns (CUDA)
    assert res.report.ok, res.report.error
    node = last_event(order, "a")
    assert node > loaded  # the node recorded its own event, after the load's

    # right after a's node: evict a and bring b in, in the background (a prefetch, or an early swap)
    svc._start_prefetch([Move("a", "device", "host", 0), Move("b", "host", "device", 0)])
    svc._wait_for("b")
    background = [e for e in order.log if e[1].startswith("s0-prefetch")]
    copies_of_a = [value for call, _, j, value in background if call == "copy" and j == "a"]
    assert copies_of_a and set(copies_of_a) == {node}  # each copy of a after a's last node event
    assert ("before_copy", background[0][1], "a", node) in background
    assert order.unordered == []

    # b's tensors now live in ONE device buffer allocated on the background thread: marked for compute
    storages = {t.untyped_storage().data_ptr() for t in svc.engines["b"].state_tensors().values()}
    assert len(storages) == 1 and storages <= order.allocations()

    # b runs, then goes out again in the background: its copies wait for that node, not for its swap-in
    res = svc.run_node("b", -1, "evaluate", {})
    assert res.report.ok, res.report.error
    svc._start_prefetch([Move("b", "device", "host", 0), Move("a", "host", "device", 0)])
    svc._wait_for("a")
    assert order.unordered == []
    assert {v for call, _, j, v in order.log if call == "copy" and j == "b"} >= {last_event(order, "b")}
    svc.close()


def test_a_copy_issued_without_waiting_for_the_jobs_node_is_reported() -> None:
    """The recorder itself: a copy after a newer node event than the one waited for is flagged (so the test
    above would see a service that skipped `before_copy` or waited for an older event)."""
    import torch

    order = RecordingOrder()
    order.node_end(["x"])
    order.before_copy("x")
    order.node_end(["x"])  # a later node of x ended after that wait
    order.copy("x", torch.empty(1), torch.ones(1))
    order.copy("y", torch.empty(1), torch.ones(1))  # never waited for
    assert [(job, latest, waited) for _, job, latest, waited in order.unordered] == [("x", 2, 1), ("y", -1, -2)]


def test_a_nodes_end_time_is_read_after_its_device_work_is_done(job: JobSpec) -> None:
    clock = Clock(step=1.0)
    order = TimedOrder(clock)
    svc = Service("s0", order=order, clock=clock)
    svc.load_job(job)
    res = svc.run_node(job.job_id, -1, "evaluate", {})
    assert res.report.ok, res.report.error
    assert res.report.start < order.ended_at[-1] < res.report.end
    # a node that fails still waits for what it queued before its report is timed
    res = svc.run_node(job.job_id, -1, "train", {})  # no inputs: the operator raises
    assert not res.report.ok
    assert res.report.end > order.ended_at[-1] > res.report.start
    svc.close()


def test_a_cpu_service_orders_nothing() -> None:
    import torch

    assert isinstance(stream_order(torch.device("cpu")), HostOrder)
    assert isinstance(Service("s0").order, HostOrder)


def test_a_co_scheduled_cohort_records_one_event_for_every_member_before_its_end(
    job: JobSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run_cohort`'s one engine call (here a stand-in batched form of `evaluate`) ends with ONE event for all of
    its members' jobs, waited for before the call's end is read."""
    import types

    import torch

    from plexrl.services.batched import Member, run_cohort

    a, b = (dataclasses.replace(job, job_id=name) for name in ("a", "b"))
    clock = Clock(step=1.0)
    order = TimedOrder(clock)
    svc = Service("s0", order=order, clock=clock)
    svc.load_job(a)
    svc.load_job(b)
    out = types.SimpleNamespace(attention_mask=torch.ones(2, 3), metrics=lambda: {})
    op = a.graph.node("evaluate").operator
    monkeypatch.setattr(op, "batched", lambda ctxs, inputs, params: [out for _ in ctxs], raising=False)
    results = run_cohort(svc, [Member("a", -1, "evaluate", {}), Member("b", -1, "evaluate", {})], (), ())
    assert all(r.report.ok for r in results), [r.report.error for r in results]
    ends = [(job_id, value) for call, _, job_id, value in order.log if call == "node_end"][-2:]
    assert [j for j, _ in ends] == ["a", "b"] and ends[0][1] == ends[1][1]
    assert max(r.report.end for r in results) > order.ended_at[-1] > min(r.report.start for r in results)
    svc.close()
