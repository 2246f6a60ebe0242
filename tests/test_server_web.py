"""See the cluster: the `ClusterView` hook fed by hand (no cluster, an injected clock), `GET /cluster` and
`/metrics` on an in-process server running simulated jobs, and the page at `/` in a real headless Chromium."""

from __future__ import annotations

import copy
import html.parser
import os
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import TINY, wait_for
from test_server import TOKEN, Gate, serving, sim_runner

from plexrl.accounting import JobFacts, account
from plexrl.hooks.timeline import Span
from plexrl.job.spec import JobRun
from plexrl.planner import Planner
from plexrl.runtime.sim import GB, GRPO_ORDER, SimJob, grpo_nodes
from plexrl.server.client import Client
from plexrl.server.journal import Journal
from plexrl.server.view import ClusterView
from plexrl.server.web import cluster_payload


class FakeRunner:
    """What `ClusterView` reads of a runner: a clock (set by the test), the service ids, no planner."""

    def __init__(self, services: list[str]) -> None:
        self.now = 0.0
        self.services = services
        self.planner = None

    def clock(self) -> float:
        return self.now


def placed(job_id: str, service: str, at: float, user: str = "") -> JobRun:
    nodes = grpo_nodes(every=2)
    run = JobRun(SimJob(job_id, nodes, 4, {n: 0.1 for n in nodes}, GRPO_ORDER, (), GB, user=user))  # type: ignore[arg-type]
    run.status, run.service, run.started_at = "running", service, at
    return run


def two_jobs(view: ClusterView, runner: FakeRunner) -> tuple[JobRun, JobRun]:
    """a-1 (ann) from t=0 to 8 and b-2 (bob) from t=2 on service s0, fed as the runner would."""
    view.on_start(0.0)
    a = placed("a-1", "s0", 0.0, "ann")
    view.on_job_start(a)
    view.on_load(a, "s0", 0.0, 1.0, GB)
    view.after_node(a, 0, "rollout", "s0", 1.0, 4.0, {})
    view.after_node(a, 0, "verify", "cpu", 4.0, 5.0, {})
    view.on_swap(a, "s0", 5.0, 5.5, GB)
    b = placed("b-2", "s0", 2.0, "bob")
    view.on_job_start(b)
    view.after_node(b, 0, "rollout", "s0", 5.5, 7.5, {})
    a.iterations_done = 1
    view.on_iteration_end(a, 0, {"verify/reward_mean": 0.5, "verify/accuracy": 0.25, "time/iteration": 5.0})
    runner.now = 6.0
    view.on_checkpoint(a, 0, Path("after-0.pt"), None)
    view.on_checkpoint(a, 1, Path("after-1.pt"), "OSError: disk full")  # a failed one is not marked
    a.status, a.finished_at = "done", 8.0
    view.on_job_end(a)
    runner.now = 10.0
    return a, b


def test_the_view_accounts_as_the_accounting_does() -> None:
    runner = FakeRunner(["s0", "s1"])
    view = ClusterView(lambda: runner)
    two_jobs(view, runner)
    snap = view.snapshot()
    s0, s1 = snap.services
    assert (s0.service, s0.busy, s0.swap, s0.startup, s0.idle, s0.jobs) == ("s0", 5.0, 0.5, 1.0, 3.5, ("b-2",))
    assert (s1.service, s1.busy, s1.idle, s1.jobs) == ("s1", 0.0, 10.0, ())  # a service that ran nothing
    a, b = snap.jobs["a-1"], snap.jobs["b-2"]
    # each job: its own seconds + the idle time of s0 shared by residence (a: 0-8, b: 2-10, i.e. half each)
    assert a.accelerator_seconds == pytest.approx(3 + 0.5 + 1 + 3.5 / 2)
    assert b.accelerator_seconds == pytest.approx(2 + 3.5 / 2)
    assert a.slowdown == pytest.approx(8 / 4) and b.slowdown == pytest.approx(8 / 2)  # elapsed / node seconds
    assert (a.reward, a.accuracy, a.steps, a.running, b.running) == (0.5, 0.25, 1, False, True)
    assert [(s.job, s.lane, s.kind) for s in snap.spans] == [
        ("a-1", "s0", "load"), ("a-1", "s0", "node"), ("a-1", "cpu", "node"), ("a-1", "s0", "swap"),
        ("b-2", "s0", "node"), ("a-1", "s0", "checkpoint"),
    ]  # fmt: skip
    # the same numbers as plexrl.accounting over the same spans, as if the run ended now
    spans = [Span(s.job, 0, s.node, s.lane, s.start, s.end, s.kind) for s in snap.spans if s.kind != "checkpoint"]
    facts = [JobFacts("a-1", "s0", 1, 0.0, 8.0, "done"), JobFacts("b-2", "s0", 0, 2.0, 10.0, "running")]
    report = account(spans, facts, ["s0", "s1"], 10.0)
    assert [u.allocated for u in report.jobs] == pytest.approx([a.accelerator_seconds, b.accelerator_seconds])
    assert (report.services[0].busy, report.services[0].idle) == (s0.busy, s0.idle)


