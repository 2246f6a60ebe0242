"""The journal has one owner and means what it says: a second `Journal` (or `plexrl serve`) on a journal in use
is refused, naming the owner; a file that is not a readable journal is a clear `JournalError` (and `plexrl
serve` prints it without a traceback); a job is recorded `done` only with every iteration of its attempt in
the journal (from its resume checkpoint on). The last test runs two real `plexrl serve` processes."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plexrl.cli import app
from plexrl.server.journal import Journal, JournalError


def test_a_second_owner_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    first = Journal(path)
    job = first.submit("a", {}, 1)
    with pytest.raises(
        JournalError, match=rf"journal .*journal\.db is in use by another PlexRL server \(pid {os.getpid()} "
    ) as err:
        Journal(path)
    assert "Stop that server first" in str(err.value) and "--set journal=PATH" in str(err.value)
    # the refused owner touched nothing: the first one goes on writing
    first.placed(job.job_id, "service-0")
    first.close()
    second = Journal(path)  # the lock went with the close
    entry = second.get(job.job_id)
    assert entry is not None and entry.status == "running"
    second.close()


def test_another_process_is_refused_and_the_lock_dies_with_its_owner(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    code = "import sys; from plexrl.server.journal import Journal; j = Journal(sys.argv[1]); print('open', flush=True)"
    code += "; input()"
    owner = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline() == "open\n"  # blocks until it holds the journal
        with pytest.raises(JournalError, match=rf"in use by another PlexRL server \(pid {owner.pid} on "):
            Journal(path)
    finally:
        owner.kill()  # as kill -9: no close, the kernel drops the lock
        owner.wait(60)
        assert owner.stdout is not None
        owner.stdout.close()
        assert owner.stdin is not None
        owner.stdin.close()
    Journal(path).close()


def _write_journal(path: Path, jobs: int = 200) -> None:
    j = Journal(path)
    for i in range(jobs):
        e = j.submit(f"job{i}", {"padding": "x" * 500}, 1)
        j.placed(e.job_id, "service-0")
    j.close()


@pytest.mark.parametrize("damage", ["not sqlite", "truncated", "foreign tables", "missing column", "newer version"])
def test_a_file_that_is_not_a_readable_journal_is_a_clear_error(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "journal.db"
    expect = {
        "not sqlite": r"is not a readable PlexRL journal \(file is not a database\).*Restore it from a backup",
        "truncated": r"is not a readable PlexRL journal \(.*malformed.*\).*Restore it from a backup",
        "foreign tables": r"is not a PlexRL journal \(it holds the tables metrics, runs\)",
        "missing column": r"the table 'events' lacks attempt, data: not a journal of this version",
        "newer version": r"journal version 7, this server reads version 1",
    }[damage]
    if damage == "not sqlite":
        path.write_bytes(b"this is a YAML file, not a journal\n" * 100)
    elif damage == "truncated":
        _write_journal(path)
        data = path.read_bytes()
        assert len(data) > 16 * 4096  # (the WAL was checkpointed into the file at close)
        path.write_bytes(data[: len(data) // 2])
    else:
        con = sqlite3.connect(path)
        if damage == "foreign tables":  # e.g. `journal:` pointed at MLflow's store
            con.executescript("CREATE TABLE runs (id TEXT); CREATE TABLE metrics (v REAL);")
        elif damage == "missing column":
            con.executescript(
                "CREATE TABLE jobs (seq INTEGER, job_id TEXT, name TEXT, user TEXT, config TEXT, status TEXT, "
                "reason TEXT, service TEXT, iterations INT, iterations_done INT, attempt INT, submitted_at REAL, "
                "started_at REAL, finished_at REAL, tracking TEXT, checkpoint TEXT, checkpoint_iteration INT);"
                "CREATE TABLE events (seq INTEGER, job_id TEXT, time REAL, kind TEXT); PRAGMA user_version=1;"
            )
        else:
            con.execute("PRAGMA user_version=7")
        con.close()
    before = path.read_bytes()
    with pytest.raises(JournalError, match=expect):
        Journal(path)
    assert path.read_bytes() == before  # nothing was written to it
    if damage == "foreign tables":
        assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not switched to WAL
    path.rename(tmp_path / "moved-away.db")  # the fix the message names; the failed open released the lock
    Journal(path).close()


def test_serve_prints_a_damaged_or_held_journal_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    path.write_bytes(b"\x00garbage" * 512)
    args = ["serve", "--port", "0", "--set", "cluster.driver=local", "--set", "mlflow=false"]
    args += ["--set", f"journal={path}", "--set", f"run_dir={tmp_path / 'runs'}"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "is not a readable PlexRL journal" in res.output and "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    path.unlink()
    held = Journal(path)
    try:
        res = CliRunner().invoke(app, args)
    finally:
        held.close()
    assert res.exit_code == 2, res.output
    assert re.search(rf"in use by another PlexRL server \(pid {os.getpid()} ", res.output), res.output
    assert "Traceback" not in res.output


def _attempt(j: Journal, job_id: str, iterations: list[int]) -> None:
    j.placed(job_id, "service-0")
    j.iteration(job_id, -1, {"evaluate/accuracy": 0.5})  # the baseline is not an iteration
    for i in iterations:
        j.iteration(job_id, i, {"train/loss": 1.0})


def test_done_is_recorded_only_with_every_iteration_of_the_attempt(tmp_path: Path) -> None:
    j = Journal(tmp_path / "journal.db")
    whole = j.submit("whole", {}, 4)
    _attempt(j, whole.job_id, [0, 1, 2, 3])
    assert j.finish(whole.job_id, "done")
    assert j.get(whole.job_id).status == "done"  # type: ignore[union-attr]

    gap = j.submit("gap", {}, 8)
    _attempt(j, gap.job_id, [0, 1, 2, 4, 5])
    assert j.finish(gap.job_id, "done")  # recorded, but not as done
    e = j.get(gap.job_id)
    assert e is not None and e.status == "failed"
    assert e.reason.startswith("reported done, but iteration(s) 3, 6-7 of attempt 1 are not in the journal"), e.reason
    assert j.events(gap.job_id)[-1].kind == "failed"

    # attempt 1 ran 0-2 and checkpointed after 1; attempt 2 resumed after it: 2-5 must be its own
    resumed = j.submit("resumed", {}, 6)
    _attempt(j, resumed.job_id, [0, 1, 2])
    j.checkpoint(resumed.job_id, 1, str(tmp_path / "after-1.pt"))
    assert j.requeue(resumed.job_id, "worker lost") is not None
    _attempt(j, resumed.job_id, [2, 3, 4])  # its checkpoint after 3 (this attempt's) moves no goalpost
    j.checkpoint(resumed.job_id, 3, str(tmp_path / "after-3.pt"))
    twin = j.submit("twin", {}, 6)  # the same history, then the last iteration too
    _attempt(j, twin.job_id, [0, 1, 2])
    j.checkpoint(twin.job_id, 1, str(tmp_path / "t-after-1.pt"))
    j.requeue(twin.job_id, "worker lost")
    _attempt(j, twin.job_id, [2, 3, 4, 5])
    j.finish(resumed.job_id, "done")
    j.finish(twin.job_id, "done")
    r, t = j.get(resumed.job_id), j.get(twin.job_id)
    assert r is not None and r.status == "failed" and "iteration(s) 5 of attempt 2" in r.reason, r.reason
    assert t is not None and t.status == "done" and t.attempt == 2

    # iterations of an earlier attempt after its checkpoint do not count for the next one
    again = j.submit("again", {}, 3)
    _attempt(j, again.job_id, [0, 1, 2])
    j.requeue(again.job_id, "worker lost")  # no checkpoint: attempt 2 runs from scratch
    _attempt(j, again.job_id, [0, 1])
    j.finish(again.job_id, "done")
    a = j.get(again.job_id)
    assert a is not None and a.status == "failed" and "iteration(s) 2 of attempt 2" in a.reason
    j.close()


def test_a_second_plexrl_serve_on_the_same_journal_exits_and_leaves_the_first_running(tmp_path: Path) -> None:
    import signal

    from plexrl.server.client import Client

    args = [sys.executable, "-m", "plexrl.cli", "serve", "--port", "0", "--set", "cluster.driver=local"]
    args += ["--set", "mlflow=false", "--set", "journal=runs/journal.db", "--set", "run_dir=runs"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert first.stdout is not None
        line = first.stdout.readline()  # the server prints this line once it listens (or exits: "")
        assert line.startswith("PlexRL server listening on http://127.0.0.1:"), line
        second = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
        assert second.returncode == 2, (second.stdout, second.stderr)
        assert f"is in use by another PlexRL server (pid {first.pid} on " in second.stderr, second.stderr
        assert "Traceback" not in second.stderr and "listening" not in second.stdout
        assert Client(line.split()[4]).jobs() == []  # the first one still answers
        first.send_signal(signal.SIGTERM)
        assert first.wait(120) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(60)
        if first.stdout is not None:
            first.stdout.close()
    Journal(tmp_path / "runs" / "journal.db").close()  # released when the first one stopped
