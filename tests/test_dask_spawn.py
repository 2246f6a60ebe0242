"""The Dask workers a user's cluster starts: fresh interpreters (`spawn`, distributed's default).

The suite forks its local Dask workers from a forkserver to save their start-up imports (`conftest.py`); this
test keeps the user's path covered: a job runs to the end on a local cluster whose workers are spawned, each
one a child of its nanny (a forked one is the forkserver's child), with the metrics of the same job in process.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import dask
from conftest import TINY, local_runner, stable

from plexrl.hooks.base import Hook
from plexrl.job.load import load_job
from plexrl.job.spec import prepare_job
from plexrl.planner import Planner
from plexrl.runtime import Runner


def test_a_job_runs_on_spawned_dask_workers_as_in_process(tmp_path: Path) -> None:
    from plexrl.runtime.dask import DaskExecutor

    cfg = copy.deepcopy(TINY)
    cfg.update(name="spawned", run_dir=str(tmp_path / "runs"))
    cfg["tracking"]["mlflow"] = False
    parents: dict[str, tuple[int, int]] = {}

    class Parents(Hook):  # at the run's start, the cluster up: each worker's parent and its nanny
        def on_start(self, time: float) -> None:
            worker_parent = executor.client.run(os.getppid)
            nanny = executor.client.run(os.getpid, nanny=True)
            parents.update({w: (worker_parent[w], nanny[w]) for w in worker_parent})

    with dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}):
        executor = DaskExecutor(services=1, cpu_threads=1)
        (run,) = Runner(executor, Planner(clock=executor.clock), hooks=[Parents()]).run([prepare_job(load_job(cfg))])
    assert parents and all(ppid == nanny for ppid, nanny in parents.values()), parents  # spawned by its nanny
    assert run.status == "done", run.error
    cfg["name"], cfg["run_dir"] = "inline", str(tmp_path / "inline")
    (alone,) = local_runner().run([prepare_job(load_job(cfg))])
    assert alone.status == "done", alone.error
    assert stable(run.history) == stable(alone.history)
