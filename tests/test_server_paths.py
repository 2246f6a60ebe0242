"""Every path a job names, from the submission to the moment it is opened. `~` was checked as
`<cwd>/~/...` and opened as `$HOME/...`; a data file swapped for a link after the 201, or a journalled job after
the owner narrowed `allowed_roots` and restarted, was read outside the roots; a FIFO held a preparation thread
for good; a 1.5 GiB file with no newline was read as one line; a refusal listed another file's columns; with
private jobs bob used ann's finished model directory as his model, his LoRA base and his cache; an undeclared
reward ref was accepted and failed only at preparation. Real servers, real preparation (driver local)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import TINY, wait_for
from test_server import serving

from plexrl.server.api import RunningServer, start_server
from plexrl.server.client import Client, ServerError
from plexrl.server.config import ServerConfig
from plexrl.server.journal import JobEntry

ROW = {"prompt": "What is 1+1?", "answer": "2"}


def data_job(model: Path, train: str, **data: Any) -> dict[str, Any]:
    job = copy.deepcopy(TINY)
    job.update(iterations=1, model={"path": str(model)}, warm_start={"enabled": False}, engine="torch")
    job["tracking"]["mlflow"] = False
    job["data"] = {"train": train, "held_out_fraction": 0.25, "rewards": [{"name": "exact"}], **data}
    return job


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@contextmanager
def real_server(tmp_path: Path, roots: list[Path], **fields: Any) -> Iterator[RunningServer]:
    """A server that prepares jobs for real (driver local) on the journal under tmp_path."""
    cfg = ServerConfig(
        port=0, journal=str(tmp_path / "journal.db"), run_dir=str(tmp_path / "runs"), mlflow=False,
        cluster={"driver": "local"}, allowed_roots=[str(r) for r in roots], **fields,
    )  # fmt: skip
    srv = start_server(cfg)
    try:
        yield srv
    finally:
        assert srv.stop(60), "the server did not stop in time"


def journal_only(tmp_path: Path, roots: list[Path], job: dict[str, Any]) -> str:
    """Submit `job` to a server that accepts it but prepares nothing, then stop it: the job waits in the
    journal (queued) for the next server on it."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))

    def waits(entry: JobEntry, cancel: threading.Event) -> Any:
        cancel.wait()
        raise RuntimeError("stopped before preparing")

    with serving(tmp_path, prepare=waits, allowed_roots=[str(r) for r in roots]) as srv:
        job_id: str = Client(srv.url).submit(path)["job_id"]
    return job_id


def failed_reason(srv: RunningServer, job_id: str) -> str:
    c = Client(srv.url)
    wait_for(lambda: c.status(job_id)["status"] in ("failed", "done"), f"{job_id} ended", timeout=120)
    row = c.status(job_id)
    assert row["status"] == "failed", row
    reason: str = row["reason"]
    return reason


