"""See the cluster: the page at `/` (plain HTML, JS and CSS from `plexrl/server/static/`), the JSON it polls
(`GET /cluster`) and `/metrics` in Prometheus' text format, built on the server's `ClusterView` and journal.

Authentication: the page's shell and its two assets carry no data and are served to anyone (a browser cannot
send a bearer token when it navigates); every byte of data comes from `GET /cluster`, which needs the same
`Authorization: Bearer` token as the rest of the API. The page asks for the token, keeps it in the tab's
sessionStorage (or takes it once from the URL fragment, `/#token=...`, which browsers never send to a server,
and removes it from the address bar) and sends it on its fetches. The page is served with a Content-Security-
Policy that allows only its own script, style and fetches, and it writes the server's strings as text, never
as HTML.

Visibility (`ServerConfig.private_jobs`): a user's token sees every job's row (id, user, status, progress,
service, accelerator-seconds, slowdown) but another user's job without its reason (unless it is a server-
written waiting reason), metrics or node names; the administrator sees everything.
"""

from __future__ import annotations

import re
import time
from importlib import resources
from typing import Any, get_args

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from plexrl.planner.records import JobStatus
from plexrl.server.journal import JobEntry, Journal
from plexrl.server.view import ClusterView, Snapshot

PUBLIC_PATHS = frozenset({"/", "/static/cluster.js", "/static/cluster.css"})  # no data: served without a token
ASSETS = {"cluster.js": "text/javascript; charset=utf-8", "cluster.css": "text/css; charset=utf-8"}
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
RECENT_ENDED = 50  # ended jobs shown besides every queued and running one
WINDOW_S = 300.0  # the timeline's spans: the last this many seconds (of the runner's clock)
STATUSES: tuple[str, ...] = get_args(JobStatus)  # THE job status vocabulary (`planner/records.py`)
COUNT_CAP = 10_000  # jobs counted per status for /metrics (the journal has no count query)


def _static(name: str) -> str:
    return resources.files("plexrl.server").joinpath("static", name).read_text(encoding="utf-8")


SESSION_JOB = re.compile(r"s[0-9a-f]{16}-(train|sample)-[0-9]+(-[0-9]+)?")  # a Tinker session's job id


def foreign_session(entry: JobEntry, who: str | None) -> bool:
    """A Tinker session job of another user than `who` (None: the administrator): shown to no one else, since
    its id holds the session's id."""
    return who is not None and entry.user != who and entry.config.get("kind") == "session"


def cluster_payload(
    snap: Snapshot, journal: Journal, who: str | None, private: bool, healthy: bool, window_s: float = WINDOW_S
) -> dict[str, Any]:
    """GET /cluster's answer for identity `who` (None: the administrator, or a server without users); another
    user's Tinker sessions are left out altogether (`foreign_session`)."""
    entries: dict[str, JobEntry] = {}
    for e in journal.jobs("running") + journal.jobs("queued") + journal.jobs(None, RECENT_ENDED):
        entries.setdefault(e.job_id, e)
    secret = {j for j, e in entries.items() if foreign_session(e, who)}
    secret |= {j for j, v in snap.jobs.items() if who is not None and v.user != who and SESSION_JOB.fullmatch(j)}
    entries = {j: e for j, e in entries.items() if j not in secret}

    def mine(user: str) -> bool:
        return who is None or not private or user == who

    def shown(job: str) -> bool:
        return job not in secret and (who is None or not SESSION_JOB.fullmatch(job) or users.get(job) == who)

    ordered = sorted(entries.values(), key=lambda e: e.seq)
    jobs = []
    for e in ordered:
        live = snap.jobs.get(e.job_id)
        own = mine(e.user)
        waiting = ""
        if e.status == "queued":
            waiting = e.reason or (
                (snap.unplaced[e.job_id] or "waiting for room on a service")
                if e.job_id in snap.unplaced
                else "being prepared, or about to go in"
            )
        jobs.append(
            {
                "job_id": e.job_id, "name": e.name, "user": e.user, "status": e.status, "service": e.service,
                "iterations": e.iterations, "iterations_done": e.iterations_done, "attempt": e.attempt,
                "waiting": waiting, "reason": e.reason if own or e.status == "queued" else "",
                "reward": live.reward if live and own else None, "accuracy": live.accuracy if live and own else None,
                "slowdown": live.slowdown if live else None,
                "accelerator_seconds": live.accelerator_seconds if live else None,
                "hidden": not own,
            }
        )  # fmt: skip
    users = {j: v.user for j, v in snap.jobs.items()} | {e.job_id: e.user for e in entries.values()}
    horizon = snap.now - window_s
    spans = [
        {"job": s.job, "lane": s.lane, "kind": s.kind, "node": s.node if mine(users.get(s.job, "")) else "",
         "start": s.start - snap.now, "end": s.end - snap.now}
        for s in snap.spans if s.end >= horizon and shown(s.job)
    ]  # fmt: skip
    services = []
    for s in snap.services:
        waits = [{"job": j, "node": n if mine(users.get(j, "")) else ""} for j, n in s.waiting if shown(j)]
        services.append({"id": s.service, "busy_s": s.busy, "swap_s": s.swap, "startup_s": s.startup,
                         "idle_s": s.idle, "jobs": [j for j in s.jobs if shown(j)], "waiting": waits})  # fmt: skip
    now = time.time()
    queue = [
        {"job_id": j["job_id"], "user": j["user"], "waiting": j["waiting"], "waited_s": now - e.submitted_at}
        for j, e in zip(jobs, ordered, strict=True) if e.status == "queued"
    ]  # fmt: skip
    first = min((s.start for s in snap.spans), default=snap.start)  # the timeline starts at its oldest span
    return {
        "user": who, "private": private, "healthy": healthy, "uptime_s": snap.now - snap.start,
        "window_s": min(window_s, max(snap.now - first, 0.0)), "services": services, "spans": spans, "jobs": jobs,
        "queue": queue,
    }  # fmt: skip


