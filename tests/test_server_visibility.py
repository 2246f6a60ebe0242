"""What one user of a shared server sees of another's jobs (`private_jobs`), and that nothing the server
sends can drive the terminal of `plexrl list | status | logs` (control characters are printed escaped)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import TINY, wait_for
from test_server import TOKEN, serving, sim_prepare
from typer.testing import CliRunner

from plexrl.cli import app
from plexrl.server.client import Client, ServerError
from plexrl.server.config import ServerConfig
from plexrl.server.journal import JobEntry

USERS = {"ann": "ann-secret-0123456789", "bob": "bob-secret-0123456789"}


@pytest.fixture
def job_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**copy.deepcopy(TINY), "iterations": 2}))
    return path


def refused(call: Any) -> ServerError:
    with pytest.raises(ServerError) as err:
        call()
    return err.value


def test_private_jobs_is_on_with_per_user_tokens_and_needs_them() -> None:
    assert ServerConfig(users=USERS).jobs_private() is True
    assert ServerConfig(users=USERS, private_jobs=False).jobs_private() is False
    assert ServerConfig().jobs_private() is False and ServerConfig(token=TOKEN).jobs_private() is False
    with pytest.raises(ValueError, match="private_jobs: true needs per-user tokens"):
        ServerConfig(private_jobs=True, token=TOKEN)


def test_a_user_reads_only_their_own_jobs_configs_and_events(tmp_path: Path, job_yaml: Path) -> None:
    with serving(tmp_path, users=USERS, token=TOKEN) as srv:
        ann, bob, admin = (Client(srv.url, token=t) for t in (USERS["ann"], USERS["bob"], TOKEN))
        mine = ann.submit(job_yaml, ["seed=1"])["job_id"]
        theirs = bob.submit(job_yaml, ["seed=2"])["job_id"]
        for job in (mine, theirs):
            wait_for(lambda j=job: admin.status(j)["status"] == "done", f"{job} done")  # type: ignore[misc]
        # another user's config and events: 404, word for word what a job that does not exist gets
        nothing = refused(lambda: ann.request("GET", "/jobs/nope-99?config=true"))
        for path in (f"/jobs/{theirs}?config=true", f"/jobs/{theirs}/events"):
            err = refused(lambda p=path: ann.request("GET", p))  # type: ignore[misc]
            assert err.status == 404 and str(err) == str(nothing).replace("nope-99", theirs), path
        # their own, in full
        assert ann.request("GET", f"/jobs/{mine}?config=true")["config"]["seed"] == 1
        assert [e["kind"] for e in ann.events(mine)["events"]][-1] == "done"
        # the list and plain status show every job, another user's without its run, checkpoint or reason
        rows = {j["job_id"]: j for j in ann.jobs()}
        assert set(rows) == {mine, theirs}
        assert rows[theirs]["hidden"] is True and rows[theirs]["tracking"] == {} and rows[theirs]["user"] == "bob"
        assert rows[theirs]["iterations_done"] == 2 and "hidden" not in rows[mine]
        assert ann.status(theirs) == rows[theirs] and "config" not in ann.status(theirs)
        # the administrator reads everything
        assert admin.request("GET", f"/jobs/{theirs}?config=true")["config"]["seed"] == 2
        assert len(admin.events(theirs)["events"]) > 2 and "hidden" not in admin.status(theirs)
        # cancelling another user's job stays a 403 (its id is listed: there is nothing to hide)
        assert refused(lambda: ann.cancel(theirs)).status == 403
        # the cluster page's data: another user's job without its node names or metrics
        data = ann.request("GET", "/cluster")
        assert {j["job_id"]: j["hidden"] for j in data["jobs"]} == {mine: False, theirs: True}
        assert {s["node"] for s in data["spans"] if s["job"] == theirs and s["kind"] == "node"} == {""}
        assert "" not in {s["node"] for s in data["spans"] if s["job"] == mine and s["kind"] == "node"}


def test_private_jobs_off_shares_every_jobs_details(tmp_path: Path, job_yaml: Path) -> None:
    with serving(tmp_path, users=USERS, private_jobs=False) as srv:
        ann, bob = (Client(srv.url, token=t) for t in (USERS["ann"], USERS["bob"]))
        theirs = bob.submit(job_yaml, ["seed=2"])["job_id"]
        assert ann.request("GET", f"/jobs/{theirs}?config=true")["config"]["seed"] == 2
        assert ann.events(theirs)["events"][0]["kind"] == "submitted"


HOSTILE_USER = "\x1b]0;pwned\x07eve\x1b[2J"  # retitles the terminal, then clears it
HOSTILE_REASON = "no such model\x1b[2J\r\x9b31m\u202egnp.exe"  # clears, returns, C1 CSI, right-to-left override


def test_the_cli_prints_the_servers_strings_with_control_characters_escaped(tmp_path: Path, job_yaml: Path) -> None:
    def prepare(entry: JobEntry) -> Any:
        if entry.name == "boom":
            raise RuntimeError(HOSTILE_REASON)
        return sim_prepare(entry)

    cli = CliRunner()
    with serving(tmp_path, prepare=prepare) as srv:
        opts = ["--server", srv.url]
        c = Client(srv.url)
        boom = c.submit(job_yaml, ["name=boom"])["job_id"]
        wait_for(lambda: c.status(boom)["status"] == "failed", "the failed preparation")
        # a user name as an older server, or a journal written before names were checked, may hold it
        eve = srv.journal.submit("queued", {}, 2, HOSTILE_USER).job_id
        outputs = {
            "list": cli.invoke(app, ["list", *opts]),
            "status": cli.invoke(app, ["status", *opts]),
            "status boom": cli.invoke(app, ["status", boom, *opts]),
            "logs boom": cli.invoke(app, ["logs", boom, *opts]),
            "status eve": cli.invoke(app, ["status", eve, *opts]),
        }
    for what, res in outputs.items():
        assert res.exit_code == 0, (what, res.output)
        bad = sorted({hex(ord(ch)) for ch in res.output if (ord(ch) < 32 and ch != "\n") or 0x7F <= ord(ch) < 0xA0})
        assert not bad and "\u202e" not in res.output, (what, bad, res.output)
    assert "\\x1b]0;pwned\\x07eve\\x1b[2J" in outputs["list"].output  # shown as what it is
    assert "RuntimeError: no such model\\x1b[2J" in outputs["status boom"].output  # (the line shows 60 characters)
    assert "\\x1b]0;pwned" in outputs["status"].output and "\\x1b]0;pwned" in outputs["status eve"].output
    assert "no such model\\u001b[2J\\r\\u009b31m\\u202egnp.exe" in outputs["logs boom"].output  # (JSON's escapes)
    assert outputs["list"].output.count("\n") == 2  # one line per job: no CR or line break got through
