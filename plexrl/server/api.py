"""The HTTP API of `plexrl serve` (FastAPI; the OpenAPI schema is at /openapi.json, browsable at /docs), and
`start_server`, which wires journal, runner, controller and a uvicorn server together (the runner's spec of a
journalled job: `entries.prepare_entry`, importable from here too).

Endpoints (JSON): POST /jobs (submit), GET /jobs (list), GET /jobs/{id} (status), POST /jobs/{id}/cancel,
GET /jobs/{id}/events?after=SEQ (the journal's events: `plexrl logs`), GET /health; and the cluster page at /
with its data at GET /cluster, and GET /metrics (Prometheus text): `plexrl/server/web.py`. With `tinker.enabled`,
the Tinker API under /api/v1 (`plexrl/server/tinker/`): sessions driven by the `tinker` SDK, as jobs.

Contract:
- A submission is answered 201 only after the job is in the journal. A bad one gets 400 (413: body too large)
  with `{"problems": [{"where", "message"}, ...]}` naming every problem, and nothing is written.
- With a `token` or per-user tokens (`users`), every request must carry `Authorization: Bearer TOKEN`
  (compared with `hmac.compare_digest` against every secret), or, under /api/v1 (the Tinker SDK's way),
  `X-API-Key: tml-TOKEN`; otherwise 401 and nothing is done. A user's
  token makes the request that user's: submissions are recorded as theirs (a different `user` is 403) and
  they may cancel only their own jobs (403); `token` is the administrator's. Without any, the config only
  binds loopback. The page's shell and assets (`web.PUBLIC_PATHS`) carry no data and need no token.
- Private jobs (`private_jobs`, on by default with `users`): a user's token reads another user's job's config
  (`?config=true`) and events as 404, word for word what a job that does not exist gets. Lists and the status
  of another user's job stay readable, without its failure reason, MLflow run and checkpoint (`hidden: true`);
  the administrator reads everything.
- Request bodies are read up to `max_body_bytes` and refused beyond it, whatever Content-Length says.
- 503 when the controller is unhealthy (its runner died) or stopping, or the disk is too full (`min_free_disk`).
- Every request first passes `guard.RequestGuard` (Host, and for a request that changes anything its content
  type and Origin: 421, 415, 403), whatever the route; connections are bounded in number and time
  (`http.py`). A job is refused (400, naming the field) over the server's `limits` (`limits.py`), including the
  limits on all open jobs together; its paths are the user's (`files.py`, checked again where opened).
"""

from __future__ import annotations

import hmac
import logging
import socket
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from plexrl.errors import ConfigError, Problem
from plexrl.server.config import ServerConfig
from plexrl.server.controller import Controller, RunnerFactory
from plexrl.server.entries import prepare_entry
from plexrl.server.journal import JobEntry, Journal
from plexrl.server.view import ClusterView

log = logging.getLogger(__name__)


class SubmitRequest(BaseModel):
    """POST /jobs body."""

    model_config = ConfigDict(extra="forbid")

    yaml: str = Field(description="The job YAML, as text (read by the client; the server opens no user path).")
    set: list[str] = Field(default_factory=list, description="Overrides, e.g. ['iterations=10'].")
    user: str = Field(
        "", max_length=64, description="Who submits (quotas, fair share); with per-user tokens, the token decides."
    )


def _problems(status: int, problems: list[Problem]) -> Any:
    body = {"problems": [{"where": p.where, "message": p.message} for p in problems]}
    return JSONResponse(body, status_code=status)


def _public(entry: JobEntry) -> dict[str, Any]:
    """Another user's job as a private server shows it: no failure reason (a waiting reason stays: the server
    wrote it), MLflow run or checkpoint."""
    out = entry.as_dict()
    out.update(tracking={}, checkpoint=None, checkpoint_iteration=None, hidden=True)
    out["reason"] = entry.reason if entry.status == "queued" else ""
    return out


