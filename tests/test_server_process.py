"""Real processes, real jobs: `plexrl serve` stopped by SIGTERM (graceful: the job goes back to the queue, its
MLflow run ends KILLED), restarted on the same journal (the job runs again, from scratch), killed with SIGKILL
mid-job and restarted (the stale MLflow run is closed); and `plexrl run` stopped by SIGTERM (its MLflow run ends
KILLED, where it used to stay RUNNING). Every wait has a deadline; nothing sleeps a fixed time."""

from __future__ import annotations

import copy
import functools
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import conftest
import pytest
import yaml
from conftest import TINY

from plexrl.server.client import Client

pytestmark = pytest.mark.slow


wait_for = functools.partial(conftest.wait_for, timeout=180.0, interval=0.05)  # real processes: slower


class Proc:
    """A `python -m plexrl.cli ...` child whose stdout lines are read by a thread (no blocking reads)."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "plexrl.cli", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.errors: list[str] = []
        self.readers = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=self._errors, daemon=True),
        ]
        for t in self.readers:
            t.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line)

    def _errors(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.errors.append(line)

    @property
    def err(self) -> str:
        return "".join(self.errors)

    def line(self, timeout: float = 180.0) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            self.stop(signal.SIGKILL)
            raise AssertionError(f"no output within {timeout}s; stderr: {self.err}") from None

    def stop(self, sig: int, timeout: float = 120.0) -> int:
        """Send `sig`, wait for the exit (SIGKILL after `timeout`), keep stderr, close the pipes."""
        self.p.send_signal(sig)
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            raise
        finally:
            for t in self.readers:
                t.join(30)
            for pipe in (self.p.stdout, self.p.stderr):
                if pipe is not None:
                    pipe.close()
        return self.p.returncode


def mlflow_runs(db: Path) -> list[tuple[str, str]]:
    """(name, status) of every MLflow run in the sqlite store, oldest first ([] before it exists)."""
    if not db.exists():
        return []
    try:
        con = sqlite3.connect(db)
        try:
            return con.execute("SELECT name, status FROM runs ORDER BY start_time").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return []


def mlflow_metric_rows(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        con = sqlite3.connect(db)
        try:
            return int(con.execute("SELECT count(*) FROM metrics").fetchone()[0])
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def _job(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**copy.deepcopy(TINY), "iterations": 2000}))
    return path


def test_serve_sigterm_restart_and_sigkill_recovery(tmp_path: Path) -> None:
    args = ["serve", "--port", "0", "--set", "journal=runs/journal.db", "--set", "run_dir=runs"]
    args += ["--set", "cluster.driver=local"]  # (a SIGKILLed server would leave a local Dask cluster's workers behind)
    db = tmp_path / "runs" / "mlflow.db"

    def start() -> tuple[Proc, Client]:
        proc = Proc(args, tmp_path)
        first = proc.line()
        assert first.startswith("PlexRL server listening on http://127.0.0.1:"), first
        return proc, Client(first.split()[4])

    def progressed(c: Client, job_id: str, attempt: int) -> bool:
        j = c.status(job_id)
        return j["attempt"] == attempt and j["status"] == "running" and j["iterations_done"] >= 1

    proc, c = start()
    job_id = c.submit(_job(tmp_path))["job_id"]
    wait_for(lambda: progressed(c, job_id, 1), "the job's first iteration")
    assert proc.stop(signal.SIGTERM) == 0, proc.err
    assert mlflow_runs(db) == [(job_id, "KILLED")]

    proc, c = start()  # graceful stop -> restart: the job runs again, from scratch
    wait_for(lambda: progressed(c, job_id, 2), "the resubmitted job's first iteration")
    assert mlflow_runs(db) == [(job_id, "KILLED"), (job_id, "RUNNING")]
    assert proc.stop(signal.SIGKILL) == -signal.SIGKILL  # a crash: nothing is closed

    proc, c = start()  # the stale run of attempt 2 is closed, attempt 3 runs
    wait_for(lambda: progressed(c, job_id, 3), "the job after a crash")
    assert mlflow_runs(db) == [(job_id, "KILLED"), (job_id, "KILLED"), (job_id, "RUNNING")]
    assert c.cancel(job_id)["status"] == "cancelled"
    wait_for(lambda: mlflow_runs(db)[-1][1] == "KILLED", "the cancelled job's MLflow run to end")
    assert proc.stop(signal.SIGTERM) == 0
    con = sqlite3.connect(tmp_path / "runs" / "journal.db")
    kinds = [k for (k,) in con.execute("SELECT kind FROM events WHERE kind != 'iteration' ORDER BY seq")]
    con.close()
    assert kinds == [
        "submitted",
        "placed",
        "interrupted",
        "resubmitted",
        "placed",
        "interrupted",
        "placed",
        "cancelled",
    ]


def test_run_sigterm_closes_the_mlflow_run(tmp_path: Path) -> None:
    db = tmp_path / "runs" / "mlflow.db"
    proc = Proc(["run", str(_job(tmp_path)), "--set", "run_dir=runs", "--no-progress"], tmp_path)
    wait_for(lambda: mlflow_metric_rows(db) > 0, "the first logged iteration")
    assert mlflow_runs(db) == [("tiny", "RUNNING")]
    assert proc.stop(signal.SIGTERM) == 130
    assert "interrupted" in proc.err
    assert mlflow_runs(db) == [("tiny", "KILLED")]


def test_run_cluster_sigterm_closes_every_mlflow_run(tmp_path: Path) -> None:
    """A cluster run (two jobs, accounting, cluster MLflow run) stopped by SIGTERM: every job's run ends KILLED
    and the cluster run is logged and closed; the accounting table is still printed."""
    _job(tmp_path)
    (tmp_path / "cluster.yaml").write_text(
        "# plexrl run cluster.yaml\ndriver: local\nrun_dir: runs\nprogress: false\n"
        "jobs:\n  - config: job.yaml\n  - config: job.yaml\n    set: {name: tiny2, seed: 1}\n"
    )
    db = tmp_path / "runs" / "mlflow.db"
    proc = Proc(["run", "cluster.yaml"], tmp_path)
    wait_for(lambda: mlflow_metric_rows(db) > 0, "the first logged iteration")
    assert proc.stop(signal.SIGTERM) == 130, proc.err
    assert "interrupted by SIGTERM" in proc.err
    assert sorted(mlflow_runs(db)) == [("cluster", "FAILED"), ("tiny", "KILLED"), ("tiny2", "KILLED")]
    assert "acc-s/step" in "".join(proc.lines.queue)  # the accounting table
