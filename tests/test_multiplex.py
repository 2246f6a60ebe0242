"""Many jobs on shared services, on the real stack (torch engines, real swaps, a real Dask cluster, MLflow).

- fidelity (docs invariant 4): a job that earns real rewards, multiplexed with two others on ONE
  service whose device memory holds a single job state (so every switch swaps, and the host budget forces
  spills to disk), produces the same per-iteration metrics AND bit-identical final weights as the job
  alone, in-process and on Dask, on CPU in fp32 (on CUDA: the same distribution, docs/gpu.md); its own state
  is counted moving between tiers;
- batches stay on the workers: on Dask, the bytes that reach the client per iteration do not grow with
  the batch (metrics only);
- isolation (invariant 5): a lost service worker fails only the jobs placed on it; a cancelled job ends as
  KILLED in MLflow while the others finish;
- the cluster config: validation errors that name the fix, and a run that ends with the accounting table
  and a cluster-level MLflow run linked to each job's run.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import TINY, local_runner, stable

from plexrl.hooks.base import Hook
from plexrl.job.load import load_job
from plexrl.job.spec import JobRun, JobSpec, prepare_job
from plexrl.planner import Hrrs, Planner
from plexrl.runtime import Budgets, NodeTask, Runner


def learning_job(run_dir: Path, name: str, seed: int, iterations: int = 3) -> dict[str, Any]:
    """A tiny job with a real learning signal (a length penalty; the tiny model never answers right)."""
    cfg = copy.deepcopy(TINY)
    cfg.update(name=name, seed=seed, iterations=iterations, run_dir=str(run_dir))
    cfg["tracking"]["mlflow"] = False
    cfg["pipeline"] = {"nodes": [
        {"name": "prompts", "op": "sample_prompts", "params": {"batch_size": 4}},
        {"name": "rollout", "op": "rollout", "inputs": {"prompts": "prompts"}, "params": {"n": 4, "max_new_tokens": 4}},
        {"name": "verify", "op": "verify", "inputs": {"rollouts": "rollout"}},
        {"name": "shaped", "op": "user_ops:length_penalty", "params": {"per_token": 0.25},
         "inputs": {"rollouts": "rollout", "rewards": "verify"}},
        {"name": "advantage", "op": "grpo_advantage", "inputs": {"rollouts": "rollout", "rewards": "shaped"}},
        {"name": "ref", "op": "logprob", "inputs": {"rollouts": "rollout"}, "params": {"which": "reference"}},
        {"name": "train", "op": "train", "params": {"kl": {"coef": 0.05}},
         "inputs": {"rollouts": "rollout", "advantages": "advantage", "ref_logprobs": "ref"}},
        {"name": "evaluate", "op": "evaluate", "after": ["train"], "every": 2, "params": {"size": 16}},
    ]}  # fmt: skip
    return cfg


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mux") / "runs"


def rewarded_job(run_dir: Path, iterations: int = 3) -> dict[str, Any]:
    """Job "a": 1-digit addition after a longer warm start, so its model answers some prompts right and its
    rewards, advantages and accuracy are real numbers (not all zero), and it saves its final model."""
    cfg = learning_job(run_dir, "a", 0, iterations)
    cfg["task"] = {"digits": 1, "train_size": 80, "eval_size": 16}
    cfg["warm_start"] = {
        "max_steps": 150, "batch_size": 16, "eval_every": 10, "eval_size": 16, "stop_at_accuracy": 0.15, "lr": 1e-2,
    }  # fmt: skip
    cfg["tracking"]["log_model"] = True
    return cfg


def final_weights(run: JobRun) -> dict[str, Any]:
    """The saved final model's tensors (read at once: a later run of the same job writes the same path)."""
    from safetensors.torch import load_file

    (path,) = Path(run.artifacts["model"]).glob("*.safetensors")
    return load_file(str(path))


def same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def alone(run_dir: Path) -> tuple[JobRun, dict[str, Any]]:
    (job,) = local_runner().run([prepare_job(load_job(rewarded_job(run_dir)))])
    assert job.status == "done", job.error
    return job, final_weights(job)


def mix(run_dir: Path) -> list[JobSpec]:
    cfgs = [rewarded_job(run_dir), learning_job(run_dir, "b", 1), learning_job(run_dir, "c", 2)]
    return [prepare_job(load_job(cfg)) for cfg in cfgs]