def test_the_view_is_bounded_and_keeps_running_jobs() -> None:
    runner = FakeRunner(["s0"])
    view = ClusterView(lambda: runner, max_spans=10, max_jobs=2)
    view.on_start(0.0)
    keep = placed("long-0", "s0", 0.0)
    view.on_job_start(keep)
    for i in range(1, 6):
        run = placed(f"j-{i}", "s0", float(i))
        view.on_job_start(run)
        for k in range(4):
            view.after_node(run, k, "rollout", "s0", i + k / 10, i + (k + 1) / 10, {})
        run.finished_at = i + 0.5
        view.on_job_end(run)
    runner.now = 7.0
    snap = view.snapshot()
    assert sorted(snap.jobs) == ["j-4", "j-5", "long-0"]  # the 2 most recent ended jobs, and the running one
    assert len(snap.spans) == 10 and snap.spans[-1].job == "j-5"
    assert snap.services[0].busy == pytest.approx(5 * 0.4)  # totals are kept whole


def test_snapshots_read_while_the_runner_runs_match_its_timeline(tmp_path: Path) -> None:
    """A simulated run of 12 jobs on 2 services (swaps, 3-4 GB states) in the runner's thread, snapshots taken
    meanwhile from this one: the totals only grow, and at the end equal the accounting of the run's timeline."""
    from plexrl.hooks.timeline import TimelineRecorder
    from plexrl.planner.placement import placement_policy
    from plexrl.runtime.records import Budgets
    from plexrl.runtime.runner import Runner
    from plexrl.runtime.sim import SeededCosts, SimExecutor, grpo_like_jobs

    timeline = TimelineRecorder(tmp_path / "timelines", draw=False)
    view = ClusterView(lambda: runner)  # one of the runner's hooks, built before it
    ex = SimExecutor(2, SeededCosts(seed=3))
    runner = Runner(
        ex,
        Planner(clock=ex.clock, validate=True, placement=placement_policy("pack")),
        hooks=[timeline, view],
        budgets=Budgets(device=5 * GB),  # one job's state on device at a time: every switch swaps
    )
    jobs = grpo_like_jobs(12, (3, 6), seed=3)
    thread = threading.Thread(target=runner.run, args=(jobs,), name="runner")
    thread.start()
    seen: list[float] = []
    while thread.is_alive() or not seen:
        snap = view.snapshot()
        seen.append(sum(s.busy + s.swap + s.startup for s in snap.services))
    thread.join(60)
    snap = view.snapshot()
    assert seen == sorted(seen) and len(snap.jobs) == 12 and not any(j.running for j in snap.jobs.values())
    t0 = timeline.t0 or 0.0
    facts = [JobFacts(r.job_id, r.service, r.iterations_done, (r.started_at or t0) - t0, (r.finished_at or t0) - t0,
                      r.status) for r in runner.runs.values()]  # fmt: skip
    report = account(timeline.spans, facts, sorted(runner.services), snap.now - t0)
    for mine, theirs in zip(snap.services, report.services, strict=True):
        assert (mine.busy, mine.swap, mine.startup) == pytest.approx((theirs.busy, theirs.swap, theirs.startup))
        assert mine.idle == pytest.approx(theirs.idle)
    assert {j.job_id: j.allocated for j in report.jobs} == pytest.approx(
        {j: v.accelerator_seconds for j, v in snap.jobs.items()}
    )
    assert sum(s.swap for s in snap.services) > 0  # the run did swap