def create_app(
    controller: Controller, cfg: ServerConfig, view: ClusterView, sessions: Any = None, open_jobs: Any = None
) -> Any:
    """The FastAPI application over `controller` (see the module docstring). `view`: the `ClusterView` among
    the runner's hooks (given when the runner was built: `start_server`); `sessions`: the Tinker API's
    `Registry`, served under /api/v1 when given; `open_jobs`: the server's `limits.OpenJobs` (the sessions' too)."""
    from plexrl.server.files import ServerFiles
    from plexrl.server.guard import RequestGuard, host_names
    from plexrl.server.housekeeping import DiskCheck
    from plexrl.server.limits import open_jobs_of
    from plexrl.server.submissions import check_submission
    from plexrl.server.tinker.rest import signed_download
    from plexrl.server.tinker.routes import PREFIX as TINKER_PREFIX
    from plexrl.server.tinker.routes import add_tinker_routes
    from plexrl.server.tinker.routes import key_of as tinker_key
    from plexrl.server.web import PUBLIC_PATHS, add_web_routes, foreign_session

    app = FastAPI(title="PlexRL server", version="1", description="Submit, watch and cancel RLVR jobs.")
    # (token, identity): identity None = the administrator (any user's jobs)
    secrets: list[tuple[bytes, str | None]] = [(t.encode(), u) for u, t in sorted((cfg.users or {}).items())]
    if cfg.token:
        secrets.append((cfg.token.encode(), None))
    roots, modules = cfg.roots(), list(cfg.allowed_modules)
    private = cfg.jobs_private()
    files, disk = ServerFiles(cfg), DiskCheck([Path(cfg.journal).resolve(), cfg.checkpoints()], cfg.min_free_disk)
    open_jobs = open_jobs or open_jobs_of(controller.journal, modules, sorted(cfg.users or {}))

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        request.state.user = None
        path = request.url.path  # (a signed download URL is its own credential: the SDK sends it no key)
        signed = sessions is not None and signed_download(TINKER_PREFIX, path)
        if secrets and path not in PUBLIC_PATHS and not signed:
            scheme, _, value = request.headers.get("authorization", "").partition(" ")
            if sessions is not None and request.url.path.startswith(TINKER_PREFIX) and not value:
                scheme, value = "bearer", tinker_key(request)  # the SDK's `X-API-Key: tml-TOKEN`
            given = value.encode()
            # every secret is compared (constant time each), so the time taken does not say which one matched
            matches = [u for t, u in secrets if hmac.compare_digest(given, t)]
            if scheme.lower() != "bearer" or not matches:
                refused = _problems(
                    401, [Problem("authorization", "missing or wrong token (Authorization: Bearer ...)")]
                )
                if request.url.path.startswith(TINKER_PREFIX):  # (the SDK drops the client it asked with, unclosed)
                    refused.headers["connection"] = "close"
                return refused
            request.state.user = matches[0]
        return await call_next(request)

    def entry_or_404(job_id: str, who: str | None = None) -> JobEntry | Any:
        """The job, or 404; also 404 when `who` may not read its details (the same answer: ids do not leak)."""
        entry = controller.journal.get(job_id)
        if entry is None or not readable(entry, who) or foreign_session(entry, who):
            return _problems(404, [Problem("job", f"no job {job_id!r}; `plexrl list` shows the jobs")])
        return entry

    def readable(entry: JobEntry, who: str | None) -> bool:
        return who is None or not private or entry.user == who

    def shown(entry: JobEntry, who: str | None, config: bool = False) -> dict[str, Any]:
        return entry.as_dict(config) if readable(entry, who) else _public(entry)

    @app.exception_handler(sqlite3.Error)
    async def _journal_failed(request: Request, exc: sqlite3.Error) -> Any:
        why = f"the journal cannot be written now ({exc}); try again later"  # a full disk, most likely
        return _problems(503, [Problem("server", why)])

    @app.get("/health")
    def health() -> Any:
        full = disk.problem()
        ok = controller.healthy and full is None
        body = {"ok": ok, "error": repr(controller.failure) if controller.failure else full}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.post("/jobs", status_code=201)
    async def submit(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > cfg.max_body_bytes):
            return _problems(413, [Problem("body", f"larger than {cfg.max_body_bytes} bytes")])
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cfg.max_body_bytes:
                return _problems(413, [Problem("body", f"larger than {cfg.max_body_bytes} bytes")])
            chunks.append(chunk)
        try:
            req = SubmitRequest.model_validate_json(b"".join(chunks))
        except ValidationError as exc:
            where = [Problem(".".join(str(x) for x in e["loc"]) or "body", e["msg"]) for e in exc.errors()]
            return _problems(400, where)
        if not controller.healthy:
            return _problems(503, [Problem("server", "not accepting jobs (stopping, or its runner failed)")])
        full = disk.problem()
        if full is not None:
            return _problems(503, [Problem("disk", full)])
        who: str | None = request.state.user
        if who is not None and req.user and req.user != who:
            return _problems(403, [Problem("user", f"this token is user {who!r}'s; it cannot submit as {req.user!r}")])
        user = who if who is not None else req.user

        def accept() -> JobEntry:
            ok = check_submission(
                req.yaml, req.set, run_dir=files.run_dir(user), roots=roots, modules=modules,
                checkpoint_every=cfg.checkpoint_every, max_warm_start_steps=cfg.max_warm_start_steps,
                policy=files.policy(user), limits=cfg.limits,
            )  # fmt: skip
            with open_jobs.lock:  # the per-server limits and the journalling, as one step
                full = open_jobs.check(ok.memory, cfg.limits, user)
                if full:
                    raise ConfigError(full, "server")
                entry = controller.submit(ok.name, ok.config, ok.iterations, user)
                open_jobs.add(entry.job_id, ok.memory)
            return entry

        try:
            entry = await run_in_threadpool(accept)
        except ConfigError as exc:
            return _problems(400, exc.problems)
        except (RuntimeError, OSError, sqlite3.Error) as exc:  # stopping; the journal cannot write (disk full)
            return _problems(503, [Problem("server", f"{type(exc).__name__}: {exc}")])
        return JSONResponse(entry.as_dict(), status_code=201)

    @app.get("/jobs")
    def list_jobs(request: Request, status: str | None = None, limit: int = 1000) -> Any:
        rows = controller.journal.jobs(status, max(1, min(limit, 10_000)))
        who = request.state.user
        return {"jobs": [shown(e, who) for e in rows if not foreign_session(e, who)]}

    @app.get("/jobs/{job_id}")
    def status(job_id: str, request: Request, config: bool = False) -> Any:
        who: str | None = request.state.user
        entry = entry_or_404(job_id, who if config else None)
        if isinstance(entry, JobEntry) and foreign_session(entry, who):
            entry = entry_or_404(job_id, who)
        return shown(entry, who, config) if isinstance(entry, JobEntry) else entry

    @app.get("/jobs/{job_id}/events")
    def events(job_id: str, request: Request, after: int = 0, limit: int = 1000) -> Any:
        entry = entry_or_404(job_id, request.state.user)
        if not isinstance(entry, JobEntry):
            return entry
        rows = controller.journal.events(job_id, after, max(1, min(limit, 10_000)))
        return {"job": entry.as_dict(), "events": [_event(e) for e in rows]}

    @app.post("/jobs/{job_id}/cancel")
    def cancel(job_id: str, request: Request) -> Any:
        who: str | None = request.state.user
        mine = entry_or_404(job_id)
        if isinstance(mine, JobEntry) and foreign_session(mine, who):
            mine = entry_or_404(job_id, who)  # (another user's session: the 404 of a job that does not exist)
        if not isinstance(mine, JobEntry):
            return mine
        if who is not None and mine.user != who:
            return _problems(403, [Problem("job", f"{job_id!r} is user {mine.user!r}'s; {who!r} cannot cancel it")])
        entry = controller.cancel(job_id)
        if entry is None:
            return entry_or_404(job_id)
        return entry.as_dict()

    add_web_routes(app, view, controller, private)
    if sessions is not None:
        add_tinker_routes(app, sessions, open_server=not secrets)
    app.add_middleware(RequestGuard, hosts=host_names(cfg.host, cfg.http.allowed_hosts))  # outermost: every route
    return app


