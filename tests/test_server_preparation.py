"""A job's preparation (task, model build, warm start) ran in the server process: a
68.7e9-parameter built model was built there, and memory was not returned. Now it runs first in a child process
within `limits.prepare_memory` and `limits.prepare_timeout_s`, killed on cancel: the job fails with the reason
and the server's own memory does not hold the model; a cancelled preparation leaves no process behind."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml
from conftest import TINY, wait_for
from test_server_paths import real_server

from plexrl.server.client import Client


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def children(name: str) -> list[int]:
    """Processes of this test process whose command line names `name`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and name in cmd:
            out.append(int(pid))
    return out


def job(**changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(TINY)
    out["tracking"]["mlflow"] = False
    out.update(iterations=1, **changes)
    return out


def test_a_model_too_big_for_the_preparations_memory_fails_its_job_not_the_server(tmp_path: Path) -> None:
    big = job(model={"layers": 8, "hidden": 2048, "heads": 16, "intermediate": 8192},  # 537M parameters, 2.1 GB
              warm_start={"enabled": False})  # fmt: skip
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(big))
    before = rss_bytes()
    with real_server(tmp_path, [tmp_path / "runs"], limits={"prepare_memory": "2GiB"}) as srv:
        c = Client(srv.url)
        job_id = c.submit(path)["job_id"]
        wait_for(lambda: c.status(job_id)["status"] in ("failed", "done"), "the big job ended", timeout=300)
        row = c.status(job_id)
        assert row["status"] == "failed" and "limits.prepare_memory" in row["reason"], row
        assert c.request("GET", "/health")["ok"] is True
        assert rss_bytes() - before < 1 << 30  # the 2.1 GB of weights were never in this process
        small = tmp_path / "small.yaml"
        small.write_text(yaml.safe_dump(job()))
        ok = c.submit(small)["job_id"]  # the next job prepares (in its own child) and runs
        wait_for(lambda: c.status(ok)["status"] == "done", "the small job done", timeout=300)


def test_a_cancelled_preparation_kills_its_process(tmp_path: Path) -> None:
    slow = job(warm_start={**TINY["warm_start"], "max_steps": 5000, "stop_at_accuracy": 1.0, "eval_every": 1000})
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(slow))
    with real_server(tmp_path, [tmp_path / "runs"]) as srv:
        c = Client(srv.url)
        job_id = c.submit(path)["job_id"]
        wait_for(lambda: children("_prepare_child"), "the preparation's process started", timeout=120)
        c.cancel(job_id)
        wait_for(lambda: not children("_prepare_child"), "the preparation's process gone", timeout=60)
        assert c.status(job_id)["status"] == "cancelled"
