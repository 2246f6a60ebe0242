"""Checkpoints: a job stopped after iteration j and resumed from its checkpoint logs, for every later iteration,
exactly the metrics of an uninterrupted run (bitwise, inline executor, CPU fp32); a checkpoint is taken from
whichever tier holds the state without moving it; a failed write leaves the previous checkpoint intact."""

from __future__ import annotations

import dataclasses
import errno
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import local_runner

from plexrl.hooks.base import Hook
from plexrl.job.load import load_job
from plexrl.job.spec import JobRun, prepare_job
from plexrl.planner.state import Move
from plexrl.services import swap as sw


class Rows(Hook):
    """Each iteration's metrics by the job's iteration (real numbers, a resumed job's too), timings left out
    (they are wall-clock)."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        self.rows[iteration] = {k: v for k, v in metrics.items() if not k.startswith("time/") and "per_s" not in k}


@pytest.mark.slow
def test_resume_from_a_checkpoint_is_exact(tmp_path: Path, tiny_config: dict[str, Any]) -> None:
    tiny_config["iterations"] = 4
    tiny_config["tracking"]["mlflow"] = False
    spec = prepare_job(load_job(tiny_config))
    alone = Rows()
    local_runner(hooks=[alone]).run([spec])
    assert sorted(alone.rows) == [-1, 0, 1, 2, 3]

    path = tmp_path / "ckpt" / "job.pt"
    first = Rows()
    runner = local_runner(hooks=[first])

    class CheckpointThenStop(Hook):
        def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
            if iteration == 1:
                assert run.service is not None
                runner.executor.checkpoint(run.job_id, run.service, path, {"iteration": 1})  # type: ignore[attr-defined]
                runner.stop("stopped after iteration 1")

    runner.hooks.hooks.append(CheckpointThenStop())
    (stopped,) = runner.run([spec])
    assert stopped.status == "cancelled" and sorted(first.rows) == [-1, 0, 1]
    assert sw.load_checkpoint(path)["iteration"] == 1

    resumed = Rows()
    spec2 = dataclasses.replace(spec, first_iteration=2, resume_state=path)
    (run,) = local_runner(hooks=[resumed]).run([spec2])
    assert run.status == "done" and run.iterations_done == 2
    assert sorted(resumed.rows) == [2, 3]  # no baseline pass, iterations numbered as in the first run
    for it in (2, 3):
        assert resumed.rows[it] == alone.rows[it], f"iteration {it} differs after resuming"
    assert "evaluate/accuracy" in resumed.rows[3]  # the periodic evaluation stayed in phase (every 2, and last)
    # and without the checkpoint's state the same iterations differ (the test can fail)
    cold = Rows()
    local_runner(hooks=[cold]).run([dataclasses.replace(spec, first_iteration=2)])
    assert any(cold.rows[it] != alone.rows[it] for it in (2, 3))


def test_checkpoint_from_every_tier_without_moving_and_atomic_on_failure(
    tmp_path: Path, tiny_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from plexrl.services.service import Service

    spec = prepare_job(load_job(tiny_config))
    svc = Service("service-0", "cpu", spill_dir=tmp_path / "spill", validate=True)
    try:
        svc.load_job(spec)
        job = spec.job_id
        saved = {}
        for src, dst in ((None, None), ("device", "host"), ("host", "disk")):
            if src is not None:
                svc.apply([Move(job, src, dst, 0)])  # type: ignore[arg-type]
            tier = svc.tier(job)
            saved[tier] = sw.load_checkpoint(svc.checkpoint(job, tmp_path / f"{tier}.pt", {"tier": tier}))
            assert svc.tier(job) == tier  # not moved
        ref = saved["device"]["engine"]
        for tier in ("host", "disk"):
            got = saved[tier]["engine"]
            assert got["weight_version"] == ref["weight_version"] and set(got["policy"]) == set(ref["policy"])
            assert all(torch.equal(got["policy"][k], ref["policy"][k]) for k in ref["policy"])
        svc.apply([Move(job, "disk", "device", 0)])  # the live state is intact after the exports
        assert all(torch.equal(v, ref["policy"][k]) for k, v in svc.engines[job].policy.state_dict().items())

        # a write that fails half-way (disk full) leaves the previous checkpoint whole and no temp file
        good = tmp_path / "device.pt"
        before = good.read_bytes()

        def full(obj: Any, f: Any) -> None:
            f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(sw.torch, "save", full)
        with pytest.raises(OSError, match="No space left"):
            svc.checkpoint(job, good, {})
        assert good.read_bytes() == before and not list(tmp_path.glob(".*.tmp"))
        monkeypatch.undo()
        blocked = tmp_path / "a-file"
        blocked.write_text("")
        with pytest.raises(OSError):  # the directory cannot be created: a clear OSError, nothing written
            svc.checkpoint(job, blocked / "x.pt", {})
    finally:
        svc.close()


@pytest.mark.slow
def test_server_resumes_from_the_checkpoint_exactly_in_the_same_mlflow_run(
    tmp_path: Path, tiny_config: dict[str, Any]
) -> None:
    """A job checkpointed every 2 iterations, stopped (SIGTERM path) after iteration 2, resumes after a restart
    from the checkpoint after iteration 1: iterations 2..5 log exactly the uninterrupted run's metrics, in the
    same MLflow run, each step once."""
    import threading

    import yaml
    from mlflow.tracking import MlflowClient

    from plexrl.runtime.build import build_runner
    from plexrl.runtime.jobs import standard_hooks
    from plexrl.server.api import start_server
    from plexrl.server.client import Client, ServerError
    from plexrl.server.config import ServerConfig
    from plexrl.server.journal import Journal

    tiny_config["iterations"] = 6
    reference = Rows()
    local_runner(hooks=[reference]).run([prepare_job(load_job({**tiny_config, "tracking": {"mlflow": False}}))])
    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(yaml.safe_dump(tiny_config))
    run_dir = Path(tiny_config["run_dir"])
    cfg = ServerConfig(
        port=0, journal=str(tmp_path / "journal.db"), run_dir=str(run_dir), checkpoint_every=2,
        cluster={"driver": "local"},
    )  # fmt: skip

    class Gate(Hook):
        def __init__(self) -> None:
            self.reached, self.release = threading.Event(), threading.Event()

        def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
            if iteration == 2:
                self.reached.set()
                assert self.release.wait(60)

    gate = Gate()
    hooks = [*standard_hooks(run_dir, progress=False, mlflow=True), gate]
    srv = start_server(
        cfg, runner=lambda more_hooks=(), **parts: build_runner(cfg.cluster, [*hooks, *more_hooks], **parts)
    )
    try:
        c = Client(srv.url)
        with pytest.raises(ServerError, match="does not divide the server's checkpoint_every"):
            c.submit(job_yaml, ["pipeline.params.eval_every=4"])
        job_id = c.submit(job_yaml)["job_id"]
        assert gate.reached.wait(120)
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        assert srv.controller.stopping.wait(60)
        gate.release.set()
        stopper.join(120)
    finally:
        gate.release.set()
        srv.stop()
    j = Journal(cfg.journal)
    entry = j.get(job_id)
    assert entry is not None and entry.status == "queued" and entry.checkpoint_iteration == 1
    assert entry.checkpoint is not None and Path(entry.checkpoint).is_file()
    j.close()

    srv = start_server(cfg)  # a fresh server on the same journal
    try:
        c = Client(srv.url)
        deadline = time.monotonic() + 120
        while c.status(job_id)["status"] not in ("done", "failed") and time.monotonic() < deadline:
            time.sleep(0.02)  # poll with a deadline
        done = c.status(job_id)
        assert done["status"] == "done" and done["attempt"] == 2 and done["iterations_done"] == 6, done
        events = c.events(job_id)["events"]
    finally:
        srv.stop()
    again = {
        e["data"]["iteration"]: e["data"]["metrics"] for e in events if e["kind"] == "iteration" and e["attempt"] == 2
    }
    assert sorted(again) == [2, 3, 4, 5]  # resumed after the checkpoint: iteration 2 runs again, 0 and 1 do not
    for it, metrics in again.items():
        kept = {k: v for k, v in metrics.items() if not k.startswith("time/") and "per_s" not in k}
        assert kept == reference.rows[it], f"iteration {it} differs from the uninterrupted run"
    checkpoints = [(e["attempt"], e["data"]["iteration"]) for e in events if e["kind"] == "checkpoint"]
    assert checkpoints == [(1, 1), (2, 3)]  # none after the last iteration
    assert not (cfg.checkpoints() / job_id).exists()  # removed once the job is done
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("plexrl").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_id == done["tracking"]["run_id"]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "time/iteration")]
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]  # every step once: step 3 of the first attempt is not repeated
