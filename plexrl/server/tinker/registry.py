"""`Registry`: the state behind the Tinker API (`routes.py`; the operations themselves: `handlers.py`). A
training client is ONE session job (`plexrl.sessions`), opened through a `Backend` (the controller's on `plexrl
serve`: the journal records it); each of its calls, and each sample of a sampling client, becomes a call of a
job, run as a node the planner places and orders among every other job's nodes. Replies complete the request's
future (`futures.py`), which the client polls.

Who may see what: every session, model, sampler, saved path and future belongs to the user whose key created
it; another user's gets the answer of one that does not exist (404), so ids do not leak. The administrator
(`user` None) reaches everything.

Order: a training client's requests carry consecutive `seq_id`s; they are passed on in that order (`turns.py`,
the registry's `turns`: one that comes early waits for those before it, a repeated one gets the first one's
future). Calls of one job run in the order passed on (`plexrl.runtime.calls`).

Lifetime: a session whose client sent nothing (no call, no heartbeat) for `session_timeout_s` is ended by
`sweep` and its models' jobs close with a checkpoint; `finish` (the client's `close`) closes them at once;
`unload_model` closes one model's job the same way (`handlers.unload_model`: status `closing` until it ended). A
model's job that ends fails the requests still waiting for it.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from plexrl.errors import ConfigError
from plexrl.paths import FilePolicy, resolve
from plexrl.server.limits import session_bytes
from plexrl.server.tinker import catalog, durable, quotas
from plexrl.server.tinker import decode as dec
from plexrl.server.tinker.config import TinkerConfig
from plexrl.server.tinker.futures import Done, Finish, Futures, replying
from plexrl.server.tinker.records import (
    ClientSession,
    ModelRecord,
    SamplerRecord,
    file_of,
    forget_ended,
    job_of,
    tinker_path,
    write_owner,
)
from plexrl.server.tinker.turns import Turns
from plexrl.sessions.calls import Call, Save
from plexrl.sessions.spec import SessionConfig
from plexrl.sizes import count_parameters

log = logging.getLogger(__name__)

Refused = dec.Refused


class Backend(Protocol):
    """How the registry reaches the runner: open a session job, pass it calls, close it. The backend tells the
    registry (`bind`) when a job is on its service (`job_ready`) and when it ended (`job_ended`)."""

    def bind(self, registry: Registry) -> None: ...

    def open(self, cfg: SessionConfig, user: str) -> str:
        """Submit the session job of `cfg` (prepared in the background); returns its job id at once. Calls may be
        passed on from then: they wait for the job."""

    def call(self, job_id: str, kind: str, call: Call, done: Done) -> None:
        """Pass a call on to the job (in the order of these calls)."""

    def withdraw(self, job_id: str, done: Done) -> bool:
        """Take back a call passed on with `done` and still queued (not announced to the runner): whether it was."""

    def close(self, job_id: str) -> None:
        """No more calls: the job ends once its call in flight did (calls still waiting fail)."""

    def reason(self, job_id: str) -> str:
        """What the job waits for, if anything (admission, a service), in words."""

    def status(self, job_id: str) -> tuple[str, str]:
        """The job's status and reason as the server records them ("" when unknown)."""