def one_state_budget(jobs: list[JobSpec], on_device: int = 1) -> Budgets:
    size = max(j.state_bytes() for j in jobs)
    return Budgets(device=on_device * size, host=size)  # the rest spills to disk


def count_moves(runner: Runner, job_id: str) -> dict[str, int]:
    """Wrap the executor's submit: count the moves of `job_id`'s state, by destination tier."""
    moves: dict[str, int] = {}
    submit = runner.executor.submit

    def counting(task: NodeTask) -> int:
        for m in (*task.swaps, *task.prefetch):
            if m.job_id == job_id:
                moves[m.dst] = moves.get(m.dst, 0) + 1
        return submit(task)

    runner.executor.submit = counting  # type: ignore[method-assign]
    return moves


def test_multiplexed_with_swaps_and_spills_learns_exactly_as_alone_inline(
    run_dir: Path, alone: tuple[JobRun, dict[str, Any]]
) -> None:
    job, weights = alone
    learned = stable(job.history)
    assert learned[1]["train/loss"] != learned[2]["train/loss"]  # weights really change between iterations
    assert any(row.get("verify/reward_mean", 0) > 0 for row in learned)  # real rewards, not all zero
    assert any(row.get("evaluate/accuracy", 0) > 0 for row in learned)
    jobs = mix(run_dir)
    runner = local_runner(services=1, ordering=Hrrs(), budgets=one_state_budget(jobs))
    moves = count_moves(runner, "a")
    runs = runner.run(jobs)
    assert [j.status for j in runs] == ["done"] * 3, [j.error for j in runs]
    assert stable(runs[0].history) == learned
    assert same_weights(final_weights(runs[0]), weights)
    assert stable(runs[1].history) != learned
    assert moves.get("device", 0) >= 2 and moves.get("host", 0) + moves.get("disk", 0) >= 2, moves
    report = runner.service_reports["service-0"]
    assert report["bytes_to_tier"].get("disk", 0) > 0 and report["bytes_to_tier"]["device"] > 0


class CancelAfterFirstIteration(Hook):
    def __init__(self, job_id: str) -> None:
        self.job_id, self.runner = job_id, None

    def on_iteration_end(self, job: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        if job.job_id == self.job_id and iteration == 0 and self.runner is not None:
            self.runner.cancel(self.job_id)


def external_cluster() -> Any:
    """A running Dask cluster: one worker with a GPU resource (a service), one CPU-pool worker."""
    import dask
    from distributed import Nanny, Scheduler, SpecCluster

    with dask.config.set({"distributed.nanny.pre-spawn-environ": {}}):
        return SpecCluster(
            workers={
                "gpu-worker": {"cls": Nanny, "options": {"nthreads": 2, "resources": {"GPU": 1}}},
                "cpu-worker": {"cls": Nanny, "options": {"nthreads": 2}},
            },
            scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
            silence_logs=logging.ERROR,
        )


def dask_runner(scheduler: str | None = None, *, ordering: Any = None, **kwargs: Any) -> Runner:
    """A Runner over a Dask executor (`executor`: its arguments), the planner as on Dask (lookahead, inline cpu
    nodes) with `ordering`; the other `kwargs` are the runner's."""
    from plexrl.runtime.dask import DaskExecutor

    executor = DaskExecutor(scheduler=scheduler, validate=True, **kwargs.pop("executor", {}))
    planner = Planner(clock=executor.clock, validate=True, lookahead=True, inline_below=0.01, ordering=ordering)
    return Runner(executor, planner, **kwargs)


def test_dask_multiplexed_fidelity_and_cancel_leave_the_other_jobs_running(
    run_dir: Path, alone: tuple[JobRun, dict[str, Any]]
) -> None:
    from distributed import Client
    from mlflow.tracking import MlflowClient

    import plexrl.runtime.dask_tasks as dask_tasks
    from plexrl.hooks.mlflow_hook import MlflowHook

    cfgs = [rewarded_job(run_dir), learning_job(run_dir, "b", 1), learning_job(run_dir, "c", 2)]
    for cfg in cfgs:
        cfg["tracking"]["mlflow"] = True
    jobs = [prepare_job(load_job(cfg)) for cfg in cfgs]
    cancel = CancelAfterFirstIteration("c")
    cluster = external_cluster()  # as `plexrl run --scheduler ADDRESS` would find it
    try:
        runner = dask_runner(
            cluster.scheduler_address, ordering=Hrrs(), budgets=one_state_budget(jobs, on_device=2),
            hooks=[cancel, MlflowHook()],
        )  # fmt: skip
        cancel.runner = runner  # type: ignore[assignment]
        moves = count_moves(runner, "a")
        a, b, c = runner.run(jobs)
        with Client(cluster) as client:  # the cluster outlives the runner, its services are stopped
            assert len(client.scheduler_info()["workers"]) == 2
            assert set(client.run(lambda: len(dask_tasks._SERVICES)).values()) == {0}
    finally:
        cluster.close()
    assert (a.status, b.status, c.status) == ("done", "done", "cancelled"), [j.error for j in (a, b, c)]
    job, weights = alone
    assert stable(a.history) == stable(job.history)
    assert same_weights(final_weights(a), weights)
    assert moves.get("device", 0) >= 1 and moves.get("host", 0) + moves.get("disk", 0) >= 1, moves
    assert c.iterations_done == 1 and "cancelled" in c.error
    client = MlflowClient(tracking_uri=a.tracking["uri"])
    assert client.get_run(a.tracking["run_id"]).info.status == "FINISHED"
    killed = client.get_run(c.tracking["run_id"])
    assert killed.info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(killed.info.run_id, "shaped/reward_mean")] == [1]
    assert runner.service_reports["service-0"]["moves"] > 0
    assert runner.planner.sent_ahead > 0  # nodes were sent while another job's node ran (lookahead)


