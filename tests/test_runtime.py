"""The runtime: one Runner over the Executor interface.

- batches stay on the workers: on Dask, what reaches the client per iteration is the nodes' small reports,
  the same for a batch 16x larger;
- the spec is frozen; the run record is the runner's;
- hooks are the only way out: a hook the accounting depends on fails the run loudly, another is disabled;
- the planner learns measured state sizes (`StateMeasured`) and decides which cpu nodes run inline.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY, local_runner

from plexrl.hooks.base import Hook, HookFailed
from plexrl.job.load import load_job
from plexrl.job.spec import JobRun, prepare_job
from plexrl.planner import JobPlan, JobSubmitted, NodeFinished, NodePlan, Planner, RunNode, ServiceJoined, StateMeasured
from plexrl.runtime import Runner


def job_cfg(run_dir: Path, name: str = "j", batch_size: int = 4, iterations: int = 2) -> dict[str, Any]:
    cfg = copy.deepcopy(TINY)
    cfg.update(name=name, iterations=iterations, run_dir=str(run_dir))
    cfg["tracking"]["mlflow"] = False
    cfg["pipeline"]["params"]["batch_size"] = batch_size
    return cfg


def test_bytes_reaching_the_client_do_not_grow_with_the_batch(tmp_path: Path) -> None:
    """Two jobs at once on one Dask service, one with a batch 16x the other's: the bytes fetched into
    the client per iteration (after the first) are the same for both: node reports and metrics only."""
    from plexrl.runtime.dask import DaskExecutor

    small, big = (prepare_job(load_job(job_cfg(tmp_path / "runs", f"b{b}", b, iterations=3))) for b in (4, 64))
    executor = DaskExecutor(services=1, cpu_threads=1)
    seen: dict[tuple[str, int], int] = {}
    amm: list[bool] = []

    class Meter(Hook):
        def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
            seen[run.job_id, iteration] = executor.bytes_by_job[run.job_id]
            if not amm:
                amm.append(executor.client.amm.running())

    runs = Runner(executor, Planner(clock=executor.clock, lookahead=True, inline_below=0.01), hooks=[Meter()]).run(
        [small, big]
    )
    assert [r.status for r in runs] == ["done", "done"], [r.error for r in runs]
    # the local cluster's active memory manager is off: it dropped the copies of a spec that a worker had
    # fetched, so the next node there fetched it again (seconds of pickling on both workers' event loops)
    assert amm == [False]
    small_b, big_b = ((seen[j, 2] - seen[j, 0]) / 2 for j in ("b4", "b64"))
    assert 0 < big_b < 1.25 * small_b, (small_b, big_b)  # metrics only: independent of the batch
    assert big_b < 32 * 1024


def test_the_spec_is_frozen_and_the_record_is_the_runners(tmp_path: Path) -> None:
    spec = prepare_job(load_job(job_cfg(tmp_path / "runs", iterations=1)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.job_id = "other"  # type: ignore[misc]
    (run,) = local_runner().run([spec])
    assert run.spec is spec and run.status == "done" and run.iterations_done == 1
    assert run.service == "service-0" and len(run.history) == 2


class Broken(Hook):
    def __init__(self, required: bool) -> None:
        self.required = required
        self.calls = 0

    def after_node(self, *args: Any) -> None:
        self.calls += 1
        raise ValueError("disk full")


def test_a_required_hook_that_fails_stops_the_run_loudly(tmp_path: Path) -> None:
    spec = prepare_job(load_job(job_cfg(tmp_path / "runs")))
    runner = local_runner(hooks=[Broken(required=True)])
    with pytest.raises(HookFailed, match=r"Broken\.after_node failed: ValueError: disk full"):
        runner.run([spec])
    (run,) = runner.runs.values()
    assert run.status == "failed" and "HookFailed" in run.error  # closed with what it logged


def test_an_optional_hook_that_fails_is_disabled_and_the_job_goes_on(tmp_path: Path) -> None:
    spec = prepare_job(load_job(job_cfg(tmp_path / "runs")))
    broken = Broken(required=False)
    (run,) = local_runner(hooks=[broken]).run([spec])
    assert run.status == "done" and broken.calls == 1


def test_the_planner_replaces_the_estimate_with_the_measured_state_size(tmp_path: Path) -> None:
    spec = prepare_job(load_job(job_cfg(tmp_path / "runs", iterations=1)))
    runner = local_runner()
    runner.run([spec])
    state = runner.planner.services["service-0"].state
    assert state.size == {}  # released at the end; check the event stream instead
    measured = [
        t.event for t in runner.planner.log if isinstance(t.event, StateMeasured) and t.event.job_id == spec.job_id
    ]
    assert measured and 0 < measured[0].nbytes <= spec.state_bytes()


def plan(*names: str, inline: bool = True) -> JobPlan:
    nodes = {"a": NodePlan("cpu", (), None, inline), "s": NodePlan("service", ("a",))}
    return JobPlan(nodes, iterations=3, order=("a", "s"))


def test_the_planner_decides_which_cpu_nodes_run_inline() -> None:
    now = [0.0]
    p = Planner(clock=lambda: now[0], inline_below=0.01, validate=True)
    p.handle(ServiceJoined("s0"))
    out = p.handle(JobSubmitted("j", plan()))
    first = [i for i in out if isinstance(i, RunNode) and i.node == "a"]
    assert first and not first[0].inline  # never observed: not inline
    p.handle(NodeFinished("j", 0, "a", duration=0.001))
    out = p.handle(NodeFinished("j", 0, "s", duration=0.2))
    again = [i for i in out if isinstance(i, RunNode) and i.node == "a"]
    assert again and again[0].inline  # observed at 1 ms < 10 ms
    q = Planner(clock=lambda: 0.0, inline_below=0.01)
    q.handle(ServiceJoined("s0"))
    q.handle(JobSubmitted("t", plan(inline=False)))  # a tool-call operator: never inline
    q.handle(NodeFinished("t", 0, "a", duration=0.001))
    out = q.handle(NodeFinished("t", 0, "s", duration=0.2))
    assert not next(i for i in out if isinstance(i, RunNode) and i.node == "a").inline


def test_state_measured_frees_room_for_a_queued_job() -> None:
    p = Planner(clock=lambda: 0.0, validate=True)
    p.handle(ServiceJoined("s0", device_bytes=100, host_bytes=0, disk_bytes=0))
    nodes = {"s": NodePlan("service")}
    p.handle(JobSubmitted("a", JobPlan(nodes, 1, ("s",), state_bytes=80)))
    out = p.handle(JobSubmitted("b", JobPlan(nodes, 1, ("s",), state_bytes=40)))
    assert p.jobs["b"].status == "queued"
    out = p.handle(StateMeasured("s0", "a", 50))  # the estimate was an upper bound
    assert p.jobs["b"].status == "running" and any(getattr(i, "job_id", "") == "b" for i in out)
    assert p.handle(StateMeasured("s0", "a", 90)) == [] and p.services["s0"].state.size["a"] == 50  # no room
