"""`plexrl serve` in-process: a real HTTP server on an ephemeral port, a real sqlite journal, the real client;
the runner runs simulated jobs (virtual clock) so that each test takes well under a second of runner time.
The real-job, real-process paths (SIGTERM, restart) are in test_server_process.py."""

from __future__ import annotations

import copy
import http.client
import json
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import TINY, wait_for

from plexrl.errors import ConfigError
from plexrl.hooks.base import Hook
from plexrl.job.spec import JobRun
from plexrl.planner.admission import UserLimits
from plexrl.planner.policies import FairShare, Fifo
from plexrl.runtime.sim import GB, GRPO_ORDER, SeededCosts, SimExecutor, SimJob, grpo_nodes
from plexrl.server.api import RunningServer, start_server
from plexrl.server.client import Client, ServerError
from plexrl.server.config import ServerConfig, load_server_config
from plexrl.server.controller import RunnerFactory, runner_of
from plexrl.server.journal import JobEntry, Journal

TOKEN = "0123456789abcdef-token"


def sim_prepare(entry: JobEntry) -> SimJob:
    """A simulated job shaped like GRPO with the submitted job's id and iteration count."""
    nodes = grpo_nodes(every=2)
    return SimJob(entry.job_id, nodes, entry.iterations, {n: 0.1 for n in nodes}, GRPO_ORDER, (), GB, user=entry.user)


def sim_runner(*hooks: Hook) -> RunnerFactory:
    """A server's runner over two simulated services, built whole by the controller as `server_runner` builds
    the server's own (it forgets ended jobs, fair share over the ordering)."""
    return runner_of(
        SimExecutor(2, SeededCosts(seed=0)),
        hooks=list(hooks),
        planner={"validate": True, "ordering": FairShare(Fifo())},
        forget_ended=True,
    )


@contextmanager
def serving(
    tmp_path: Path, runner: RunnerFactory | None = None, prepare: Callable[[JobEntry], Any] = sim_prepare, **fields: Any
) -> Iterator[RunningServer]:
    cfg = ServerConfig(
        port=0, journal=str(tmp_path / "journal.db"), run_dir=str(tmp_path / "runs"), mlflow=False, **fields
    )
    srv = start_server(cfg, prepare=prepare, runner=runner or sim_runner())
    try:
        yield srv
    finally:
        srv.stop(60)


@pytest.fixture
def job_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**copy.deepcopy(TINY), "iterations": 4}))
    return path


def test_submit_status_list_logs_cancel(tmp_path: Path, job_yaml: Path) -> None:
    with serving(tmp_path) as srv:
        c = Client(srv.url)
        ids = [c.submit(job_yaml, [f"seed={i}"], user="ann")["job_id"] for i in range(3)]
        assert ids == ["tiny-1", "tiny-2", "tiny-3"]
        for job_id in ids:
            wait_for(lambda j=job_id: c.status(j)["status"] == "done", f"{job_id} done")  # type: ignore[misc]
        rows = c.jobs()
        assert [(r["job_id"], r["status"], r["iterations_done"], r["user"]) for r in rows] == [
            (j, "done", 4, "ann") for j in ids
        ]
        events = c.events(ids[0])["events"]
        assert [e["kind"] for e in events] == ["submitted", "placed"] + ["iteration"] * 4 + ["done"]
        assert [e["data"]["iteration"] for e in events if e["kind"] == "iteration"] == [0, 1, 2, 3]
        assert c.cancel(ids[0])["status"] == "done"  # an ended job stays as it ended
        assert c.request("GET", "/health")["ok"] is True
        assert "/jobs/{job_id}" in c.request("GET", "/openapi.json")["paths"]
        config = c.request("GET", f"/jobs/{ids[2]}?config=true")["config"]
        assert config["seed"] == 2 and config["run_dir"] == str((tmp_path / "runs").resolve())


