"""End to end on the real stack: torch engine, the runner over the in-process executor, planner, MLflow
(sqlite) — tiny sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import stable

from plexrl.job.load import load_job
from plexrl.runtime.jobs import run_jobs


def test_two_iterations_log_to_mlflow_and_read_back(tiny_config: dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    tiny_config["tracking"]["log_model"] = True
    (job,) = run_jobs([load_job(tiny_config)], progress=False)
    assert job.status == "done", job.error
    assert len(job.history) == 3 and job.iterations_done == 2  # baseline row (step 0) + 2 iterations
    assert set(job.history[0]) == {"evaluate/accuracy", "evaluate/response_length", "time/evaluate"}
    last = job.history[-1]
    for key in (
        "verify/reward_mean",
        "rollout/response_length",
        "train/loss",
        "train/kl",
        "train/clip_frac",
        "train/entropy",
        "train/grad_norm",
        "time/rollout",
        "time/train",
        "evaluate/accuracy",
    ):
        assert key in last, key
    client = MlflowClient(tracking_uri=job.tracking["uri"])
    assert job.tracking["uri"] == f"sqlite:///{Path(tiny_config['run_dir']).resolve() / 'mlflow.db'}"
    run = client.get_run(job.tracking["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["pipeline.params.batch_size"] == "4" and run.data.params["seed"] == "0"
    rewards = client.get_metric_history(run.info.run_id, "verify/reward_mean")
    assert [m.step for m in rewards] == [1, 2]
    assert [m.value for m in rewards] == job.series("verify/reward_mean")
    acc = client.get_metric_history(run.info.run_id, "evaluate/accuracy")
    assert [m.step for m in acc] == [0, 2]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"job.yaml", "pipeline.png", "timeline.json", "model"} <= artifacts


def test_same_seed_same_metrics_and_warm_start_is_cached(tiny_config: dict[str, Any]) -> None:
    tiny_config["tracking"]["mlflow"] = False
    (first,) = run_jobs([load_job(tiny_config)], progress=False)
    (second,) = run_jobs([load_job(tiny_config)], progress=False)
    assert first.status == second.status == "done"
    assert first.spec.warm_start["cached"] is False and second.spec.warm_start["cached"] is True
    assert stable(first.history) == stable(second.history)
    (other,) = run_jobs([load_job({**tiny_config, "seed": 1})], progress=False)
    assert stable(other.history) != stable(first.history)


def test_operator_exception_fails_the_job_with_its_message(tiny_config: dict[str, Any], tmp_path: Path) -> None:
    tiny_config["tracking"]["mlflow"] = False
    tiny_config["pipeline"] = {
        "nodes": [
            {"name": "prompts", "op": "sample_prompts", "params": {"batch_size": 2}},
            {
                "name": "rollout",
                "op": "rollout",
                "inputs": {"prompts": "prompts"},
                "params": {"n": 2, "max_new_tokens": 3},
            },
            {"name": "verify", "op": "verify", "inputs": {"rollouts": "rollout"}},
            {"name": "boom", "op": "failing_ops:explode", "inputs": {"rewards": "verify"}},
        ]
    }
    (tmp_path / "failing_ops.py").write_text(
        "from plexrl import operator, Rewards\n"
        "@operator(runs_on='cpu')\n"
        "def explode(rewards: Rewards) -> Rewards:\n"
        "    raise ValueError('tool crashed')\n"
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(tmp_path))
        (job,) = run_jobs([load_job(tiny_config)], progress=False)
    assert job.status == "failed"
    assert "boom" in job.error and "ValueError: tool crashed" in job.error


def test_multiplexed_job_learns_exactly_as_alone_and_failures_stay_isolated(
    tiny_config: dict[str, Any], tmp_path: Path
) -> None:
    """Invariants 4 and 5 in-process: two jobs on ONE service (time-sliced) give each the metrics
    it has alone; a job whose evaluation raises fails alone, and the others finish."""
    from conftest import local_runner

    from plexrl.job.spec import prepare_job

    tiny_config["tracking"]["mlflow"] = False
    (tmp_path / "bad_eval.py").write_text(
        "from plexrl import operator, EvalStats, OpContext\n"
        "@operator(runs_on='service')\n"
        "def bad_eval(ctx: OpContext) -> EvalStats:\n"
        "    raise RuntimeError('evaluator down')\n"
    )
    other = {**tiny_config, "name": "other", "seed": 5}
    broken = {
        **tiny_config,
        "name": "broken",
        "pipeline": {
            "nodes": [
                {"name": "prompts", "op": "sample_prompts", "params": {"batch_size": 2}},
                {"name": "probe", "op": "bad_eval:bad_eval", "every": 2},
            ]
        },
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(tmp_path))
        (alone,) = local_runner().run([prepare_job(load_job(tiny_config))])
        jobs = [prepare_job(load_job(c)) for c in (tiny_config, other, broken)]
        shared = local_runner(services=1).run(jobs)
    assert [j.status for j in shared] == ["done", "done", "failed"]
    assert "probe" in shared[2].error or "evaluator down" in shared[2].error
    assert stable(shared[0].history) == stable(alone.history)
    assert stable(shared[1].history) != stable(alone.history)


def test_user_operator_from_yaml_runs_end_to_end(tiny_config: dict[str, Any]) -> None:
    tiny_config["tracking"]["mlflow"] = False
    tiny_config["iterations"] = 1
    tiny_config["pipeline"] = {"nodes": [
        {"name": "prompts", "op": "sample_prompts", "params": {"batch_size": 4}},
        {"name": "rollout", "op": "rollout", "inputs": {"prompts": "prompts"}, "params": {"n": 4, "max_new_tokens": 4}},
        {"name": "verify", "op": "verify", "inputs": {"rollouts": "rollout"}},
        {"name": "shaped", "op": "user_ops:length_penalty", "params": {"per_token": 0.25},
         "inputs": {"rollouts": "rollout", "rewards": "verify"}},
        {"name": "advantage", "op": "grpo_advantage", "inputs": {"rollouts": "rollout", "rewards": "shaped"}},
        {"name": "train", "op": "train", "params": {"normaliser": {"skip_zero_advantage": False}},
         "inputs": {"rollouts": "rollout", "advantages": "advantage"}},
    ]}  # fmt: skip
    (job,) = run_jobs([load_job(tiny_config)], progress=False)
    assert job.status == "done", job.error
    (row,) = job.history
    expected = row["verify/reward_mean"] - 0.25 * row["rollout/response_length"]
    assert abs(row["shaped/reward_mean"] - expected) < 1e-5 and "train/loss" in row