def test_cluster_payload_visibility(tmp_path: Path) -> None:
    runner = FakeRunner(["s0"])
    view = ClusterView(lambda: runner)
    two_jobs(view, runner)
    journal = Journal(tmp_path / "journal.db")
    try:
        assert journal.submit("a", {}, 4, "ann").job_id == "a-1"
        assert journal.submit("b", {}, 4, "bob").job_id == "b-2"
        journal.submit("c", {}, 4, "carl")  # queued, not handed to the runner yet
        journal.set_reason("c-3", "waiting: user 'carl' has 1 job(s) running, the limit is 1")
        journal.placed("a-1", "s0")
        journal.iteration("a-1", 0, {"verify/reward_mean": 0.5})
        journal.finish("a-1", "done")
        journal.placed("b-2", "s0")
        snap = view.snapshot()
        admin = cluster_payload(snap, journal, None, True, True)
        rows = {j["job_id"]: j for j in admin["jobs"]}
        assert list(rows) == ["a-1", "b-2", "c-3"]
        assert (rows["a-1"]["reward"], rows["a-1"]["hidden"], rows["b-2"]["hidden"]) == (0.5, False, False)
        assert rows["c-3"]["waiting"].startswith("waiting: user 'carl'") and rows["b-2"]["waiting"] == ""
        assert [q["job_id"] for q in admin["queue"]] == ["c-3"]
        assert {s["node"] for s in admin["spans"] if s["job"] == "b-2"} == {"rollout"}
        assert all(s["end"] <= 0 for s in admin["spans"])  # seconds before now
        bob = cluster_payload(snap, journal, "bob", True, True)
        rows = {j["job_id"]: j for j in bob["jobs"]}
        assert (rows["a-1"]["hidden"], rows["a-1"]["reward"], rows["a-1"]["accuracy"]) == (True, None, None)
        assert rows["a-1"]["accelerator_seconds"] == pytest.approx(6.25)  # the cluster's use stays visible
        assert {s["node"] for s in bob["spans"] if s["job"] == "a-1"} == {""}
        assert {s["node"] for s in bob["spans"] if s["job"] == "b-2"} == {"rollout"}
        assert rows["c-3"]["waiting"].startswith("waiting: user 'carl'")  # a waiting reason stays
        shared = cluster_payload(snap, journal, "bob", False, True)  # private_jobs off: everything
        assert {j["job_id"]: j["reward"] for j in shared["jobs"]}["a-1"] == 0.5
    finally:
        journal.close()


@pytest.fixture
def job_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**copy.deepcopy(TINY), "iterations": 4}))
    return path