class Registry:
    """See the module docstring. `root`: where sessions' files go; `roots`: where a model may be named by path;
    `resolve_pretrained`: a pretrained short name's directory (converting it on first use); `run_dir`: where
    sessions keep their MLflow store (the server's); `policy_of`: a user's `FilePolicy` (the job API's,
    `plexrl/server/files.py`), which a base model named by path must pass; `admit(user, parameters, memory, submit)`:
    a model's job through the job API's limits (`plexrl/server/limits.py`: ConfigError when it does not fit)."""

    def __init__(
        self,
        cfg: TinkerConfig,
        backend: Backend,
        root: Path,
        roots: list[Path],
        resolve_pretrained: Callable[[str], Path],
        clock: Callable[[], float] = time.monotonic,
        run_dir: Path | None = None,
        policy_of: Callable[[str], FilePolicy] | None = None,
        disk: Callable[[], str | None] | None = None,
        admit: Callable[[str, int, int, Callable[[], str]], str] | None = None,
    ) -> None:
        self.cfg, self.backend, self.root, self.roots, self.policy_of = cfg, backend, root, roots, policy_of
        self.run_dir = run_dir or root.parent  # the sessions' MLflow store and caches: the server's run_dir
        self.resolve_pretrained, self.clock, self.disk, self.admit = resolve_pretrained, clock, disk, admit
        self.futures = Futures(max_open=cfg.max_requests_per_user, max_polls=cfg.max_polls_per_user,
                               max_bytes=cfg.max_queued_bytes_per_user)  # fmt: skip
        self.turns = Turns(self.futures, backend, clock)  # (training requests in seq-id order: `turns.py`)
        self.lock = threading.Lock()
        self.sessions: dict[str, ClientSession] = {}
        self.models: dict[str, ModelRecord] = {}
        self.samplers: dict[str, SamplerRecord] = {}
        self.by_job: dict[str, ModelRecord] = {}
        self._early: dict[str, list[tuple[str, ...]]] = {}  # news of a job before `open` recorded it
        backend.bind(self)

    # -- ownership (lock held) -------------------------------------------------------------------------
    def session(self, user: str | None, session_id: Any, *, live: bool = True) -> ClientSession:
        s = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if s is None or (user is not None and s.user != user):
            raise Refused(404, f"no session {session_id!r}")
        if live and s.ended is not None:
            raise Refused(410, f"session {session_id} ended ({s.ended}); start a new ServiceClient")
        s.last_seen = self.clock()
        return s

    def model(self, user: str | None, model_id: Any) -> ModelRecord:
        m = self.models.get(model_id) if isinstance(model_id, str) else None
        if m is None or (user is not None and m.user != user):
            raise Refused(404, f"no model {model_id!r}")
        if m.status in ("ended", "closing"):
            raise Refused(410, f"model {model_id} ended ({m.reason}); its saved weights stay loadable by path")
        self.session(user, m.session_id, live=False)
        return m

    def sampler(self, user: str | None, sampler_id: Any) -> SamplerRecord:
        s = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if s is None or (user is not None and s.user != user):
            raise Refused(404, f"no sampling session {sampler_id!r}")
        return s

    def check_writes(self, user: str | None) -> None:
        """`quotas.check_writes` for `user` (before a request that writes files: a new model, a save)."""
        quotas.check_writes(self.disk, self.root, user, self.cfg.max_saved_bytes_per_user)

    # -- sessions --------------------------------------------------------------------------------------
    def create_session(self, user: str) -> dict[str, Any]:
        with self.lock:
            mine = sum(1 for s in self.sessions.values() if s.user == user and s.ended is None)
            cap = self.cfg.max_open_sessions_per_user
            if mine >= cap:
                raise Refused(429, f"user {user!r} has {mine} open sessions, this server's "
                                   "tinker.max_open_sessions_per_user; close a ServiceClient first (or ask the "
                                   "server's owner to raise it)")  # fmt: skip
            sid = "s" + secrets.token_hex(8)
            self.sessions[sid] = ClientSession(sid, user, self.clock())
        durable.keep(self.root, sid, user)  # (a restart knows it again, model or not)
        return {"type": "create_session", "session_id": sid, "info_message": f"PlexRL session {sid} (user {user!r})"}

    def heartbeat(self, user: str | None, session_id: Any) -> dict[str, Any]:
        with self.lock:
            self.session(user, session_id)
        return {"type": "session_heartbeat"}

    def finish(self, user: str | None, session_id: Any, reason: str, save: bool = False) -> None:
        """End a session: its models' and samplers' jobs close; with `save`, each training model saves its state
        first (a call like any other: `tinker://<model>/weights/ended-<n>`, loadable by its owner later)."""
        with self.lock:
            s = self.session(user, session_id, live=False)
            if s.ended is not None:
                return
            s.ended = reason
            models = [self.models[m] for m in s.models
                      if self.models[m].status not in ("ended", "closing") and self.models[m].job_id]  # fmt: skip
        durable.forget(self.root, s.session_id)
        for m in models:
            if not save or m.sampler_only:
                self.backend.close(m.job_id)
                continue
            name = f"ended-{secrets.token_hex(4)}"
            target = file_of(self.root, m.model_id, "weights", name)
            path = tinker_path(m.model_id, "weights", name)

            def saved(reply: dict[str, Any] | None, error: str | None, m: ModelRecord = m, path: str = path) -> None:
                why = error if reply is None else reply.get("error")
                if why:
                    log.error("session model %s: saving its state before it ends failed: %s", m.model_id, why)
                else:
                    log.warning("session model %s ended (%s); its state is at %s", m.model_id, reason, path)
                    with self.lock:
                        m.saved = path
                self.backend.close(m.job_id)

            self.backend.call(m.job_id, "save", Save(str(target), "state"), saved)

    def sweep(self) -> list[str]:
        """End the sessions whose client sent nothing for `session_timeout_s` and waits on no call of theirs
        (`Futures.busy`), checkpointing their models; returns their ids."""
        now = self.clock()
        limit = self.cfg.session_timeout_s
        busy = self.futures.busy(limit)  # (a client polling for its long call is not silent)
        with self.lock:
            stale = [s for s in self.sessions.values()
                     if s.ended is None and now - s.last_seen > limit and s.session_id not in busy]  # fmt: skip
            for s in [s for s in self.sessions.values() if s.ended is not None and now - s.last_seen > limit]:
                if all(self.models[m].status == "ended" for m in s.models if m in self.models):
                    del self.sessions[s.session_id]  # (ended long ago, nothing of it alive: forgotten)
            forget_ended(self.models, self.samplers, self.by_job, set(self.sessions), now)
        for s in stale:
            log.warning("session %s of %r: no call or heartbeat for %.0f s; ending it, its state checkpointed",
                        s.session_id, s.user, now - s.last_seen)  # fmt: skip
            self.finish(None, s.session_id, f"no call or heartbeat for {limit:.0f} s", True)
        return [s.session_id for s in stale]

    def tick(self) -> None:
        """Once a second or so: end abandoned sessions (`sweep`); requests held `turn_wait_s` for a seq id that
        never came get their turn (the missing ones skipped); models still opening learn what their job waits
        for (admission: shown in try_again), or that it ended before it came up."""
        self.sweep()
        with self.lock:
            self.turns.skip_gaps(self.models.values(), self.cfg.turn_wait_s)
        with self.lock:
            opening = [m for m in self.models.values() if m.status in ("opening", "closing") and m.job_id]
        for m in opening:
            status, reason = self.backend.status(m.job_id)
            if status in ("done", "failed", "cancelled"):
                self.job_ended(m.job_id, status, reason)
                continue
            for rid, _ in list(m.waiting):
                self.futures.set_reason(rid, reason or "waiting for a service")

    def tick_until(self, stop: threading.Event, every: float = 1.0) -> None:
        """`tick` every `every` seconds until `stop` is set (the server's sweeper thread)."""
        while not stop.wait(every):
            try:
                self.tick()
            except Exception:  # the sweeper must outlive a bad tick
                log.exception("the Tinker API's sweep failed")

    def recover(self, entries: list[Any]) -> None:
        """At a server start, before the controller resubmits them: the journal's unfinished sessions, so their
        clients' calls find their models again (their numbering goes on from what the client sends next); the
        sessions recorded open, with a model or not; and the sampling clients recorded on their models
        (`durable.recover`)."""
        sessions, models, samplers = durable.recover(self.root, entries, self.clock())
        with self.lock:
            self.sessions.update(sessions)
            self.models.update(models)
            self.samplers.update(samplers)
            self.by_job.update({m.job_id: m for m in models.values()})

    # -- models ----------------------------------------------------------------------------------------
    def base_dir(self, name: Any, user: str | None = None) -> Path:
        """The directory of a base model named by pretrained short name (converted on first use) or by path
        under the allowed roots (one answer for a path outside them, whether it exists or not)."""
        self.check_base(name, user)
        entry = catalog.entry_of(self.cfg.models, name)
        return catalog.directory(entry, self.resolve_pretrained) if entry is not None else resolve(name)

    def check_base(self, name: Any, user: str | None = None) -> None:
        """`quotas.check_base` with this server's names, roots and `user`'s file policy."""
        policy = self.policy_of(user) if self.policy_of is not None and user is not None else None
        quotas.check_base(name, self.cfg.models, self.roots, policy)

    def new_model(self, user: str, session_id: Any, seq: Any, base_model: Any, kind: str = "train") -> ModelRecord:
        """Record a model of a session (lock held): its ids, after the checks that need no model file."""
        s = self.session(user, session_id)
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 10**9:
            raise Refused(400, f"{kind} seq id must be an integer in [0, 1e9)")
        if f"{kind}:{seq}" in s.seqs:
            raise Refused(400, f"session {s.session_id} already has {kind} client {seq}")
        mine = sum(1 for m in self.models.values() if m.user == user and m.status != "ended")
        if mine >= self.cfg.max_sessions_per_user:
            raise Refused(400, f"user {user!r} has {mine} open models, the server's max_sessions_per_user; "
                               "close a ServiceClient first")  # fmt: skip
        self.check_base(base_model, user)
        model_id = f"{s.session_id}:{kind}:{seq}"
        m = ModelRecord(model_id, "", s.session_id, user, str(base_model), seed=seq, sampler_only=kind == "sample")
        s.seqs.add(f"{kind}:{seq}")
        s.models.append(model_id)
        self.models[model_id] = m
        return m

    def open(self, m: ModelRecord, first: tuple[Call, Done] | None = None) -> None:
        """Open the model's job (lock NOT held: a pretrained base converts on first use): its base found, its
        limits read, its files' owner written, its job submitted; `first`: a call it runs before any other."""
        try:
            model_dir = self.base_dir(m.base_model, m.user)
            limits, parameters = dec.model_limits(model_dir), count_parameters(model_dir)
        except Refused:
            self._forget(m)
            raise
        except Exception as exc:
            self._forget(m)
            raise Refused(400, f"the base model {m.base_model!r} cannot be read: {type(exc).__name__}: {exc}") from None
        m.model_dir = model_dir
        write_owner(self.root, m)
        cfg = self.session_config(m, model_dir)
        memory = session_bytes(cfg.model_dump(mode="json"))  # (its state, as a job's: `limits.max_open_bytes`)

        def submit() -> str:
            return self.backend.open(cfg, m.user)

        try:  # (through the job API's limits, journalled in the same step: `limits.admit`)
            job_id = submit() if self.admit is None else self.admit(m.user, parameters, memory, submit)
        except ConfigError as exc:
            self._forget(m)
            raise Refused(400, "; ".join(f"{p.where}: {p.message}" for p in exc.problems)) from None
        with self.lock:  # (`finish` closes the jobs of the models it sees with a job id, under this lock)
            m.job_id, m.limits = job_id, limits
            self.by_job[job_id] = m
            early = self._early.pop(job_id, [])
            s = self.sessions.get(m.session_id)
            ended = s.ended if s is not None else "forgotten"
            ended = m.reason if ended is None and m.status == "closing" else ended  # (unloaded as it opened)
        for news in early:
            self.job_ready(job_id) if news[0] == "ready" else self.job_ended(job_id, news[1], news[2])
        if ended is not None:  # its session ended (or it was unloaded) while the job was submitted: it closes
            log.warning("session model %s ended (%s) as it opened; its job closes", m.model_id, ended)
            self.backend.close(job_id)
            if first is not None:
                first[1](None, f"the model ended ({ended}) before it opened")
        elif first is not None:
            self.backend.call(job_id, first[0].kind, first[0], first[1])

    def _forget(self, m: ModelRecord) -> None:
        """A model that could not be opened leaves no trace (its seq id may be used again)."""
        with self.lock:
            self.models.pop(m.model_id, None)
            for rid in m.unloads:  # (unloaded as it failed to open: nothing is left to unload)
                self.futures.complete(rid, "json", {"model_id": m.model_id, "type": "unload_model"})
            s = self.sessions.get(m.session_id)
            if s is not None:
                kind = m.model_id.split(":")[1]
                s.seqs.discard(f"{kind}:{m.model_id.split(':')[2]}")
                if m.model_id in s.models:
                    s.models.remove(m.model_id)

    def session_config(self, m: ModelRecord, model_dir: Path) -> SessionConfig:
        model: dict[str, Any] = {"path": str(model_dir)}
        if m.lora_rank is not None:
            alpha = self.cfg.lora_alpha if m.lora_alpha is None else m.lora_alpha  # (its own: `ModelRecord`)
            model["lora"] = {"r": m.lora_rank, "alpha": alpha, "target_modules": list(m.targets)}
        client = {"model_id": m.model_id, "session_id": m.session_id, "base_model": m.base_model,
                  "sampler_only": m.sampler_only}  # fmt: skip
        return SessionConfig.model_validate({
            "kind": "session", "name": job_of(m.model_id), "seed": m.seed, "run_dir": str(self.run_dir),
            "engine": self.cfg.engine, "model": model, "client": client,
        })  # fmt: skip

    def job_ready(self, job_id: str) -> None:
        """The backend's news: the job's state is on its service; the model's waiting futures complete."""
        with self.lock:
            m = self.by_job.get(job_id)
            if m is None:
                self._early.setdefault(job_id, []).append(("ready",))
                return
            if m.status != "opening":
                return
            m.status, m.reason = "open", ""
            waiting, m.waiting = m.waiting, []
        for rid, result in waiting:
            self.futures.complete(rid, "json", result)

    def job_ended(self, job_id: str, status: str, reason: str) -> None:
        """The backend's news: the job ended (or never started); the requests still waiting for it fail (its
        calls fail themselves)."""
        with self.lock:
            m = self.by_job.get(job_id)
            if m is None:
                self._early.setdefault(job_id, []).append(("ended", status, reason))
                return
            if m.status == "ended":
                return
            why = m.reason if m.status == "closing" else reason or status  # (unloaded: said so)
            m.status, m.reason = "ended", why + (f"; its state was saved at {m.saved}" if m.saved else "")
            m.ended_at = self.clock()
            waiting = [h[2] for h in m.held.values() if h is not None] + [rid for rid, _ in m.waiting]
            m.held.clear()
            m.waiting, unloads, m.unloads = [], m.unloads, []
        for rid in waiting:
            self.futures.fail(rid, f"the model's session job {status}: {reason}", "server")
        for rid in unloads:  # (the unload's answer: its job has ended)
            self.futures.complete(rid, "json", {"model_id": m.model_id, "type": "unload_model"})

    def waiting_reason(self, m: ModelRecord) -> str:
        return self.backend.reason(m.job_id) if m.job_id else "preparing the model"


__all__ = ["Backend", "Done", "Finish", "Refused", "Registry", "replying"]