def _event(e: Any) -> dict[str, Any]:
    return {"seq": e.seq, "time": e.time, "attempt": e.attempt, "kind": e.kind, "data": e.data}


@dataclass
class RunningServer:
    """A started server: `url` to talk to, `stop()` to stop it gracefully (HTTP first, then the controller:
    open jobs go back to `queued` in the journal and their MLflow runs end KILLED)."""

    url: str
    controller: Controller
    journal: Journal
    http: Any
    thread: threading.Thread
    housekeeping: Any = None  # its `Housekeeping` (time limits, checkpoint retention)
    sessions: Any = None  # the Tinker API's Registry (None: not served)
    stopping: threading.Event = field(default_factory=threading.Event)  # stops the sessions' sweeper

    def stop(self, timeout: float = 120.0) -> bool:
        self.stopping.set()
        self.http.should_exit = True
        self.thread.join(timeout)
        if self.housekeeping is not None:
            self.housekeeping.stop()
        ok = self.controller.stop(timeout)
        self.journal.close()
        return ok and not self.thread.is_alive()


def server_runner(
    cfg: ServerConfig, executor: Any = None, hooks: list[Any] | None = None, *, more_hooks: Sequence[Any] = (),
    **parts: Any,
) -> Any:  # fmt: skip
    """The server's `Runner`, built whole from its `cluster:` section (`runtime.build.build_runner`; over
    `executor`, default the section's): it forgets ended jobs (weeks of them live on in the journal and MLflow,
    not in memory) and its timeline drops each job's spans once written. `hooks`, then `more_hooks`: after the
    standard ones (tests; the controller's journal hook); `parts` (`on_closed`, `checkpoint_at`): the
    controller's (`controller.RunnerFactory`)."""
    from plexrl.runtime.build import build_runner, make_executor
    from plexrl.runtime.jobs import standard_hooks

    run_dir = Path(cfg.run_dir).resolve()
    standard = standard_hooks(run_dir, progress=False, mlflow=cfg.mlflow, keep_ended=False)
    hooks = [*standard, *(hooks or []), *more_hooks]
    if executor is None:  # its CPU nodes in processes killed past the server's limit (runtime/cpu_nodes.py)
        executor = make_executor(cfg.cluster, cpu_node_s=cfg.limits.max_cpu_node_s)
    return build_runner(cfg.cluster, hooks, executor, forget_ended=True, **parts)