def test_a_tilde_path_is_refused_not_read_from_the_servers_home(
    tmp_path: Path, smol_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`~/secret.jsonl` passed the roots check as <cwd>/~/secret.jsonl (cwd under a root) and was then opened as
    $HOME/secret.jsonl. Refused now, data file and cache dir alike; nothing is journalled."""
    home = tmp_path / "home"
    write_rows(home / "secret.jsonl", [{"prompt": "the server's own secret", "answer": "x"}] * 8)
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    write_rows(work / "ok.jsonl", [ROW] * 8)
    with serving(work, allowed_roots=[str(work), str(smol_tiny)]) as srv:
        c = Client(srv.url)
        for job in (data_job(smol_tiny, "~/secret.jsonl"), data_job(smol_tiny, "ok.jsonl", cache_dir="~/x")):
            path = work / "job.yaml"
            path.write_text(yaml.safe_dump(job))
            with pytest.raises(ServerError) as err:
                c.submit(path)
            assert err.value.status == 400 and "`~`" in str(err.value), str(err.value)
        assert c.jobs() == []
    assert not (home / "x").exists()


def test_a_data_file_swapped_for_a_link_after_the_201_is_not_read(tmp_path: Path, smol_tiny: Path) -> None:
    root, outside = tmp_path / "data", tmp_path / "private"
    train = write_rows(root / "train.jsonl", [ROW] * 8)
    write_rows(outside / "secret.jsonl", [{"q": "secret", "secret_column_xyz": "1"}] * 8)
    job_id = journal_only(tmp_path, [root, smol_tiny, tmp_path / "runs"], data_job(smol_tiny, str(train)))
    train.unlink()
    train.symlink_to(outside / "secret.jsonl")  # after the submission was checked
    with real_server(tmp_path, [root, smol_tiny, tmp_path / "runs"]) as srv:
        reason = failed_reason(srv, job_id)
    assert "data.train" in reason and "outside the server's allowed roots" in reason, reason
    assert "secret_column_xyz" not in reason


def test_a_journalled_job_outside_the_narrowed_roots_does_not_run_after_a_restart(
    tmp_path: Path, smol_tiny: Path
) -> None:
    old, kept = tmp_path / "old", tmp_path / "kept"
    train = write_rows(old / "train.jsonl", [ROW] * 8)
    job_id = journal_only(tmp_path, [old, kept, smol_tiny, tmp_path / "runs"], data_job(smol_tiny, str(train)))
    with real_server(tmp_path, [kept, smol_tiny, tmp_path / "runs"]) as srv:  # the owner narrowed the roots
        reason = failed_reason(srv, job_id)
    assert "data.train" in reason and "outside the server's allowed roots" in reason, reason


def test_a_fifo_fails_its_job_at_once_and_the_server_stops_promptly(tmp_path: Path, smol_tiny: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    fifo = root / "train.jsonl"
    os.mkfifo(fifo)
    try:
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(data_job(smol_tiny, str(fifo))))
        with real_server(tmp_path, [root, smol_tiny, tmp_path / "runs"]) as srv:
            job_id = Client(srv.url).submit(path)["job_id"]
            reason = failed_reason(srv, job_id)
        assert "not a regular file" in reason, reason
    finally:  # (a reader blocked on the FIFO, on a build without the fix, is let go)
        with suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_huge_file_without_a_newline_is_refused_not_read_as_one_line(tmp_path: Path, smol_tiny: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    big = root / "train.jsonl"
    with big.open("wb") as fh:  # sparse: 1.5 GiB of zeros, no newline, no disk space
        fh.truncate(3 << 29)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data_job(smol_tiny, str(big))))
    with real_server(tmp_path, [root, smol_tiny, tmp_path / "runs"], limits={"max_line_bytes": "1MiB"}) as srv:
        job_id = Client(srv.url).submit(path)["job_id"]
        reason = failed_reason(srv, job_id)
    assert "line 1 is longer than 1048576 bytes" in reason and "limits.max_line_bytes" in reason, reason


def test_a_refusal_does_not_list_the_files_columns(tmp_path: Path, smol_tiny: Path) -> None:
    root = tmp_path / "data"
    other = write_rows(root / "someone_elses.jsonl", [{"salary_of_ann": 1, "diagnosis_of_bob": "x"}] * 8)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data_job(smol_tiny, str(other))))
    with real_server(tmp_path, [root, smol_tiny, tmp_path / "runs"]) as srv:
        reason = failed_reason(srv, Client(srv.url).submit(path)["job_id"])
    assert "no prompt column" in reason, reason
    assert "salary_of_ann" not in reason and "diagnosis_of_bob" not in reason, reason


USERS = {"ann": "ann-token-0123456789", "bob": "bob-token-0123456789"}


def test_with_private_jobs_bob_cannot_use_anns_files(tmp_path: Path, smol_tiny: Path) -> None:
    """ann's job's directories follow from its public id; bob names them as his model, his LoRA base and his
    data cache. Refused: with private jobs each user reads and writes only their own directory under the
    server's run_dir (shared data elsewhere among the roots stays readable)."""
    runs = (tmp_path / "runs").resolve()
    shared = write_rows(tmp_path / "shared" / "train.jsonl", [ROW] * 8)
    with serving(tmp_path, users=USERS, allowed_roots=[str(runs), str(tmp_path / "shared"), str(smol_tiny)]) as srv:
        ann, bob = (Client(srv.url, token=USERS[u]) for u in ("ann", "bob"))
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump({**copy.deepcopy(TINY), "iterations": 2}))
        ann_id = ann.submit(path)["job_id"]
        ann_dirs = [runs / "jobs" / ann_id / "model", runs / "users" / "ann" / "jobs" / ann_id / "model",
                    runs / "users" / "ann" / "cache", runs / "server" / "checkpoints" / ann_id]  # fmt: skip
        for where in ann_dirs:
            shutil.copytree(smol_tiny, where, dirs_exist_ok=True)  # a real model there (ann's finished one)
            for job in (
                data_job(where, str(shared)),  # his model
                {**data_job(where, str(shared)), "model": {"path": str(where), "lora": {"r": 4}}},  # his LoRA base
                data_job(smol_tiny, str(shared), cache_dir=str(where)),  # his cache, written by his job
            ):
                path.write_text(yaml.safe_dump(job))
                with pytest.raises(ServerError) as err:
                    bob.submit(path)
                assert err.value.status == 400, str(err.value)
                assert "another user's directory" in str(err.value) or "its user's directory" in str(err.value)
        path.write_text(yaml.safe_dump(data_job(smol_tiny, str(shared))))
        mine = bob.submit(path)  # shared data and his own directory: accepted
        config = bob.request("GET", f"/jobs/{mine['job_id']}?config=true")["config"]
        assert config["run_dir"] == str(runs / "users" / "bob")
        assert [j["user"] for j in ann.jobs()] == ["ann", "bob"]


def test_an_undeclared_or_missing_reward_ref_is_refused_at_submission(tmp_path: Path, smol_tiny: Path) -> None:
    train = write_rows(tmp_path / "runs" / "train.jsonl", [ROW] * 8)
    modules = ["plexrl", "no_such_module_zz"]
    with serving(tmp_path, allowed_roots=[str(tmp_path / "runs"), str(smol_tiny)], allowed_modules=modules) as srv:
        c = Client(srv.url)
        for ref, words in (("plexrl.cli:main", "declared reward"), ("plexrl.roles:declare", "declared reward"),
                           ("no_such_module_zz:score", "cannot import")):  # fmt: skip
            job = data_job(smol_tiny, str(train))
            job["data"]["rewards"] = [{"ref": ref}]
            path = tmp_path / "job.yaml"
            path.write_text(yaml.safe_dump(job))
            with pytest.raises(ServerError) as err:
                c.submit(path)
            assert err.value.status == 400 and "data.rewards[0].ref" in str(err.value), str(err.value)
            assert words in str(err.value), str(err.value)
        assert c.jobs() == []