def test_dask_lookahead_starts_the_next_nodes_swaps_while_a_node_runs(run_dir: Path) -> None:
    """Three jobs on one service whose device holds two states: with lookahead the next node's swaps are
    handed to the service's background thread while the node before it still computes (`Service.start_early`),
    and every job logs what it logs in the same mix in-process (no lookahead, blocking swaps)."""
    names = (("x", 5), ("y", 6), ("z", 7))
    cfgs = [learning_job(run_dir, name, seed, iterations=3) for name, seed in names]
    jobs = [prepare_job(load_job(cfg)) for cfg in cfgs]
    inline = local_runner(services=1, ordering=Hrrs(), budgets=one_state_budget(jobs, on_device=2)).run(jobs)
    assert [j.status for j in inline] == ["done"] * 3, [j.error for j in inline]
    jobs = [prepare_job(load_job(cfg)) for cfg in cfgs]
    runner = dask_runner(executor={"cpu_threads": 2}, ordering=Hrrs(), budgets=one_state_budget(jobs, on_device=2))
    runs = runner.run(jobs)
    assert [j.status for j in runs] == ["done"] * 3, [j.error for j in runs]
    assert [stable(j.history) for j in runs] == [stable(j.history) for j in inline]
    report = runner.service_reports["service-0"]
    assert runner.planner.sent_ahead > 0 and report["moves"] > 0
    assert report["early_starts"] > 0 and report["early_during_previous"] > 0, report
    assert report["early_swap_seconds"] > 0, report


def test_a_lost_service_worker_fails_its_jobs_only(run_dir: Path) -> None:
    doomed = learning_job(run_dir, "doomed", 3)
    doomed["pipeline"]["nodes"].append(
        {"name": "crash", "op": "user_ops:kill_own_worker", "after": ["train"], "params": {"at_iteration": 1}}
    )
    jobs = [prepare_job(load_job(doomed)), prepare_job(load_job(learning_job(run_dir, "survivor", 4)))]
    runner = dask_runner(executor={"services": 2, "cpu_threads": 1, "poll": 0.2}, poll=0.2)  # spread
    lost, survivor = runner.run(jobs)
    assert survivor.status == "done" and survivor.iterations_done == 3
    assert lost.status == "failed" and "lost" in lost.error and lost.iterations_done == 1
    assert lost.service != survivor.service