def test_bad_submissions_name_every_problem_and_write_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an importable module with a side effect: the server must refuse it without importing it
    marker = tmp_path / "imported"
    (tmp_path / "evil_pkg_zz").mkdir()
    (tmp_path / "evil_pkg_zz" / "__init__.py").write_text("")
    (tmp_path / "evil_pkg_zz" / "mod.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef build(): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with serving(tmp_path, max_body_bytes=4096) as srv:
        c = Client(srv.url)

        def refused(body: Any, status: int = 400) -> str:
            with pytest.raises(ServerError) as err:
                c.request("POST", "/jobs", body)
            assert err.value.status == status, str(err.value)
            return str(err.value)

        assert "not valid YAML" in refused({"yaml": "a: [1, 2"})
        bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{k}: &{k} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
            for p, k in zip("abcde", "bcdef", strict=True)
        )
        assert "expands to more than" in refused({"yaml": bomb})
        assert "nesting deeper" in refused({"yaml": "x: " + "[" * 100 + "]" * 100})
        assert "a job config must be a YAML mapping" in refused({"yaml": "- 1\n- 2\n"})
        assert "larger than 4096 bytes" in refused({"yaml": "x: " + "y" * 5000}, 413)
        assert "Extra inputs are not permitted" in refused({"yaml": "{}", "sudo": True})
        assert "set" in refused({"yaml": "{}", "set": "iterations=1"})
        # every problem at once; the refused module is named and never imported
        many = {
            "name": "../escape",
            "iterations": -1,
            "run_dir": "/etc",
            "tracking": {"uri": "sqlite:////tmp/elsewhere.db"},
            "pipeline": {"name": "evil_pkg_zz.mod:build"},
        }
        text = refused({"yaml": yaml.safe_dump(many), "set": ["model.path=/usr/lib"]})
        for where in ("pipeline.name: 'evil_pkg_zz.mod:build' names module", "name: '../escape'", "run_dir: '/etc'",
                      "model.path: '/usr/lib'", "tracking.uri: set by the server's owner", "iterations:"):  # fmt: skip
            assert f"- {where}" in text, text
        assert "evil_pkg_zz.mod" not in sys.modules and not marker.exists()
        ops = {"pipeline": {"nodes": [{"name": "a", "op": "os.path:join"}]}}
        assert "nodes[0].op: 'os.path:join' names module 'os.path'" in refused({"yaml": yaml.safe_dump(ops)})
        # schema problems of an otherwise allowed job, all at once
        text = refused({"yaml": "iterations: 0\nmodle: {}\n", "set": ["seed"]})
        assert "modle: unknown key" in text and "iterations" in text and "--set seed" in text
        for path in ("/jobs/nope", "/jobs/nope/events"):
            with pytest.raises(ServerError, match="no job 'nope'") as err:
                c.request("GET", path)
            assert err.value.status == 404
        with pytest.raises(ServerError, match="no job 'nope'"):
            c.cancel("nope")
        # a chunked body with no Content-Length is cut off at the limit too
        host, port = urllib.parse.urlsplit(srv.url).netloc.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        chunks = iter([b'{"yaml": "', b"y" * 3000, b"y" * 3000, b'"}'])
        conn.request("POST", "/jobs", body=chunks, headers={"Content-Type": "application/json"}, encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 413 and b"larger than 4096" in resp.read()
        conn.close()
        assert srv.journal.jobs() == []  # nothing refused reached the journal


def test_token_required_off_loopback_and_checked(tmp_path: Path, job_yaml: Path) -> None:
    with pytest.raises(ConfigError, match="set `token`"):
        load_server_config(None, ["host=0.0.0.0"])
    assert load_server_config(None, ["host=0.0.0.0"], token=TOKEN).token == TOKEN
    with pytest.raises(ConfigError, match="`scheduler` needs `driver: dask`"):
        load_server_config(None, ["cluster.scheduler=tcp://x:1", "cluster.driver=local"])
    with serving(tmp_path, token=TOKEN) as srv:
        for bad in (None, "wrong-token-wrong-token"):
            with pytest.raises(ServerError, match="missing or wrong token") as err:
                Client(srv.url, token=bad or "").jobs()
            assert err.value.status == 401
        with pytest.raises(ServerError) as err:
            Client(srv.url, token="").submit(job_yaml)
        assert err.value.status == 401 and srv.journal.jobs() == []
        assert Client(srv.url, token=TOKEN).submit(job_yaml)["job_id"] == "tiny-1"


class Gate(Hook):
    """Blocks the runner thread at the end of iteration `at` until released."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.reached, self.release = threading.Event(), threading.Event()

    def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        if iteration == self.at:
            self.reached.set()
            assert self.release.wait(60)


def test_stop_requeues_unfinished_jobs_and_a_restart_runs_them_again(tmp_path: Path, job_yaml: Path) -> None:
    gate = Gate(at=1)
    with serving(tmp_path, runner=sim_runner(gate)) as srv:
        c = Client(srv.url)
        job_id = c.submit(job_yaml, ["iterations=5"])["job_id"]
        assert gate.reached.wait(60)
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        assert srv.controller.stopping.wait(60)  # the runner is told to stop while it is inside iteration 1
        gate.release.set()
        stopper.join(60)
    j = Journal(tmp_path / "journal.db")
    entry = j.get(job_id)
    assert entry is not None and entry.status == "queued" and entry.iterations_done == 2 and entry.attempt == 1
    assert [e.kind for e in j.events(job_id)][-1] == "interrupted"
    j.close()
    with serving(tmp_path) as srv:
        assert [e.job_id for e in srv.controller.recovered] == [job_id]
        c = Client(srv.url)
        done = wait_for(lambda: c.status(job_id)["status"] == "done" and c.status(job_id), "the resumed job")
        assert done["attempt"] == 2 and done["iterations_done"] == 5
        its = [(e["attempt"], e["data"]["iteration"]) for e in c.events(job_id)["events"] if e["kind"] == "iteration"]
        assert its == [(1, 0), (1, 1)] + [(2, i) for i in range(5)]  # from scratch: nothing is resumed mid-way


def test_cancel_while_preparing_never_reaches_the_runner_and_a_failed_preparation_fails_alone(
    tmp_path: Path, job_yaml: Path
) -> None:
    entered, gate = threading.Event(), threading.Event()

    def prepare(entry: JobEntry) -> SimJob:
        if entry.name == "slow":
            entered.set()
            assert gate.wait(60)
        if entry.name == "boom":
            raise RuntimeError("no such model")
        return sim_prepare(entry)

    with serving(tmp_path, runner=sim_runner(), prepare=prepare) as srv:
        runner = srv.controller.runner
        c = Client(srv.url)
        slow = c.submit(job_yaml, ["name=slow"])["job_id"]
        boom = c.submit(job_yaml, ["name=boom"])["job_id"]
        ok = c.submit(job_yaml)["job_id"]
        assert entered.wait(60)
        cancelled = c.cancel(slow)
        assert cancelled["status"] == "cancelled" and cancelled["reason"] == "cancelled by user"
        gate.set()
        wait_for(lambda: c.status(ok)["status"] == "done", "the good job")  # preparation is sequential
        assert slow not in runner.runs and boom not in runner.runs
        assert c.status(slow)["status"] == "cancelled"
        failed = c.status(boom)
        assert (
            failed["status"] == "failed" and failed["reason"] == "preparing the job failed: RuntimeError: no such model"
        )
        assert [e["kind"] for e in c.events(slow)["events"]] == ["submitted", "cancelled"]


def test_cancel_a_running_job_is_recorded_at_once(tmp_path: Path, job_yaml: Path) -> None:
    gate = Gate(at=0)
    with serving(tmp_path, runner=sim_runner(gate)) as srv:
        runner = srv.controller.runner
        c = Client(srv.url)
        job_id = c.submit(job_yaml, ["iterations=50"])["job_id"]
        assert gate.reached.wait(60)
        assert c.cancel(job_id)["status"] == "cancelled"  # durable before the runner even hears of it
        gate.release.set()
        wait_for(lambda: job_id not in runner.runs, "the runner to close the job (then it forgets it)")
        entry = c.status(job_id)
        assert entry["status"] == "cancelled" and entry["iterations_done"] <= 2
        assert json.dumps(entry)  # JSON-able


def test_cli_clients(tmp_path: Path, job_yaml: Path) -> None:
    """`plexrl submit | status | list | logs | cancel` against a running server; clear errors, no traceback."""
    from typer.testing import CliRunner

    from plexrl.cli import app

    cli = CliRunner()
    gate = Gate(at=0)
    with serving(tmp_path, runner=sim_runner(gate)) as srv:
        opts = ["--server", srv.url]
        res = cli.invoke(app, ["submit", str(job_yaml), "--set", "iterations=3", *opts])
        assert res.exit_code == 0 and res.output.strip() == "tiny-1", res.output
        assert gate.reached.wait(60)
        res = cli.invoke(app, ["status", *opts])  # every unfinished job
        assert res.exit_code == 0 and res.output.split()[:3] == ["tiny-1", "running", "0/3"], res.output
        gate.release.set()
        wait_for(lambda: srv.journal.get("tiny-1").status == "done", "tiny-1 done")  # type: ignore[union-attr]
        res = cli.invoke(app, ["status", "tiny-1", "--json", *opts])
        assert json.loads(res.output)["iterations_done"] == 3
        res = cli.invoke(app, ["list", *opts])
        assert res.output.split()[:3] == ["tiny-1", "done", "3/3"]
        res = cli.invoke(app, ["logs", "tiny-1", "--follow", *opts])
        lines = res.output.splitlines()
        assert lines[0].startswith("[attempt 1] submitted") and lines[-1].startswith("[attempt 1] done")
        assert sum(line.startswith("[attempt 1] iteration") for line in lines) == 3
        res = cli.invoke(app, ["submit", str(job_yaml), "--set", "iterations=-1", *opts])
        assert res.exit_code == 2 and "HTTP 400" in res.output and "iterations" in res.output
        assert "Traceback" not in res.output
        res = cli.invoke(app, ["cancel", "nope", *opts])
        assert res.exit_code == 2 and "no job 'nope'" in res.output
        url = srv.url
    res = cli.invoke(app, ["list", "--server", url])  # the server is gone
    assert res.exit_code == 2 and "no PlexRL server at" in res.output


class UserGate(Gate):
    """A `Gate` for the jobs of one user."""

    def __init__(self, user: str, at: int) -> None:
        super().__init__(at)
        self.user = user

    def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        if run.spec.user == self.user:
            super().on_iteration_end(run, iteration, metrics)


class Holds(Hook):
    """The planner's holds, as the journal hook receives them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def on_job_held(self, run: JobRun, reason: str) -> None:
        self.calls.append((run.job_id, reason))


def test_per_user_limit_holds_a_users_extra_jobs_and_lets_another_user_in(tmp_path: Path, job_yaml: Path) -> None:
    """The planner holds ann's extra jobs (its `user_limits`), their reason reaches the journal through the
    journal hook; bob's job goes in at once; a held job goes in when ann's running one ends."""
    ann, bob_gate, holds = UserGate("ann", at=0), UserGate("bob", at=0), Holds()
    limits = {"validate": True, "ordering": FairShare(Fifo()), "user_limits": UserLimits(max_jobs=1)}
    runner = runner_of(SimExecutor(2, SeededCosts(seed=0)), hooks=[ann, bob_gate, holds], planner=limits,
                       forget_ended=True)  # fmt: skip
    with serving(tmp_path, runner=runner) as srv:
        c = Client(srv.url)
        first = c.submit(job_yaml, ["iterations=6"], user="ann")["job_id"]
        assert ann.reached.wait(60)  # the runner thread is held in ann's first job
        second, third = (c.submit(job_yaml, ["iterations=2"], user="ann")["job_id"] for _ in range(2))
        bob = c.submit(job_yaml, ["iterations=2"], user="bob")["job_id"]
        inbox = srv.controller.runner._inbox  # prepared and handed to the runner (taken at its next turn)
        wait_for(lambda: {s.job_id for s in list(inbox._submits)} == {second, third, bob}, "the hand-overs")
        ann.release.set()
        assert bob_gate.reached.wait(60)  # the planner has weighed them all; bob's job runs
        why = "waiting: user 'ann' has 1 job(s) running, the limit is 1"
        assert c.status(second)["reason"] == why and c.status(third)["reason"] == why
        assert c.status(bob)["reason"] == "" and c.status(first)["status"] == "running"
        assert c.cancel(second)["status"] == "cancelled"  # withdrawn while held
        bob_gate.release.set()
        for job_id in (first, third, bob):
            wait_for(lambda j=job_id: c.status(j)["status"] == "done", f"{job_id} done")  # type: ignore[misc]
        assert c.status(third)["reason"] == ""
        assert c.status(third)["started_at"] >= c.status(first)["finished_at"]  # in once first ended
        assert (second, why) in holds.calls and (third, why) in holds.calls and (third, "") in holds.calls
        assert not any(job == bob for job, _ in holds.calls)


class CheckpointingSim(SimExecutor):
    """The simulator with a checkpoint that writes a real (tiny) file, and fails at the calls named in `fail`
    as a full disk would (a fake for this one test of the server's checkpoint bookkeeping)."""

    def __init__(self, fail: set[int]) -> None:
        super().__init__(1, SeededCosts(seed=0))
        self.fail, self.calls = fail, 0

    def checkpoint(self, job_id: str, service_id: str, path: Path, extra: dict[str, Any]) -> int:
        from plexrl.runtime.executor import CheckpointReport
        from plexrl.services.swap import save_checkpoint

        self.calls += 1
        handle, now = next(self._ids), self.now
        try:
            if self.calls in self.fail:
                raise OSError(28, "No space left on device")
            save_checkpoint({"engine": {}, **extra}, path)
            report = CheckpointReport(job_id, service_id, str(path), now, now)
        except OSError as exc:
            report = CheckpointReport(job_id, service_id, str(path), now, now, f"{type(exc).__name__}: {exc}")
        self._push(now, handle, service_id, report)
        return handle


def test_checkpoint_bookkeeping_and_a_failed_checkpoint_keeps_the_previous(tmp_path: Path, job_yaml: Path) -> None:
    runner = runner_of(
        CheckpointingSim(fail={2}), planner={"validate": True, "ordering": FairShare(Fifo())}, forget_ended=True
    )
    with serving(tmp_path, runner=runner, checkpoint_every=1) as srv:
        c = Client(srv.url)
        job_id = c.submit(job_yaml, ["iterations=4", "pipeline.params.eval_every=1"])["job_id"]
        seen: list[tuple[str, Any]] = []

        def journalled() -> bool:
            seen[:] = [(e["kind"], e["data"].get("iteration")) for e in c.events(job_id)["events"]]
            return ("checkpoint", 2) in seen

        wait_for(journalled, "the checkpoint after iteration 2")
        assert [k for k in seen if k[0].startswith("checkpoint")] == [
            ("checkpoint", 0), ("checkpoint_failed", 1), ("checkpoint", 2)
        ]  # fmt: skip
        wait_for(lambda: c.status(job_id)["status"] == "done", "the job to finish despite the failed checkpoint")
        failed = next(e for e in c.events(job_id)["events"] if e["kind"] == "checkpoint_failed")
        assert failed["data"]["error"] == "OSError: [Errno 28] No space left on device"
        # a done job's checkpoints are removed (just after `done` is journalled: a crash in between keeps them)
        wait_for(lambda: not (tmp_path / "checkpoints" / job_id).exists(), "the checkpoints to be removed")
    j = Journal(tmp_path / "journal.db")
    e = j.get(job_id)
    assert e is not None and e.checkpoint_iteration == 2 and e.checkpoint is not None
    assert e.checkpoint.endswith(f"{job_id}/after-2.pt")  # none after the last iteration (3)


def resumable_prepare(entry: JobEntry) -> SimJob:
    """`sim_prepare`, resumed after the entry's checkpoint like `prepare_entry` resumes a real job."""
    start = 0 if entry.checkpoint_iteration is None else entry.checkpoint_iteration + 1
    nodes = grpo_nodes(every=2)
    return SimJob(entry.job_id, nodes, entry.iterations, {n: 0.1 for n in nodes}, GRPO_ORDER, (), GB,
                  first_iteration=start, user=entry.user)  # fmt: skip


def test_a_lost_service_jobs_are_placed_again_from_their_checkpoint(tmp_path: Path, job_yaml: Path) -> None:
    """service-0 is lost (virtual t=30) while job A runs on it: A is placed again on service-1 and resumes after
    its latest checkpoint; job B on service-1 is untouched; nothing before the checkpoint is run again."""
    sim = SimExecutor(2, SeededCosts(seed=0), failures={"service-0": 30.0})
    runner = runner_of(sim, planner={"validate": True, "ordering": FairShare(Fifo())}, forget_ended=True)
    with serving(
        tmp_path, runner=runner, prepare=resumable_prepare, checkpoint_every=4, cluster={"placement": "spread"}
    ) as srv:
        c = Client(srv.url)
        a = c.submit(job_yaml, ["iterations=200"])["job_id"]
        b = c.submit(job_yaml, ["iterations=200", "seed=1"])["job_id"]
        for job in (a, b):
            wait_for(lambda j=job: c.status(j)["status"] == "done", f"{job} done")  # type: ignore[misc]
        ea, eb = c.events(a)["events"], c.events(b)["events"]
        sa, sb = c.status(a), c.status(b)
    assert (sa["attempt"], sa["iterations_done"], sb["attempt"], sb["iterations_done"]) == (2, 200, 1, 200)
    placed = [(e["attempt"], e["data"]["service"]) for e in ea if e["kind"] == "placed"]
    assert placed == [(1, "service-0"), (2, "service-1")]
    requeued = [e for e in ea if e["kind"] == "interrupted"]
    assert len(requeued) == 1 and "service 'service-0' lost" in requeued[0]["data"]["reason"]
    ckpt = max(e["data"]["iteration"] for e in ea if e["kind"] == "checkpoint" and e["attempt"] == 1)
    assert ckpt % 4 == 3 and ckpt >= 3
    costs = next(e["data"]["costs"] for e in ea if e["kind"] == "checkpoint" and e["data"]["iteration"] == ckpt)
    assert set(costs) == {"prompts", "rollout", "verify", "advantage", "train", "evaluate"}  # the cost model's
    assert all(v > 0 for v in costs.values())  # node times, journalled with the checkpoint
    first = [e["data"]["iteration"] for e in ea if e["kind"] == "iteration" and e["attempt"] == 1]
    again = [e["data"]["iteration"] for e in ea if e["kind"] == "iteration" and e["attempt"] == 2]
    assert first == list(range(len(first))) and first[-1] >= ckpt
    assert again == list(range(ckpt + 1, 200))  # resumed right after the checkpoint
    assert [e["data"]["service"] for e in eb if e["kind"] == "placed"] == ["service-1"]
    assert not any(e["kind"] == "interrupted" for e in eb)


def test_per_user_tokens_decide_who_submits_and_who_may_cancel(tmp_path: Path, job_yaml: Path) -> None:
    users = {"ann": "ann-secret-0123456789", "bob": "bob-secret-0123456789"}
    with pytest.raises(ValueError, match="share a token"):
        ServerConfig(users={"ann": TOKEN}, token=TOKEN)
    with pytest.raises(ValueError, match="16\\+ characters"):
        ServerConfig(users={"ann": "short"})
    assert ServerConfig(host="0.0.0.0", users=users).token is None  # per-user tokens are enough off loopback
    with serving(tmp_path, users=users, token=TOKEN) as srv:
        ann, bob, admin = (Client(srv.url, token=t) for t in (users["ann"], users["bob"], TOKEN))
        with pytest.raises(ServerError) as err:
            Client(srv.url, token="bob-secret-01234567890").jobs()  # one character more than bob's
        assert err.value.status == 401
        job = ann.submit(job_yaml, ["iterations=400"])
        assert job["user"] == "ann"  # the token decides, not the body
        with pytest.raises(ServerError) as err:
            ann.submit(job_yaml, user="bob")
        assert err.value.status == 403 and "cannot submit as 'bob'" in str(err.value)
        with pytest.raises(ServerError) as err:
            bob.cancel(job["job_id"])
        assert err.value.status == 403 and "'bob' cannot cancel it" in str(err.value)
        assert admin.submit(job_yaml, user="carol")["user"] == "carol"  # the administrator submits for anyone
        assert ann.cancel(job["job_id"])["status"] in ("cancelled", "done")
        assert len(admin.jobs()) == 2  # nothing was recorded for the refused requests
