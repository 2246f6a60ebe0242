"""Bounded work: what one job may cost on `plexrl serve`. Enormous but valid jobs are refused with 400
naming their field before any work; reward time limits are capped by the server; a CPU node that
hangs (holding the GIL) fails its job and never the server (the local driver); a job past the server's
time limit fails with the reason; the open jobs together are bounded."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import TINY, wait_for
from test_server import serving

from plexrl.errors import ConfigError
from plexrl.server.api import RunningServer, start_server
from plexrl.server.client import Client, ServerError
from plexrl.server.config import ServerConfig
from plexrl.server.submissions import check_submission


def refused(tmp_path: Path, job: dict[str, Any], limits: Any = None, *more: Path) -> str:
    """The problems of a submission the server's default limits refuse (check_submission: what POST /jobs runs);
    `more`: allowed roots besides tmp_path/runs."""
    from plexrl.server.limits import JobLimits

    roots = [(tmp_path / "runs").resolve(), *(m.resolve() for m in more)]
    with pytest.raises(ConfigError) as err:
        check_submission(yaml.safe_dump(job), [], run_dir=roots[0], roots=roots, modules=["plexrl"],
                         limits=limits or JobLimits())  # fmt: skip
    return str(err.value)


def tiny(**changes: Any) -> dict[str, Any]:
    job = copy.deepcopy(TINY)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        at = job
        for p in parents:
            at = at.setdefault(p, {})
        at[last] = value
    return job


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"iterations": 10**18}, "iterations", "limits.max_iterations"),
        ({"task__train_size": 10**9, "task__digits": 9}, "task.train_size", "limits.max_train_size"),
        # a 68.7e9-parameter built model (the issue's): it would be built in the preparation
        ({"model__layers": 64, "model__hidden": 8192, "model__heads": 64, "model__intermediate": 32768},
         "model (layers, hidden, intermediate)", "limits.max_parameters"),
        ({"pipeline__params__n": 1024, "pipeline__params__batch_size": 65536}, "n x batch_size",
         "limits.max_rollout_tokens"),
        ({"pipeline__params__eval_size": 10**9}, "eval_size", "limits.max_eval_size"),
        ({"engine": "vllm", "vllm__kv_cache_mb": 1 << 20, "model__hidden": 64, "model__heads": 2},
         "vllm.kv_cache_mb", "limits.max_kv_cache_bytes"),
    ],
)  # fmt: skip
def test_an_enormous_valid_job_is_refused_naming_its_field(
    tmp_path: Path, changes: dict[str, Any], field: str, words: str
) -> None:
    """Each was accepted with 201 (the server's defaults), then exhausted its memory; now a 400 naming it."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tiny(**changes)))
    with serving(tmp_path) as srv:
        c = Client(srv.url)
        with pytest.raises(ServerError) as err:
            c.submit(path)
        assert err.value.status == 400 and field in str(err.value) and words in str(err.value), str(err.value)
        assert c.jobs() == []


def test_a_lora_rank_and_a_reward_time_limit_over_the_servers_are_refused(tmp_path: Path, smol_tiny: Path) -> None:
    from plexrl.server.limits import JobLimits

    (tmp_path / "runs").mkdir()
    job = tiny(model={"path": str(smol_tiny), "lora": {"r": 1024}})
    assert "model.lora.r" in refused(tmp_path, job, JobLimits(max_lora_r=256), smol_tiny)
    data = tmp_path / "runs" / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n' * 20)
    rewards = [{"name": "numeric", "timeout_s": 600}]
    job = tiny(model={"path": str(smol_tiny)}, warm_start={"enabled": False},
               data={"train": str(data), "held_out_fraction": 0.2, "rewards": rewards})  # fmt: skip
    text = refused(tmp_path, job, None, smol_tiny)
    assert "data.rewards[0].timeout_s" in text and "limits.max_reward_timeout_s" in text, text


def test_the_open_jobs_together_are_bounded(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**TINY, "iterations": 10**5}))  # (simulated: they stay open for the test)
    with serving(tmp_path, limits={"max_open_jobs": 2}) as srv:
        c = Client(srv.url)
        c.submit(job)
        c.submit(job)
        with pytest.raises(ServerError) as err:
            c.submit(job)
        assert err.value.status == 400 and "limits.max_open_jobs" in str(err.value)
        assert len(c.jobs()) == 2


