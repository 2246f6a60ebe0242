"""Retries of a cpu node whose operator raises (`JobConfig.retry`): the node runs again on the same inputs
after a backoff, the job's metrics are exactly those of a run without the fault, and when the attempts run
out that job alone fails with the operator's error while another job finishes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import user_ops
from conftest import TINY, local_runner, stable

from plexrl.job.load import load_job
from plexrl.job.spec import prepare_job


def job(run_dir: Path, name: str, op: str, retry: dict[str, Any] | None = None, fail_runs: int = 2) -> Any:
    cfg = copy.deepcopy(TINY)
    cfg.update(name=name, iterations=3, run_dir=str(run_dir))
    cfg["tracking"]["mlflow"] = False
    params: dict[str, Any] = {"per_token": 0.25} | ({"fail_runs": fail_runs} if op.startswith("flaky") else {})
    cfg["pipeline"] = {"nodes": [
        {"name": "prompts", "op": "sample_prompts", "params": {"batch_size": 4}},
        {"name": "rollout", "op": "rollout", "inputs": {"prompts": "prompts"}, "params": {"n": 4, "max_new_tokens": 4}},
        {"name": "verify", "op": "verify", "inputs": {"rollouts": "rollout"}},
        {"name": "shaped", "op": f"user_ops:{op}", "params": params,
         "inputs": {"rollouts": "rollout", "rewards": "verify"}},
        {"name": "advantage", "op": "grpo_advantage", "inputs": {"rollouts": "rollout", "rewards": "shaped"}},
        {"name": "train", "op": "train", "inputs": {"rollouts": "rollout", "advantages": "advantage"}},
    ]}  # fmt: skip
    if retry is not None:
        cfg["retry"] = retry
    return prepare_job(load_job(cfg))


def test_a_failing_cpu_node_is_retried_with_backoff_and_learns_exactly_the_same(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs"
    user_ops.RUNS.clear()
    (plain,) = local_runner().run([job(run_dir, "plain", "length_penalty")])
    retry = {"attempts": 3, "backoff_s": 0.01, "factor": 3.0}
    (flaky,) = local_runner().run([job(run_dir, "flaky", "flaky_length_penalty", retry)])
    assert plain.status == "done" and flaky.status == "done", flaky.error
    assert {k: v for k, v in user_ops.RUNS.items() if k[0] == "flaky"} == {("flaky", i): 3 for i in range(3)}
    rename = [{k.replace("flaky", "plain"): v for k, v in row.items() if not k.startswith("retries/")} for row in
              stable(flaky.history)]  # fmt: skip
    assert rename == stable(plain.history)  # the same metrics: a retry computes what the first run would have
    for row in flaky.history[1:]:  # (row 0: the baseline pass)
        assert row["retries/shaped"] == 2.0
        assert abs(row["time/retry_wait_shaped"] - (0.01 + 0.03)) < 1e-9  # backoff_s, then backoff_s * factor


def test_when_the_attempts_run_out_only_that_job_fails_with_the_operators_error(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs"
    user_ops.RUNS.clear()
    retry = {"attempts": 2, "backoff_s": 0.0}
    doomed = job(run_dir, "doomed", "flaky_length_penalty", retry, fail_runs=5)
    bad, good = local_runner().run([doomed, job(run_dir, "good", "length_penalty")])
    assert good.status == "done" and good.iterations_done == 3
    assert bad.status == "failed" and bad.iterations_done == 0
    assert "ConnectionError: transient fault, run 2 of iteration 0 (after 2 runs)" in bad.error, bad.error
    assert user_ops.RUNS[("doomed", 0)] == 2
