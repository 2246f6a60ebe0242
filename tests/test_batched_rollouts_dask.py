"""Co-scheduled cohorts on the Dask executor, driven by hand (`DaskExecutor.submit_cohort`,
`runtime/dask_tasks._run_service_cohort`), without vLLM (tiny LoRA jobs on the torch engine):

- a cohort is one task on the service's worker: each member gets its own handle and report, and its output
  stays on the worker as the input of its job's later nodes (here: the train step after a cohort of `ref`
  nodes, which have no batched form, so they run one after another inside the cohort);
- a member whose job is not loaded on the service is reported not run; the others run;
- a cohort whose engine call fails (rollouts: `vllm_lora.generate_together` needs one shared vLLM engine, and
  these jobs have torch engines) fails every member in its report, and the service runs the next task.

Cohorts the planner forms end to end on Dask (needs vLLM): tests/test_batched_rollouts.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_lora import lora_job

from plexrl.job.load import load_job
from plexrl.job.spec import JobSpec, prepare_job
from plexrl.reports import LoadReport, NodeReport
from plexrl.runtime.dask import DaskExecutor
from plexrl.runtime.executor import Handle, NodeTask

SID = "service-0"


class Driver:
    """Sends nodes to the executor as a runner would, each with its inputs' handles (job, iteration, node ->)."""

    def __init__(self, ex: DaskExecutor, specs: dict[str, JobSpec]) -> None:
        self.ex, self.specs = ex, specs
        self.out: dict[tuple[str, int, str], Handle] = {}

    def task(self, job: str, it: int, node: str) -> NodeTask:
        spec = self.specs[job]
        ins = {p: self.out[job, it, src] for p, src in spec.inputs(node).items() if (job, it, src) in self.out}
        service = SID if spec.graph.node(node).runs_on == "service" else None
        return NodeTask(job, it, node, service, ins)

    def reports(self, handles: list[Handle], timeout: float = 60.0) -> list[Any]:
        got: dict[Handle, Any] = {}
        deadline = time.monotonic() + timeout
        while not set(handles) <= got.keys():
            assert time.monotonic() < deadline, f"no report of {set(handles) - got.keys()} after {timeout}s"
            got |= {f.handle: f.report for f in self.ex.wait(0.5)}
        return [got[h] for h in handles]

    def run(self, job: str, it: int, node: str) -> NodeReport:
        h = self.ex.submit(self.task(job, it, node))
        (report,) = self.reports([h])
        assert report.error is None, (node, report.error)
        self.out[job, it, node] = h
        return report

    def cohort(self, keys: list[tuple[str, int, str]]) -> list[NodeReport]:
        handles = self.ex.submit_cohort([self.task(*k) for k in keys])
        for k, h in zip(keys, handles, strict=True):
            self.out[k] = h
        return self.reports(handles)


@pytest.fixture
def driver(smol_tiny: Path, tmp_path: Path) -> Iterator[Driver]:
    specs = {n: prepare_job(load_job(lora_job(smol_tiny, tmp_path / "runs", n, s, iterations=2)))
             for n, s in (("la", 0), ("lb", 1), ("lc", 2))}  # fmt: skip
    ex = DaskExecutor(services=1, cpu_threads=1)
    ex.start()
    try:
        for spec in specs.values():
            ex.ship(spec)
        d = Driver(ex, specs)
        loads = d.reports([ex.load(j, SID, "device") for j in ("la", "lb")])  # lc is never loaded
        assert all(isinstance(r, LoadReport) and r.error is None for r in loads), loads
        yield d
    finally:
        ex.close()


def test_a_cohort_on_dask_keeps_each_members_output_on_the_worker_and_fails_as_reports(driver: Driver) -> None:
    for job in ("la", "lb", "lc"):
        driver.run(job, 0, "prompts")
    for job in ("la", "lb"):
        driver.run(job, 0, "rollout")
    la, lb, lc = driver.cohort([("la", 0, "ref"), ("lb", 0, "ref"), ("lc", 0, "ref")])
    assert la.error is None and lb.error is None, (la.error, lb.error)
    assert lc.error is not None and lc.error.startswith(f"not run: loading the job on {SID} failed"), lc.error
    assert (la.job_id, lb.job_id, lc.job_id) == ("la", "lb", "lc") and la.end <= lb.start  # one after another
    for node in ("verify", "shaped", "advantage", "train"):  # train reads la's ref output, kept on the worker
        report = driver.run("la", 0, node)
    assert report.node == "train" and report.metrics, report  # it ran on the cohort member's output
    driver.run("la", 1, "prompts")
    driver.run("lb", 1, "prompts")
    failed = driver.cohort([("la", 1, "rollout"), ("lb", 1, "rollout")])  # one engine call: it cannot be made
    assert [r.job_id for r in failed] == ["la", "lb"]
    assert all(r.error is not None and r.error == failed[0].error for r in failed), [r.error for r in failed]
    assert driver.run("lb", 1, "rollout").error is None  # the service goes on with the next task
    assert driver.ex.lost() == []