def test_a_job_past_the_servers_time_limit_fails_with_the_reason(tmp_path: Path) -> None:
    from plexrl.server.housekeeping import Housekeeping

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**TINY, "iterations": 10**5}))
    with serving(tmp_path, limits={"max_run_s": 3600}) as srv:
        c = Client(srv.url)
        job_id = c.submit(job)["job_id"]
        wait_for(lambda: c.status(job_id)["status"] == "running", "the long job placed")
        later = time.time() + 7200  # the housekeeping's clock, two hours on: the same pass the thread makes
        house = Housekeeping(srv.journal, srv.controller, tmp_path / "ckpt", max_run_s=3600, retention_s=0,
                             clock=lambda: later)  # fmt: skip
        house.sweep()
        row = c.status(job_id)
        assert row["status"] == "failed" and "limits.max_run_s" in row["reason"], row
        wait_for(lambda: not srv.controller.runner.planner.view().jobs, "the runner let the job go")
        assert c.request("GET", "/health")["ok"] is True


HOLD_GIL = """
from plexrl import operator, Rewards


@operator(runs_on="cpu")
def hold_gil(rewards: Rewards) -> Rewards:
    import re

    re.match(r"(a|a)*b", "a" * 64)  # backtracking in C: holds the GIL for ~2**64 steps
    return rewards
"""


@contextmanager
def local_server(tmp_path: Path, modules: tuple[str, ...] = (), **limits: Any) -> Iterator[RunningServer]:
    cfg = ServerConfig(port=0, journal=str(tmp_path / "journal.db"), run_dir=str(tmp_path / "runs"), mlflow=False,
                       cluster={"driver": "local"}, limits={"prepare_memory": None, **limits},
                       allowed_modules=["plexrl", *modules])  # fmt: skip
    srv = start_server(cfg)
    try:
        yield srv
    finally:
        srv.stop(60)


def test_a_cpu_node_that_holds_the_gil_fails_its_job_and_health_keeps_answering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local driver runs every node in the server's process: a CPU node stuck in `re` (GIL held) froze
    /health for good. Now the node runs in a worker process, killed past limits.max_cpu_node_s: the job fails
    with that reason, /health answers throughout, and the next job runs."""
    (tmp_path / "gil_ops.py").write_text(HOLD_GIL)
    monkeypatch.syspath_prepend(str(tmp_path))
    job = {**copy.deepcopy(TINY), "iterations": 1, "warm_start": {"enabled": False}}
    job["tracking"]["mlflow"] = False
    job["pipeline"] = {"nodes": [
        {"name": "prompts", "op": "sample_prompts", "params": {"batch_size": 2}},
        {"name": "rollout", "op": "rollout", "inputs": {"prompts": "prompts"}, "params": {"n": 2, "max_new_tokens": 3}},
        {"name": "verify", "op": "verify", "inputs": {"rollouts": "rollout"}},
        {"name": "stuck", "op": "gil_ops:hold_gil", "inputs": {"rewards": "verify"}},
    ]}  # fmt: skip
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    with local_server(tmp_path, ("gil_ops",), max_cpu_node_s=4) as srv:
        c = Client(srv.url, timeout=20)  # /health must answer each call within this, while the node is stuck
        job_id = _submit(c, path)
        seen = []

        def ended() -> bool:
            seen.append(c.request("GET", "/health")["ok"])
            return c.status(job_id)["status"] in ("failed", "done")

        wait_for(ended, "the stuck job ended", timeout=180, interval=0.2)
        row = c.status(job_id)
        assert row["status"] == "failed" and "limits.max_cpu_node_s" in row["reason"], row
        assert seen and all(seen)


def _submit(c: Client, path: Path) -> str:
    answer: str = c.submit(path)["job_id"]
    return answer
