"""Co-scheduled rollouts end to end (`batch_rollouts`, `plexrl/planner/batches.py`, `services/batched.py`): two
tiny LoRA jobs rolling out on one shared vLLM engine on one local service, their rollouts run as ONE engine
call. Every job completes; each rollout's tokens equal the job's rollout without batching and its log-probs
agree within 1e-5; each job's metrics equal its unbatched run within that tolerance; the planner records the
groups, and each member is accounted a share of the call (the shares tile it). Skipped without vLLM.

The reference is the same two jobs multiplexed WITHOUT batching, which equals each job alone exactly
(tests/test_lora_vllm.py proves that): two engine builds in all, not three."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import stable
from test_lora_vllm import smol32, vllm_lora_job  # noqa: F401  (smol32: a fixture)

from plexrl.config import load_job
from plexrl.engines.vllm_engine import vllm_installed
from plexrl.hooks.base import Hook
from plexrl.job import prepare_job
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

    def submit_group(self, tasks: Any) -> list[Handle]:
        handles = super().submit_group(tasks)
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


def test_two_lora_jobs_rollouts_batched_in_one_vllm_call_sample_what_each_samples_alone(
    smol32: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    def specs(run_dir: Path) -> list[Any]:
        jobs = (("la", 0), ("lb", 1), ("lc", 2))
        return [prepare_job(load_job(vllm_lora_job(smol32, run_dir, n, s, iterations=2))) for n, s in jobs]

    runs_of: dict[bool, list[Any]] = {}
    record: dict[bool, Recording] = {}
    spans = Spans()
    planners = {}
    for batch in (False, True):
        record[batch] = Recording()
        runner = Runner(record[batch], validate=True, batch_rollouts=batch, hooks=[spans] if batch else [])
        runs_of[batch] = runner.run(specs(tmp_path / f"runs-{batch}"))
        planners[batch] = runner.planner
        assert [r.status for r in runs_of[batch]] == ["done"] * 3, [r.error for r in runs_of[batch]]
    assert planners[False].groups_sent == 0
    assert planners[True].groups_sent >= 1 and planners[True].grouped_nodes >= 2  # rollouts ran as one call
    alone, grouped = record[False].rollouts, record[True].rollouts
    assert alone.keys() == grouped.keys() and len(alone) == 6
    for key, (ids, logprobs) in alone.items():
        got_ids, got_lp = grouped[key]
        assert torch.equal(got_ids, ids), key
        assert float((got_lp - logprobs).abs().max()) <= 1e-5, key
    for run, ref in zip(runs_of[True], runs_of[False], strict=True):
        for got, want in zip(stable(run.history), stable(ref.history), strict=True):
            assert got.keys() == want.keys()
            assert all(close(got[k], want[k]) for k in want), (run.job_id, got, want)
    # a group's members were reported consecutive shares of one call: spans that touch, not one span each
    starts = sorted(spans.spans.values())
    touching = sum(1 for (s0, e0), (s1, e1) in itertools.pairwise(starts) if e0 == s1 and e1 > s1 >= s0)
    assert touching >= planners[True].grouped_nodes - planners[True].groups_sent
