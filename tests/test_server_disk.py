"""Checkpoints of cancelled jobs were never removed (one user filled the disk), and a full disk then
stopped the server (a 500, exit 1) where the docs promised /health 503. Now a cancelled or failed job's
checkpoints go after the owner's retention, and on a full disk (a real one: a small tmpfs) /health answers 503,
submissions are refused with 503, the runner waits for room instead of dying, and everything goes on once there
is room again."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import TINY, wait_for
from test_server import serving, sim_prepare, sim_runner

from plexrl.server.api import start_server
from plexrl.server.client import Client, ServerError
from plexrl.server.config import ServerConfig


def long_job(tmp_path: Path, iterations: int = 100_000) -> Path:
    path = tmp_path / f"job-{iterations}.yaml"
    path.write_text(yaml.safe_dump({**copy.deepcopy(TINY), "iterations": iterations}))
    return path


def put_checkpoint_files(srv: object, job_id: str) -> Path:
    """The files the journal names for the job's checkpoint (the simulated executor writes none)."""
    entry = srv.controller.journal.get(job_id)  # type: ignore[attr-defined]
    assert entry is not None and entry.checkpoint is not None
    path = Path(entry.checkpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * 1024)
    return path.parent


def test_a_cancelled_jobs_checkpoints_are_removed_after_the_retention(tmp_path: Path) -> None:
    with serving(tmp_path, checkpoint_every=2, checkpoint_retention_s=0) as srv:
        c = Client(srv.url)
        job_id = c.submit(long_job(tmp_path))["job_id"]
        wait_for(lambda: c.status(job_id)["checkpoint"] is not None, "a checkpoint journalled")
        folder = put_checkpoint_files(srv, job_id)
        c.cancel(job_id)
        wait_for(lambda: not folder.exists(), "the cancelled job's checkpoints removed")


def test_the_retention_keeps_them_for_the_time_the_owner_set(tmp_path: Path) -> None:
    from plexrl.server.housekeeping import Housekeeping

    with serving(tmp_path, checkpoint_every=2, checkpoint_retention_s=3600) as srv:
        c = Client(srv.url)
        job_id = c.submit(long_job(tmp_path))["job_id"]
        wait_for(lambda: c.status(job_id)["checkpoint"] is not None, "a checkpoint journalled")
        folder = put_checkpoint_files(srv, job_id)
        c.cancel(job_id)
        where = folder.parent
        now = time.time()
        Housekeeping(srv.journal, srv.controller, where, max_run_s=None, retention_s=3600, clock=lambda: now).sweep()
        assert folder.exists()  # within the retention: kept (for a look)
        later = now + 3601
        Housekeeping(srv.journal, srv.controller, where, max_run_s=None, retention_s=3600, clock=lambda: later).sweep()
        assert not folder.exists()


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    where = Path(f"/tmp/plexrl-tmpfs-{uuid.uuid4().hex[:8]}")
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}): a full disk needs one")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        with contextlib.suppress(OSError):
            where.rmdir()


def fill(disk: Path) -> Path:
    """Fill `disk` to the last byte; the filler file."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 1 << 10, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_answers_503_and_the_server_stays_up_and_goes_on(tmp_path: Path) -> None:
    with tmpfs("16m") as disk:
        cfg = ServerConfig(port=0, journal=str(disk / "journal.db"), checkpoint_dir=str(disk / "ckpt"),
                           run_dir=str(tmp_path / "runs"), mlflow=False, min_free_disk="2MiB")  # fmt: skip
        srv = start_server(cfg, prepare=sim_prepare, runner=sim_runner())
        try:
            c = Client(srv.url)
            job_id = c.submit(long_job(tmp_path))["job_id"]
            wait_for(lambda: c.status(job_id)["iterations_done"] > 2, "the job running")
            filler = fill(disk)
            health = None
            with pytest.raises(ServerError) as err:
                health = c.request("GET", "/health")
            assert err.value.status == 503 and "min_free_disk" in str(err.value), (health, str(err.value))
            with pytest.raises(ServerError) as err:
                c.submit(long_job(tmp_path, 10))
            assert err.value.status == 503, str(err.value)
            with pytest.raises(ServerError) as err:  # a journal write itself (the cancel): 503, not 500
                c.cancel(job_id)
            assert err.value.status == 503, str(err.value)
            assert srv.thread.is_alive() and all(t.is_alive() for t in srv.controller._threads)
            os.unlink(filler)  # room again: everything goes on
            wait_for(lambda: c.request("GET", "/health")["ok"] is True, "healthy again", timeout=60)
            before = c.status(job_id)["iterations_done"]
            wait_for(lambda: c.status(job_id)["iterations_done"] > before, "the job goes on", timeout=60)
            assert c.submit(long_job(tmp_path, 10))["status"] == "queued"
            assert c.cancel(job_id)["status"] == "cancelled"
        finally:
            assert srv.stop(60)
