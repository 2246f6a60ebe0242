"""Co-scheduled rollouts end to end (`batch_rollouts`, `plexrl/planner/batches.py`, `services/batched.py`): two
tiny LoRA jobs rolling out on one shared vLLM engine on one local service, their rollouts run as ONE engine
call (on the CPU build: on CUDA the equality is in distribution, docs/gpu.md). Every job completes; each
rollout's tokens equal the job's rollout without batching and its log-probs
agree within 1e-5; each job's metrics equal its unbatched run within that tolerance; the planner records the
cohorts, and each member is accounted a share of the call (the shares tile it). Skipped without vLLM.

The reference is the same jobs multiplexed WITHOUT batching, which equals each job alone exactly
(tests/test_lora_vllm.py proves that), run once for the module. The same batching on the Dask executor
(`DaskExecutor.submit_cohort`) learns the same."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import stable
from test_lora_vllm import smol32, vllm_lora_job  # noqa: F401  (smol32: a fixture)

from plexrl.engines.vllm_engine import vllm_installed
from plexrl.hooks.base import Hook
from plexrl.job.load import load_job
from plexrl.job.spec import prepare_job
from plexrl.planner import Planner
from plexrl.runtime import InlineExecutor, Runner
from plexrl.runtime.executor import Handle, NodeTask

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make setup-vllm)")


class Recording(InlineExecutor):
    """The in-process executor, keeping each rollout's tokens and behaviour log-probs (job, iteration) ->."""

    def __init__(self) -> None:
        super().__init__(services=1, validate=True)
        self.rollouts: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _keep(self, task: NodeTask, handle: Handle) -> None:
        out = self.outputs.get(handle)
        if task.node == "rollout" and out is not None:
            self.rollouts[task.job_id, task.iteration] = (out.input_ids.clone(), out.behaviour_logprobs.clone())

    def submit(self, task: NodeTask) -> Handle:
        handle = super().submit(task)
        self._keep(task, handle)
        return handle

    def submit_cohort(self, tasks: Any) -> list[Handle]:
        handles = super().submit_cohort(tasks)
        for task, handle in zip(tasks, handles, strict=True):
            self._keep(task, handle)
        return handles


class Spans(Hook):
    """The service spans the hooks see of each rollout: (job, iteration) -> (start, end)."""

    def __init__(self) -> None:
        self.spans: dict[tuple[str, int], tuple[float, float]] = {}

    def after_node(
        self, run: Any, iteration: int, node: str, lane: str, start: float, end: float, metrics: Any
    ) -> None:
        if node == "rollout":
            self.spans[run.job_id, iteration] = (start, end)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def specs(smol32: Path, run_dir: Path) -> list[Any]:  # noqa: F811
    jobs = (("la", 0), ("lb", 1), ("lc", 2))
    return [prepare_job(load_job(vllm_lora_job(smol32, run_dir, n, s, iterations=2))) for n, s in jobs]


@pytest.fixture(scope="module")
def unbatched(smol32: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Recording, Any]:  # noqa: F811
    """The reference: the three jobs multiplexed in process, one engine call per rollout (runs, executor,
    planner)."""
    record = Recording()
    runner = Runner(record, Planner(clock=record.clock, validate=True))
    runs = runner.run(specs(smol32, tmp_path_factory.mktemp("unbatched") / "runs"))
    assert [r.status for r in runs] == ["done"] * 3, [r.error for r in runs]
    return runs, record, runner.planner


def same_metrics(runs: list[Any], reference: list[Any]) -> None:
    for run, ref in zip(runs, reference, strict=True):
        for got, want in zip(stable(run.history), stable(ref.history), strict=True):
            assert got.keys() == want.keys()
            assert all(close(got[k], want[k]) for k in want), (run.job_id, got, want)


def test_two_lora_jobs_rollouts_batched_in_one_vllm_call_sample_what_each_samples_alone(
    smol32: Path,  # noqa: F811
    unbatched: tuple[list[Any], Recording, Any],
    tmp_path: Path,
) -> None:
    runs_of: dict[bool, list[Any]] = {False: unbatched[0]}
    record: dict[bool, Recording] = {False: unbatched[1]}
    spans = Spans()
    planners = {False: unbatched[2]}
    record[True] = Recording()
    runner = Runner(record[True], Planner(clock=record[True].clock, validate=True, batch_rollouts=True), hooks=[spans])
    runs_of[True] = runner.run(specs(smol32, tmp_path / "runs"))
    planners[True] = runner.planner
    assert [r.status for r in runs_of[True]] == ["done"] * 3, [r.error for r in runs_of[True]]
    assert planners[False].counts()["cohorts_sent"] == 0
    assert (
        planners[True].counts()["cohorts_sent"] >= 1 and planners[True].counts()["cohort_members"] >= 2
    )  # rollouts ran as one call
    alone, together = record[False].rollouts, record[True].rollouts
    assert alone.keys() == together.keys() and len(alone) == 6
    for key, (ids, logprobs) in alone.items():
        got_ids, got_lp = together[key]
        assert torch.equal(got_ids, ids), key
        assert float((got_lp - logprobs).abs().max()) <= 1e-5, key
    same_metrics(runs_of[True], runs_of[False])
    # a cohort's members were reported consecutive shares of one call: spans that touch, not one span each
    starts = sorted(spans.spans.values())
    touching = sum(1 for (s0, e0), (s1, e1) in itertools.pairwise(starts) if e0 == s1 and e1 > s1 >= s0)
    assert touching >= planners[True].counts()["cohort_members"] - planners[True].counts()["cohorts_sent"]


def test_batched_rollouts_on_the_dask_executor_learn_what_the_jobs_learn_unbatched(
    smol32: Path,  # noqa: F811
    unbatched: tuple[list[Any], Recording, Any],
    tmp_path: Path,
) -> None:
    """The same three jobs on ONE Dask service with `batch_rollouts` (`DaskExecutor.submit_cohort`: a cohort is
    one task on the service's worker, each member's output stays there as the input of its job's next nodes):
    cohorts form, every job completes, and each job's metrics equal the unbatched run within 1e-5."""
    from plexrl.runtime.build import build_runner
    from plexrl.runtime.config import RuntimeConfig
    from plexrl.runtime.dask import DaskExecutor

    executor = DaskExecutor(services=1, cpu_threads=1)
    # all three jobs on the service at once (spread, as the in-process runs; spread+backfill admits two), so
    # rollouts queue while one runs (the first builds the vLLM engine); no lookahead (a node sent ahead runs alone)
    section = {"driver": "dask", "validate_state": True, "lookahead": False, "batch_rollouts": True}
    section["placement"] = "spread"
    runner = build_runner(RuntimeConfig.model_validate(section), [], executor)
    runs = runner.run(specs(smol32, tmp_path / "runs"))
    assert [r.status for r in runs] == ["done"] * 3, [r.error for r in runs]
    assert runner.planner.counts()["cohorts_sent"] >= 1 and runner.planner.counts()["cohort_members"] >= 2
    same_metrics(runs, unbatched[0])