def get(url: str, token: str | None = None) -> tuple[int, str, dict[str, str]]:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def test_cluster_and_metrics_endpoints(tmp_path: Path, job_yaml: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    gate = Gate(at=1)  # holds the runner at the end of iteration 1 (before the journal hears of it)
    with serving(tmp_path, runner=sim_runner(gate), token=TOKEN, cluster={"placement": "spread"}) as srv:
        c = Client(srv.url, token=TOKEN)
        first = c.submit(job_yaml, ["iterations=3"], user="ann")["job_id"]
        assert gate.reached.wait(60)
        data = c.request("GET", "/cluster")
        rows = {j["job_id"]: j for j in data["jobs"]}
        assert rows[first]["status"] == "running" and rows[first]["iterations_done"] == 1
        assert rows[first]["accelerator_seconds"] > 0 and rows[first]["slowdown"] >= 1.0
        assert [s["id"] for s in data["services"]] == ["service-0", "service-1"]
        assert {s["job"] for s in data["spans"] if s["kind"] == "node"} == {first}
        # the page's shell and assets need no token and carry no data; the data and the metrics need it
        for path in ("/", "/static/cluster.js", "/static/cluster.css"):
            status, body, headers = get(srv.url + path)
            assert status == 200 and first not in body and "default-src 'none'" in headers["content-security-policy"]
        for path in ("/cluster", "/metrics", "/static/other.js", "/jobs"):
            assert get(srv.url + path)[0] == 401, path
        status, text, headers = get(srv.url + "/metrics", TOKEN)
        assert status == 200 and headers["content-type"].startswith("text/plain")
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
        assert samples[("plexrl_jobs", (("status", "running"),))] == 1
        assert samples[("plexrl_queue_length", ())] == 0 and samples[("plexrl_healthy", ())] == 1
        assert samples[("plexrl_job_steps", (("job", first), ("user", "ann")))] == 1
        busy = samples[("plexrl_service_busy_seconds_total", (("service", "service-0"),))]
        idle = samples[("plexrl_service_idle_seconds", (("service", "service-1"),))]
        assert busy > 0 and idle > 0
        gate.release.set()
        wait_for(lambda: c.status(first)["status"] == "done", "the job to finish")
        _, text, _ = get(srv.url + "/metrics", TOKEN)
        assert 'plexrl_jobs{status="done"} 1.0' in text and "plexrl_job_steps{" not in text  # open jobs only


# -- the page in a real browser ------------------------------------------------------------------------------
class Dom(html.parser.HTMLParser):
    """The elements of a dumped DOM that the test reads: <body>, the job rows, the timeline canvas."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.body: dict[str, str] = {}
        self.rows: dict[str, dict[str, str]] = {}
        self.canvas: dict[str, str] = {}
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        elif tag == "tr" and "data-job" in a:
            self.rows[a["data-job"]] = a
        elif tag == "canvas" and a.get("id") == "timeline":
            self.canvas = a


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no Chromium found for the cluster page's browser test: run `make setup-browser` (it installs the "
                "Debian package `chromium`), or install Chromium on the PATH")  # fmt: skip


def dump_dom(url: str, profile: Path, budget_ms: int = 4000) -> Dom:
    """The page's DOM after `budget_ms` of the page's (virtual) time: its timers run, its fetches complete."""
    cmd = [chromium(), "--headless", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}",
           f"--virtual-time-budget={budget_ms}", "--dump-dom", url]  # fmt: skip
    if os.geteuid() == 0:
        cmd.insert(1, "--no-sandbox")  # Chromium's sandbox refuses to run as root
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "<body" in done.stdout, done.stderr[-2000:]
    return Dom(done.stdout)


def test_the_page_in_headless_chromium(tmp_path: Path, job_yaml: Path) -> None:
    chromium()  # (fails at once, saying how to install it, when there is none)
    gate = Gate(at=1)
    with serving(tmp_path, runner=sim_runner(gate), token=TOKEN) as srv:
        c = Client(srv.url, token=TOKEN)
        job = c.submit(job_yaml, ["iterations=3"], user="ann")["job_id"]
        assert gate.reached.wait(60)
        page = dump_dom(srv.url + "/", tmp_path / "profile-1")  # no token: the page asks for one
        assert page.body["data-state"] == "login" and not page.rows
        page = dump_dom(f"{srv.url}/#token={TOKEN}", tmp_path / "profile-2")
        assert page.body["data-state"] == "live", page.body
        assert page.rows[job]["data-status"] == "running"
        assert int(page.canvas["data-spans"]) > 0 and page.canvas["data-jobs"] == job
        assert int(page.canvas["data-lanes"]) >= 2  # both services (and the CPU pool)
        gate.release.set()
        wait_for(lambda: c.status(job)["status"] == "done", "the job to finish")
        page = dump_dom(f"{srv.url}/#token={TOKEN}", tmp_path / "profile-3")
        assert page.rows[job]["data-status"] == "done"
        page = dump_dom(f"{srv.url}/#token=wrong-token-wrong-token", tmp_path / "profile-4")
        assert page.body["data-state"] == "login"
