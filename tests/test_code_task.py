"""The `code` task (program synthesis from input/output examples, rewarded by code_unit_tests in the
sandbox) and configs/grpo_code.yaml end to end at tiny sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plexrl.job.config import TaskConfig
from plexrl.job.load import load_job
from plexrl.job.tasks import CodeTask, make_task
from plexrl.runtime.jobs import run_jobs
from plexrl.tools import Sandbox

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "grpo_code.yaml"


def test_code_task_doctests() -> None:
    import doctest

    import plexrl.job.tasks.code as code

    result = doctest.testmod(code)
    assert result.attempted >= 2 and result.failed == 0


def test_code_task_splits_and_verifier() -> None:
    task = make_task(TaskConfig(name="code", digits=1, train_size=60, eval_size=20))
    assert isinstance(task, CodeTask)
    again = make_task(TaskConfig(name="code", digits=1, train_size=60, eval_size=20))
    assert task.train == again.train and task.held_out == again.held_out  # seeded
    assert not {p.prompt for p in task.train} & {p.prompt for p in task.held_out}
    problem = task.held_out[0]
    a, b = (int(v) for v in problem.solution.split("*x+"))
    assert problem.prompt == f"f(0)={b};f(1)={a + b};f(2)={2 * a + b};f="
    assert str(b) not in problem.answer.split('"cases"')[0]  # the reference holds hidden cases only
    completions = [problem.solution, f"{b}+x*{a}", f"({a}*x+{b})", str(b), f"{a}*x+{b}+0*(x-3)", "x+"]
    scores = task.verify(completions, [problem.answer] * len(completions))
    assert scores == [1.0, 1.0, 1.0, float(a == 0), 1.0, 0.0]
    with pytest.raises(ValueError, match="exceeds the 100 functions"):
        make_task(TaskConfig.model_construct(name="code", digits=1, digits_b=None, train_size=90, eval_size=20))


def test_grpo_code_runs_end_to_end_with_rewards_from_the_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[str] = []
    real_run = Sandbox.run

    def counting_run(self: Sandbox, code: str) -> Any:
        runs.append(code)
        return real_run(self, code)

    monkeypatch.setattr(Sandbox, "run", counting_run)
    overrides = {
        "run_dir": str(tmp_path / "runs"),
        "iterations": 2,
        "model": {"layers": 1, "hidden": 32, "heads": 2, "intermediate": 64, "max_position": 64},
        "warm_start": {"max_steps": 4, "batch_size": 16, "eval_every": 4, "eval_size": 8},
        "tracking": {"progress": False, "mlflow": False, "log_model": False},
    }
    loaded = load_job(CONFIG)
    cfg = loaded.config.model_dump() | overrides
    cfg["pipeline"] = {"name": "grpo", "params": {**cfg["pipeline"]["params"], "batch_size": 2, "n": 4}}
    cfg["pipeline"]["params"].update(eval_every=2, eval_size=8)
    (job,) = run_jobs([load_job(cfg)], progress=False)
    assert job.status == "done", job.error
    last = job.history[-1]
    assert "verify/reward_mean" in last and "evaluate/accuracy" in last
    assert 0.0 <= last["verify/reward_mean"] <= 1.0
    # warm-start check (8) + baseline eval (8) + 2 iterations x 2 prompts x 4 samples + final eval (8)
    assert len(runs) >= 2 * 2 * 4 + 8, len(runs)
    assert all("def f(x):" in code and "plexrl-outputs:" in code for code in runs)


TINY_SET = {
    "iterations": 2,
    "threads": 1,
    "model.layers": 1,
    "model.hidden": 32,
    "model.heads": 2,
    "model.intermediate": 64,
    "warm_start.max_steps": 4,
    "warm_start.batch_size": 16,
    "warm_start.eval_every": 4,
    "warm_start.eval_size": 8,
    "pipeline.params.batch_size": 2,
    "pipeline.params.n": 4,
    "pipeline.params.eval_every": 2,
    "pipeline.params.eval_size": 8,
    "tracking.mlflow": False,
    "tracking.log_model": False,
    "tracking.progress": False,
}


def test_the_code_job_multiplexes_with_the_arithmetic_job(tmp_path: Path) -> None:
    """configs/multiplex_code.yaml at tiny sizes, in process: both jobs share one service and finish."""
    import yaml

    from plexrl.cluster import load_cluster, run_cluster

    shipped = yaml.safe_load((CONFIG.parent / "multiplex_code.yaml").read_text())
    assert [j["config"] for j in shipped["jobs"]] == ["grpo_arithmetic.yaml", "grpo_code.yaml"]
    cluster = {**shipped, "driver": "local", "run_dir": str(tmp_path / "runs"), "progress": False, "mlflow": False}
    cluster["jobs"] = [
        {"config": str(CONFIG.parent / j["config"]), "set": {**j.get("set", {}), **TINY_SET}} for j in shipped["jobs"]
    ]
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    result = run_cluster(load_cluster(path))
    assert [j.status for j in result.jobs] == ["done", "done"], [j.error for j in result.jobs]
    assert all("verify/reward_mean" in j.history[-1] for j in result.jobs)
    assert [s.service for s in result.report.services if s.busy > 0] == ["service-0"]  # one shared service