class ClusterCollector:
    """A prometheus_client collector: reads the view and the journal at each scrape (see docs/operations.md)."""

    def __init__(self, view: ClusterView, journal: Journal, healthy: Any) -> None:
        self.view, self.journal, self.healthy = view, journal, healthy

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.view.snapshot()
        up = GaugeMetricFamily("plexrl_healthy", "1 while the server accepts jobs (its runner is alive)")
        up.add_metric([], 1.0 if self.healthy() else 0.0)
        yield up
        counts = GaugeMetricFamily(
            "plexrl_jobs", f"Jobs in the journal by status (counted up to {COUNT_CAP} per status)", labels=["status"]
        )
        open_jobs: list[JobEntry] = []
        for status in STATUSES:
            rows = self.journal.jobs(status, COUNT_CAP)
            counts.add_metric([status], float(len(rows)))
            if status in ("queued", "running"):
                open_jobs += rows
        yield counts
        queue = GaugeMetricFamily("plexrl_queue_length", "Jobs queued (waiting to be placed on a service)")
        queue.add_metric([], float(sum(e.status == "queued" for e in open_jobs)))
        yield queue
        for bucket, what in (("busy", "running nodes"), ("swap", "moving job state (blocking)"),
                             ("startup", "building a job's engine and first state")):  # fmt: skip
            fam = CounterMetricFamily(
                f"plexrl_service_{bucket}_seconds", f"Seconds each service spent {what}", labels=["service"]
            )
            for s in snap.services:
                fam.add_metric([s.service], getattr(s, bucket))
            yield fam
        idle = GaugeMetricFamily(
            "plexrl_service_idle_seconds", "Seconds each service was idle since the server started", labels=["service"]
        )
        for s in snap.services:
            idle.add_metric([s.service], s.idle)
        yield idle
        steps = GaugeMetricFamily("plexrl_job_steps", "Iterations done by each open job", labels=["job", "user"])
        acc = GaugeMetricFamily(
            "plexrl_job_accelerator_seconds",
            "Accelerator-seconds allocated to each open job so far",
            labels=["job", "user"],
        )
        sessions: dict[str, int] = {}
        for e in open_jobs:
            if e.config.get("kind") == "session":  # (every scraper reads this: a session id is no one else's)
                sessions[e.user] = sessions.get(e.user, 0) + 1
                continue
            steps.add_metric([e.job_id, e.user], float(e.iterations_done))
            live = snap.jobs.get(e.job_id)
            if live is not None:
                acc.add_metric([e.job_id, e.user], live.accelerator_seconds)
        yield steps
        yield acc
        open_sessions = GaugeMetricFamily(
            "plexrl_tinker_session_jobs",
            "Open Tinker session jobs of each user (their ids are not shown)",
            labels=["user"],
        )
        for user, n in sorted(sessions.items()):
            open_sessions.add_metric([user], float(n))
        yield open_sessions


def add_web_routes(app: FastAPI, view: ClusterView, controller: Any, private: bool) -> None:
    """`/`, its assets, `GET /cluster` and `GET /metrics` on `app` (whose middleware authenticates: every path
    but `PUBLIC_PATHS` needs the token)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import choose_encoder

    page, assets = _static("index.html"), {name: _static(name) for name in ASSETS}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(view, controller.journal, lambda: controller.healthy))

    @app.get("/", include_in_schema=False)
    def index() -> Any:
        return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @app.get("/static/{name}", include_in_schema=False)
    def asset(name: str) -> Any:
        if name not in assets:
            return JSONResponse({"problems": [{"where": "path", "message": f"no asset {name!r}"}]}, status_code=404)
        return Response(assets[name], media_type=ASSETS[name], headers=PAGE_HEADERS)

    @app.get("/cluster")
    def cluster(request: Request) -> Any:
        """Services with their recent spans, jobs with progress and accounting so far, the queue (the page's
        data; see plexrl/server/web.py)."""
        return cluster_payload(view.snapshot(), controller.journal, request.state.user, private, controller.healthy)

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request) -> Any:
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(registry), media_type=content_type)


__all__ = ["PUBLIC_PATHS", "ClusterCollector", "add_web_routes", "cluster_payload"]
