"""The journal on a real sqlite file: WAL mode, durable writes seen by a second connection and after reopening,
the status table (illegal moves raise with history), first terminal status wins, recovery from scratch."""

from __future__ import annotations

import itertools
import sqlite3
from pathlib import Path

import pytest

from plexrl.server.journal import TRANSITIONS, Journal, JournalError


def _clock() -> object:
    ticks = itertools.count()
    return lambda: float(next(ticks))


def test_wal_mode_and_writes_visible_to_another_connection_and_after_reopen(tmp_path: Path) -> None:
    path = tmp_path / "j" / "journal.db"
    j = Journal(path, clock=_clock())  # type: ignore[arg-type]
    a = j.submit("tiny", {"name": "tiny", "iterations": 3}, 3, user="ann")
    assert a.job_id == "tiny-1" and a.status == "queued" and a.user == "ann"
    j.placed(a.job_id, "service-0", {"run_id": "r1"})
    j.iteration(a.job_id, -1, {"evaluate/accuracy": 0.25})  # the baseline does not count as an iteration
    j.iteration(a.job_id, 0, {"train/loss": 1.5})
    # another connection (as after a crash: nothing is buffered in this process) sees every committed write
    other = sqlite3.connect(path)
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    row = other.execute("SELECT status, iterations_done, service FROM jobs WHERE job_id='tiny-1'").fetchone()
    assert row == ("running", 1, "service-0")
    other.close()
    j.close()
    j2 = Journal(path)
    e = j2.get("tiny-1")
    assert e is not None and e.status == "running" and e.iterations_done == 1 and e.tracking == {"run_id": "r1"}
    kinds = [ev.kind for ev in j2.events("tiny-1")]
    assert kinds == ["submitted", "placed", "iteration", "iteration"]
    assert j2.events("tiny-1")[3].data == {"iteration": 0, "metrics": {"train/loss": 1.5}}
    assert j2.submit("tiny", {}, 1).job_id == "tiny-2"  # ids stay unique across reopenings
    j2.close()


def test_illegal_moves_raise_with_history_and_first_terminal_wins(tmp_path: Path) -> None:
    j = Journal(tmp_path / "journal.db")
    a = j.submit("a", {}, 1)
    assert j.finish(a.job_id, "cancelled", "by user")
    assert not j.finish(a.job_id, "failed", "late report")  # ignored: the cancel came first
    e = j.get(a.job_id)
    assert e is not None and e.status == "cancelled" and e.reason == "by user"
    with pytest.raises(JournalError, match=r"illegal move cancelled -> running; recent events: .*submitted"):
        j.placed(a.job_id, "service-0")
    with pytest.raises(JournalError, match="not a terminal status"):
        j.finish(a.job_id, "running")
    with pytest.raises(JournalError, match="no job 'nope'"):
        j.placed("nope", "service-0")
    assert j.get("nope") is None
    # every terminal status is reachable from both unfinished ones, and nothing leaves a terminal status
    for src in ("queued", "running"):
        assert all((src, t) in TRANSITIONS for t in ("done", "failed", "cancelled"))
    assert not [k for k in TRANSITIONS if k[0] in ("done", "failed", "cancelled")]


def test_recover_requeues_unfinished_jobs_from_scratch(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    j = Journal(path)
    running = j.submit("r", {"iterations": 5}, 5)
    queued = j.submit("q", {}, 5)
    done = j.submit("d", {}, 1)
    interrupted = j.submit("i", {}, 5)
    j.placed(running.job_id, "service-0")
    j.iteration(running.job_id, 0, {"x": 1.0})
    j.placed(done.job_id, "service-0")
    j.iteration(done.job_id, 0, {"x": 1.0})  # `done` needs every iteration in the journal
    j.finish(done.job_id, "done")
    j.placed(interrupted.job_id, "service-1")
    assert j.interrupt(interrupted.job_id, "server stopping")
    assert not j.interrupt(done.job_id, "server stopping")
    j.close()  # as if the process died here
    j = Journal(path)
    back = j.recover()
    assert [e.job_id for e in back] == [running.job_id, queued.job_id, interrupted.job_id]
    assert all(e.status == "queued" and e.attempt == 2 and e.iterations_done == 0 for e in back)
    assert back[0].config == {"iterations": 5}
    d = j.get(done.job_id)
    assert d is not None and d.status == "done" and d.attempt == 1
    last = j.events(running.job_id)[-1]
    assert last.kind == "interrupted" and last.data["resume"] == "from scratch (no checkpoint)"
    assert [e.status for e in j.jobs()] == ["queued", "queued", "done", "queued"]
    assert [e.job_id for e in j.jobs(status="done")] == [done.job_id]


def test_failed_write_rolls_back(tmp_path: Path) -> None:
    j = Journal(tmp_path / "journal.db")
    a = j.submit("a", {}, 1)
    with pytest.raises(TypeError):  # not JSON: the whole transaction is undone
        j.placed(a.job_id, "service-0", {"bad": object()})
    e = j.get(a.job_id)
    assert e is not None and e.status == "queued" and [ev.kind for ev in j.events(a.job_id)] == ["submitted"]


def test_recover_resumes_from_the_latest_checkpoint(tmp_path: Path) -> None:
    j = Journal(tmp_path / "journal.db")
    a = j.submit("a", {}, 10)
    j.placed(a.job_id, "service-0")
    for it in range(5):
        j.iteration(a.job_id, it, {"x": float(it)})
    j.checkpoint(a.job_id, 1, "/ck/after-1.pt")
    j.checkpoint(a.job_id, 3, "/ck/after-3.pt")
    j.note(a.job_id, "checkpoint_failed", {"iteration": 5, "error": "OSError: disk full"})
    (back,) = j.recover()
    assert back.checkpoint == "/ck/after-3.pt" and back.checkpoint_iteration == 3
    assert back.iterations_done == 4 and back.attempt == 2 and back.status == "queued"
    kinds = [e.kind for e in j.events(a.job_id)]
    assert kinds[-3:] == ["checkpoint", "checkpoint_failed", "interrupted"]
    assert j.events(a.job_id)[-1].data["resume"] == "from the checkpoint after iteration 3"


def test_usage_decays_with_its_half_life() -> None:
    from plexrl.planner.shares import Usage

    u = Usage(half_life=10.0)
    u.add("ann", 8.0, now=0.0)
    u.add("ann", 4.0, now=10.0)  # 8 s decayed to 4, plus 4
    assert u.value("ann", 10.0) == 8.0 and u.value("ann", 30.0) == 2.0 and u.value("bob", 30.0) == 0.0
    with pytest.raises(ValueError, match="half_life"):
        Usage(half_life=0)
