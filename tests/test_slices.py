"""Decode-step preemption on the real services (`slices: {rollout: K}`), with a tiny random model:

- a service runs a sliced rollout one slice per call: the slices before the last report `paused` (no output,
  no metrics), another job's rollout runs on the same service in between, and the last slice's rollout equals
  the unsliced one exactly (tokens, masks, behaviour log-probs), with each token's weight version;
- through the runner: the sliced job alone (inline), and multiplexed with another job on one service on Dask
  with lookahead, where it logs exactly what it logs alone and the other job's service node runs between two
  of its slices;
- config errors name the field and the fix; an engine that cannot pause is refused with the fix.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY, local_runner, stable

from plexrl.batch import Prompts, Rollouts
from plexrl.errors import ConfigError
from plexrl.hooks.base import Hook
from plexrl.job.load import load_job
from plexrl.job.spec import JobRun, prepare_job
from plexrl.planner import Planner
from plexrl.runtime import Budgets, Runner


def job_config(run_dir: Path, name: str, seed: int, slices: dict[str, int]) -> dict[str, Any]:
    cfg = copy.deepcopy(TINY)
    cfg.update(name=name, seed=seed, iterations=2, run_dir=str(run_dir), slices=slices)
    cfg["tracking"]["mlflow"] = False
    return cfg


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slices") / "runs"


def rows(ro: Rollouts) -> tuple[torch.Tensor, ...]:
    return ro.input_ids, ro.attention_mask, ro.response_mask, ro.behaviour_logprobs, ro.response_lengths


def test_a_service_runs_a_sliced_rollout_slice_by_slice_and_it_equals_the_unsliced_one(run_dir: Path) -> None:
    from plexrl.services.service import Service, run_cpu_node

    sliced = prepare_job(load_job(job_config(run_dir, "a", 0, {"rollout": 1})))
    whole = prepare_job(load_job(job_config(run_dir, "a", 0, {})))
    other = prepare_job(load_job(job_config(run_dir, "b", 1, {})))
    svc, ref = Service("s"), Service("ref")
    try:
        svc.load_job(sliced)
        svc.load_job(other)
        ref.load_job(whole)
        prompts = run_cpu_node(sliced, 0, "prompts", {}, svc.clock).output
        assert isinstance(prompts, Prompts)
        reports = []
        while True:
            res = svc.run_node("a", 0, "rollout", {"prompts": prompts})
            assert res.report.ok, res.report.error
            reports.append(res.report)
            if not res.report.paused:
                break
            assert res.output is None and res.report.metrics == {} and list(svc.paused) == [("a", 0, "rollout", 0)]
            between = svc.run_node("b", 0, "rollout", {"prompts": prompts})  # another job's node in between
            assert between.report.ok and not between.report.paused
        assert len(reports) >= 2 and svc.paused == {}  # one decode step per slice: several slices
        assert reports[-1].metrics["slices"] == len(reports)
        out, expected = res.output, ref.run_node("a", 0, "rollout", {"prompts": prompts}).output
        assert isinstance(out, Rollouts) and isinstance(expected, Rollouts)
        for got, want in zip(rows(out), rows(expected), strict=True):
            assert torch.equal(got, want)
        assert out.token_versions is not None and expected.token_versions is None
        assert torch.equal(out.versions(), expected.versions())  # every response token at version 0
        assert bool((out.token_versions[out.response_mask == 0] == -1).all())
        assert svc.run_node("a", 1, "rollout", {"prompts": prompts}).report.paused
        assert list(svc.paused) == [("a", 1, "rollout", 0)]
        svc.release("a")  # a paused generation (its KV cache) goes with its job
        assert svc.paused == {}
    finally:
        svc.close()
        ref.close()


class Starts(Hook):
    def __init__(self) -> None:
        self.starts: list[tuple[str, int, str, str]] = []

    def before_node(self, run: JobRun, iteration: int, node: str, lane: str, start: float) -> None:
        self.starts.append((run.job_id, iteration, node, lane))


def run_jobs(cfgs: list[dict[str, Any]], runner: Runner) -> tuple[list[JobRun], Starts]:
    specs = [prepare_job(load_job(cfg)) for cfg in cfgs]
    starts = Starts()
    runner.hooks.hooks.append(starts)
    ran = runner.run(specs)
    for run in ran:
        assert run.status == "done", run.error
    return ran, starts


def other_job_between_slices(starts: Starts) -> list[tuple[str, int, str, str]]:
    """The other job's service nodes that started between two slices of a's rollout in one iteration."""
    service = [s for s in starts.starts if s[3] != "cpu"]
    between = []
    for k, (job, it, node, _) in enumerate(service):
        if (job, node) != ("a", "rollout"):
            continue
        later = [k2 for k2 in range(k + 1, len(service)) if service[k2][:2] == ("a", it)]
        if later and service[later[0]][2] == "rollout":
            between += [s for s in service[k + 1 : later[0]] if s[0] == "b"]
    return between


@pytest.fixture(scope="module")
def alone(run_dir: Path) -> JobRun:
    """The sliced job alone, inline: a slice per decode step."""
    (run,), _ = run_jobs([job_config(run_dir, "a", 0, {"rollout": 1})], local_runner())
    assert all(row["rollout/slices"] >= 2 for row in run.history[1:])
    return run


def test_on_dask_a_sliced_job_multiplexed_logs_what_it_logs_alone_and_lets_the_other_in(
    run_dir: Path, alone: JobRun
) -> None:
    from plexrl.runtime.dask import DaskExecutor

    cfgs = [job_config(run_dir, "a", 0, {"rollout": 1}), job_config(run_dir, "b", 1, {})]
    executor = DaskExecutor(services=1, cpu_threads=1, validate=True)
    runner = Runner(executor, Planner(clock=executor.clock, validate=True, lookahead=True), budgets=Budgets())
    (a, _b), starts = run_jobs(cfgs, runner)
    assert stable(a.history) == stable(alone.history)  # docs invariant 4, with slices
    assert other_job_between_slices(starts), starts.starts


def test_bad_slices_name_the_field_and_the_fix(run_dir: Path) -> None:
    for slices, where, words in [
        ({"rollut": 4}, "slices.rollut", "did you mean 'rollout'"),
        ({"verify": 4}, "slices.verify", "Sliceable nodes here: rollout"),
        ({"rollout": 0}, "slices.rollout", "greater than or equal to 1"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_job(job_config(run_dir, "a", 0, slices))
        assert any(p.where == where and words in p.message for p in err.value.problems), err.value.problems


def test_an_engine_that_cannot_pause_is_refused_with_the_fix() -> None:
    from plexrl.engines.slicing import SliceSlot, generate_slice

    class Whole:
        weight_version = 0

        def generate(self, prompts: list[list[int]], **kw: Any) -> Any: ...

        def __getattr__(self, name: str) -> Any:  # delegation (as VLLMEngine's) does not make it pausable
            return lambda *a, **k: None

    with pytest.raises(TypeError, match=r"cannot pause a generation.*remove the node from the job.s `slices`"):
        generate_slice(Whole(), SliceSlot(4), [[1, 2]], n=1, temperature=1.0, max_new_tokens=4, seed=0)