def start_server(cfg: ServerConfig, *, prepare: Any = prepare_entry, runner: Any = None) -> RunningServer:
    """Open the journal, start the controller (recovering unfinished jobs) and the HTTP server in threads;
    returns once the socket is listening. `runner`: builds the runner (`controller.RunnerFactory`; tests give
    `controller.runner_of(...)`); default: `server_runner` over `cfg`. The cluster view and the controller's
    journal hook join its hooks when it is built, nothing afterwards."""
    import functools

    from plexrl.logs import limit_repeats
    from plexrl.server.files import ServerFiles
    from plexrl.server.housekeeping import Housekeeping
    from plexrl.server.http import serve, uvicorn_server
    from plexrl.server.limits import admit, open_jobs_of

    make: RunnerFactory = runner if runner is not None else functools.partial(server_runner, cfg)
    journal = Journal(cfg.journal)
    every, where = cfg.checkpoint_every, cfg.checkpoints()
    view = ClusterView(lambda: controller.runner)  # what the page and /metrics show: a hook, on the runner's thread

    backend = None
    if cfg.tinker.enabled:  # sessions of the Tinker API: their calls go through the runner's CallBoard
        from plexrl.server.tinker.server_backend import ControllerBackend

        backend = ControllerBackend(journal)

    def build(more_hooks: Sequence[Any] = (), **parts: Any) -> Any:
        if backend is None:
            return make(more_hooks=[view, *more_hooks], **parts)
        return make(more_hooks=[view, backend.hook, *more_hooks], calls=backend.board, **parts)

    if prepare is prepare_entry:
        services = cfg.cluster.services
        options: dict[str, Any] = dict(
            max_warm_start_steps=cfg.max_warm_start_steps, modules=list(cfg.allowed_modules),
            device=services.device, group=services.ranks > 1, files=ServerFiles(cfg), limits=cfg.limits,
            calls=None if backend is None else backend.board,
        )  # fmt: skip
        prepare = functools.partial(prepare_entry, **options)
        if cfg.limits.prepare_memory is not None:  # first in a child process, within its memory and time
            from plexrl.server.preparation import prepare_isolated

            limits = cfg.limits
            prepare = functools.partial(prepare_isolated, prepare=prepare_entry, memory=int(limits.prepare_memory),  # type: ignore[arg-type]
                                        timeout_s=limits.prepare_timeout_s, **options)  # fmt: skip
    controller = Controller(
        build, journal, prepare, checkpoint_every=every, checkpoint_dir=where,
        max_attempts=cfg.max_attempts, prepare_workers=cfg.prepare_workers,
    )  # fmt: skip
    open_jobs = open_jobs_of(journal, list(cfg.allowed_modules), sorted(cfg.users or {}))  # (jobs and sessions)
    sessions = None
    if backend is not None:
        from plexrl.job.pretrained import pretrained_path
        from plexrl.server.housekeeping import DiskCheck
        from plexrl.server.tinker.registry import Registry

        backend.attach(controller)
        root, run_dir = where / "sessions", Path(cfg.run_dir).resolve()
        full = DiskCheck([root], cfg.min_free_disk).problem  # (Tinker writes are refused like POST /jobs)
        sessions = Registry(cfg.tinker, backend, root, cfg.roots(), pretrained_path, run_dir=run_dir,
                            policy_of=ServerFiles(cfg).policy, disk=full,
                            admit=functools.partial(admit, open_jobs, cfg.limits))  # fmt: skip
        sessions.recover([e for e in journal.jobs() if not e.finished and e.config.get("kind") == "session"])
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # no Nagle on the connections (Linux: accepted sockets inherit it): a response written in two parts
    # (headers, body) otherwise waits for the client's delayed ACK, 40 ms a request here
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError:
        journal.close()
        sock.close()
        raise
    sock.listen(128)
    limit_repeats("uvicorn", "uvicorn.error", "asyncio")  # a flood of one line costs a few lines a minute
    controller.start()
    house = Housekeeping(journal, controller, where, max_run_s=cfg.limits.max_run_s,
                         retention_s=cfg.checkpoint_retention_s)  # fmt: skip
    controller.on_end = house.wake
    house.start()
    app = create_app(controller, cfg, view, sessions, open_jobs)
    polls = sessions.futures.polls if sessions is not None else None  # (long polls: evicted last, capped per user)
    http = uvicorn_server(app, cfg.http, polls)  # connections bounded in number and time (http.py)
    thread = threading.Thread(target=serve, args=(http, sock), name="plexrl-http", daemon=True)
    thread.start()
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    running = RunningServer(f"http://{shown}:{port}", controller, journal, http, thread, house, sessions)
    if sessions is not None:  # abandoned sessions end; sessions waiting for admission say why
        threading.Thread(target=sessions.tick_until, args=(running.stopping,), name="tinker-sweep", daemon=True).start()
    return running


__all__ = ["RunningServer", "SubmitRequest", "create_app", "prepare_entry", "start_server"]
