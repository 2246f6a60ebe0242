"""Start-up overlap: jobs submitted together are shipped to the executor at once, a job's hooks
set up (its MLflow run created) while its load already runs on its service, the MLflow run off the runner's
thread. Real runner, in-process executor, real MLflow (sqlite)."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

from conftest import TINY

from plexrl.hooks.base import Hook
from plexrl.hooks.mlflow_hook import MlflowHook
from plexrl.job.load import load_job
from plexrl.job.spec import JobRun, prepare_job
from plexrl.planner import Planner
from plexrl.runtime import InlineExecutor, Runner


def specs(tmp_path: Path, n: int, mlflow: bool = False) -> list[Any]:
    out = []
    for i in range(n):
        cfg = copy.deepcopy(TINY)
        cfg.update(name=f"j{i}", seed=i, iterations=1, run_dir=str(tmp_path / "runs"))
        cfg["tracking"]["mlflow"] = mlflow
        out.append(prepare_job(load_job(cfg)))
    return out


class Meeting(InlineExecutor):
    """Each `ship` waits (up to 10 s) until `n` ships are in flight at once: only concurrent shipping passes.
    Records which jobs were loaded before their `on_job_start`."""

    def __init__(self, n: int) -> None:
        super().__init__(services=1)
        self.barrier = threading.Barrier(n, timeout=10)
        self.loaded: set[str] = set()

    def ship(self, spec: Any) -> None:
        self.barrier.wait()
        super().ship(spec)

    def load(self, job_id: str, service_id: str, tier: Any) -> Any:
        self.loaded.add(job_id)
        return super().load(job_id, service_id, tier)


class LoadedFirst(Hook):
    def __init__(self, ex: Meeting) -> None:
        self.ex = ex
        self.seen: dict[str, bool] = {}

    def on_job_start(self, run: JobRun) -> None:
        self.seen[run.job_id] = run.job_id in self.ex.loaded


def test_jobs_submitted_together_ship_at_once_and_start_their_hooks_after_their_load(tmp_path: Path) -> None:
    ex = Meeting(3)
    hook = LoadedFirst(ex)
    runs = Runner(ex, Planner(clock=ex.clock), hooks=[hook]).run(specs(tmp_path, 3))
    assert [r.status for r in runs] == ["done"] * 3, [r.error for r in runs]  # serial ships would break the barrier
    assert hook.seen == {"j0": True, "j1": True, "j2": True}


def test_mlflow_params_and_artifacts_are_written_off_the_runners_thread(tmp_path: Path, monkeypatch: Any) -> None:
    threads: list[str] = []
    original = MlflowHook._start

    def recording(self: MlflowHook, job: JobRun, client: Any, run_id: str) -> None:
        threads.append(threading.current_thread().name)
        original(self, job, client, run_id)

    monkeypatch.setattr(MlflowHook, "_start", recording)
    ex = InlineExecutor(services=1)
    hook = MlflowHook()
    runs = Runner(ex, Planner(clock=ex.clock), hooks=[hook]).run(specs(tmp_path, 2, mlflow=True))
    assert [r.status for r in runs] == ["done", "done"]
    assert threads and all(t.startswith("mlflow-start") for t in threads)
    client = next(iter(hook.clients.values()))
    for r in runs:  # each run finished with its params and metrics: later calls waited for the background writes
        got = client.get_run(r.tracking["run_id"])
        assert got.info.status == "FINISHED" and got.data.metrics and got.data.params["name"] == r.job_id