def test_cluster_config_errors_name_the_fix(tmp_path: Path) -> None:
    from plexrl.cluster import load_cluster
    from plexrl.errors import ConfigError

    job = learning_job(tmp_path / "runs", "j", 0)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "services": {"count": 1, "device_memory": "10KB", "threads": 1},
        "jobs": [{"job": job}, {"job": job}, {"config": "missing.yaml"}, {"job": job, "set": {"iterations": 0}}],
        "placment": "pack",
    }))  # fmt: skip
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert "placment" in str(err.value) and "placement" in str(err.value)
    path.write_text(path.read_text().replace("placment", "placement"))
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    text = str(err.value)
    assert "services.device_memory is 0.0 MiB" in text and "raise services.device_memory" in text
    assert "two jobs are named 'j'" in text
    assert "jobs[2]" in text and "file not found" in text
    assert "jobs[3].iterations" in text


def test_cluster_run_prints_accounting_and_links_mlflow_runs(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from plexrl.accounting import format_report
    from plexrl.cluster import load_cluster, run_cluster

    runs = tmp_path / "runs"
    jobs = []
    for name, seed in (("x", 0), ("y", 1)):
        job = learning_job(runs, name, seed, iterations=2)
        job["tracking"]["mlflow"] = True
        jobs.append({"job": job})
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "name": "two", "run_dir": str(runs), "driver": "local", "placement": "pack", "progress": False,
        "services": {"count": 2, "device_memory": "4MB"}, "jobs": jobs,
    }))  # fmt: skip
    result = run_cluster(load_cluster(path))
    rep = result.report
    assert [j.status for j in result.jobs] == ["done", "done"]
    used = [s for s in rep.services if s.busy > 0]
    assert len(used) == 1 and len(rep.services) == 2  # pack: both jobs on one service, the other idle
    assert all(abs(s.busy + s.swap + s.startup + s.idle - s.allocated) < 1e-6 for s in rep.services)
    assert sum(j.allocated for j in rep.jobs) == pytest.approx(used[0].allocated, rel=1e-6)
    assert all(j.steps == 2 and j.cost_per_step > 0 for j in rep.jobs)
    table = format_report(rep)
    assert "service-0" in table and "acc-s/step" in table and "x" in table
    assert result.timeline is not None and result.timeline.is_file()
    client = MlflowClient(tracking_uri=result.tracking["uri"])
    run = client.get_run(result.tracking["run_id"])
    assert run.data.tags["plexrl.kind"] == "cluster" and run.info.status == "FINISHED"
    assert run.data.params["placement"] == "pack"
    x = result.jobs[0]
    assert run.data.tags["plexrl.job.x"] == x.tracking["run_id"]
    assert client.get_run(x.tracking["run_id"]).data.tags["plexrl.cluster_run"] == run.info.run_id
    assert run.data.metrics["job/x/steps"] == 2
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"report.txt", "report.json", "timeline.png"}


class Interrupt(Hook):
    def __init__(self) -> None:
        self.runs: dict[str, JobRun] = {}

    def on_job_start(self, run: JobRun) -> None:
        self.runs[run.job_id] = run

    def on_iteration_end(self, job: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        if job.job_id == "y" and iteration == 0:
            raise KeyboardInterrupt


def test_ctrl_c_closes_every_job_as_killed_and_keeps_what_was_logged(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from plexrl.cluster import load_cluster, run_cluster

    runs = tmp_path / "runs"
    jobs = []
    for name, seed in (("x", 0), ("y", 1)):
        job = learning_job(runs, name, seed, iterations=3)
        job["tracking"]["mlflow"] = True
        jobs.append({"job": job})
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(runs), "driver": "local", "progress": False, "jobs": jobs}))
    interrupt = Interrupt()
    with pytest.raises(KeyboardInterrupt):
        run_cluster(load_cluster(path), hooks=[interrupt])
    x, y = (interrupt.runs[n] for n in ("x", "y"))
    assert x.status == y.status == "cancelled" and "KeyboardInterrupt" in y.error
    client = MlflowClient(tracking_uri=y.tracking["uri"])
    for job in (x, y):
        run = client.get_run(job.tracking["run_id"])
        assert run.info.status == "KILLED"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "evaluate/accuracy")] == [0]
    (cluster_run,) = client.search_runs(
        [client.get_experiment_by_name("plexrl").experiment_id], "tags.`plexrl.kind` = 'cluster'"
    )
    assert cluster_run.info.status == "FAILED"
