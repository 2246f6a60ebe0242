"""`Registry`: the state behind the Tinker API (`routes.py`) and what each request does, between the client and
the session jobs. A training client is ONE session job (`plexrl.sessions`); each of its calls, and each sample of a
sampling client, becomes a call of a job (`Backend.call`), run as a node the planner places and orders among
every other job's nodes. Replies complete the request's future (`futures.py`), which the client polls.

Who may see what: every session, model, sampler, saved path and future belongs to the user whose key created
it; another user's gets the answer of one that does not exist (404), so ids do not leak. The administrator
(`user` None) reaches everything.

Order: a training client's requests carry consecutive `seq_id`s; they are passed on in that order (one that
comes early waits for those before it, a repeated one gets the first one's future). Calls of one job run in the
order passed on (`plexrl.runtime.calls`).

Refusals (`decode.Refused`): checked before anything is passed on, so a refused request changes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from plexrl.server.tinker import decode as dec
from plexrl.server.tinker import proto
from plexrl.server.tinker.config import TinkerConfig
from plexrl.server.tinker.futures import Futures
from plexrl.server.tinker.records import (
    KEEP_SNAPSHOTS,
    ClientSession,
    ModelRecord,
    SamplerRecord,
    checked_name,
    file_of,
    job_of,
    parse_path,
    read_owner,
    tinker_path,
    write_owner,
)
from plexrl.sessions.calls import Call, Load, Save
from plexrl.sessions.spec import SessionConfig

log = logging.getLogger(__name__)

Refused = dec.Refused
MAX_AHEAD = 1024  # a training request may come at most this many seq ids before its turn
TARGETS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
FULL_FINETUNE = "plexrl.full_finetune"  # user_metadata key: a full fine-tuning session (a PlexRL extension)


class Backend(Protocol):
    """How the registry reaches the runner: open a session job, pass it calls, close it."""

    def open(self, cfg: SessionConfig, user: str, ready: Callable[[], None], ended: Callable[[str, str], None]) -> None:
        """Prepare and submit the session job `cfg.name` (in the background; calls may be passed on at once and
        wait). `ready()` once its state is on its service, `ended(status, reason)` when it ends, also if it
        never started."""

    def call(
        self, job_id: str, kind: str, call: Call, done: Callable[[dict[str, Any] | None, str | None], None]
    ) -> None:
        """Pass a call on to the job (in the order of these calls)."""

    def close(self, job_id: str, checkpoint: bool) -> None:
        """No more calls: the job ends once its call in flight did; `checkpoint`: its state is saved first."""

    def reason(self, job_id: str) -> str:
        """What the job waits for, if anything (admission, a service), in words."""


class Registry:
    """See the module docstring. `root`: where sessions' files go; `roots`: where a model may be named by path;
    `models`: the server's pretrained names with their directory resolver (`pretrained_path`)."""

    def __init__(
        self,
        cfg: TinkerConfig,
        backend: Backend,
        root: Path,
        roots: list[Path],
        resolve_pretrained: Callable[[str], Path],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.backend, self.root, self.roots = cfg, backend, root, roots
        self.resolve_pretrained, self.clock = resolve_pretrained, clock
        self.futures = Futures()
        self._lock = threading.Lock()
        self.sessions: dict[str, ClientSession] = {}
        self.models: dict[str, ModelRecord] = {}
        self.samplers: dict[str, SamplerRecord] = {}
        self._by_job: dict[str, ModelRecord] = {}

    # -- ownership -------------------------------------------------------------------------------------
    def _session(self, user: str | None, session_id: Any, *, live: bool = True) -> ClientSession:
        s = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if s is None or (user is not None and s.user != user):
            raise Refused(404, f"no session {session_id!r}")
        if live and s.ended is not None:
            raise Refused(410, f"session {session_id} ended ({s.ended}); start a new ServiceClient")
        s.last_seen = self.clock()
        return s

    def _model(self, user: str | None, model_id: Any) -> ModelRecord:
        m = self.models.get(model_id) if isinstance(model_id, str) else None
        if m is None or (user is not None and m.user != user):
            raise Refused(404, f"no model {model_id!r}")
        if m.status == "ended":
            raise Refused(410, f"model {model_id} ended ({m.reason}); its saved weights stay loadable by path")
        self._session(user, m.session_id, live=False).last_seen = self.clock()
        return m

    def _sampler(self, user: str | None, sampler_id: Any) -> SamplerRecord:
        s = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if s is None or (user is not None and s.user != user):
            raise Refused(404, f"no sampling session {sampler_id!r}")
        return s

    # -- sessions --------------------------------------------------------------------------------------
    def create_session(self, user: str) -> dict[str, Any]:
        with self._lock:
            sid = "s" + secrets.token_hex(8)
            self.sessions[sid] = ClientSession(sid, user, self.clock())
        return {"type": "create_session", "session_id": sid, "info_message": f"PlexRL session {sid} (user {user!r})"}

    def heartbeat(self, user: str | None, session_id: Any) -> dict[str, Any]:
        with self._lock:
            self._session(user, session_id)
        return {"type": "session_heartbeat"}

    def finish(self, user: str | None, session_id: Any, reason: str, checkpoint: bool = False) -> None:
        """End a session: its models' and samplers' jobs close (checkpointed first with `checkpoint`)."""
        with self._lock:
            s = self._session(user, session_id, live=False)
            if s.ended is not None:
                return
            s.ended = reason
            jobs = [self.models[m].job_id for m in s.models if self.models[m].status != "ended"]
        for job_id in jobs:
            self.backend.close(job_id, checkpoint)

    def sweep(self) -> list[str]:
        """End the sessions whose client sent nothing for `session_timeout_s`, checkpointing their models;
        returns their ids."""
        now = self.clock()
        with self._lock:
            stale = [
                s for s in self.sessions.values() if s.ended is None and now - s.last_seen > self.cfg.session_timeout_s
            ]
        for s in stale:
            log.warning("session %s of %r: no call or heartbeat for %.0f s; ending it, its state checkpointed",
                        s.session_id, s.user, now - s.last_seen)  # fmt: skip
            self.finish(None, s.session_id, f"no call or heartbeat for {self.cfg.session_timeout_s:.0f} s", True)
        return [s.session_id for s in stale]

    # -- models ----------------------------------------------------------------------------------------
    def _base_dir(self, name: Any) -> Path:
        """The directory of a base model named by pretrained short name or by path under the allowed roots
        (one answer for a path outside them, whether it exists or not)."""
        if not isinstance(name, str) or not name or len(name) > 4096:
            raise Refused(400, "base_model must be a model name")
        if name in self.cfg.models:
            return self.resolve_pretrained(name)
        served = ", ".join(self.cfg.models) or "none by name"
        if "/" in name:
            path = Path(name).resolve()
            if any(path.is_relative_to(r) for r in self.roots) and (path / "config.json").is_file():
                return path
        raise Refused(400, f"unknown base_model {name!r}: this server trains {served}, or a model directory under "
                           f"its allowed roots ({', '.join(str(r) for r in self.roots)})")  # fmt: skip

    def _new_model(self, user: str, session_id: Any, seq: Any, base_model: Any, kind: str = "train") -> ModelRecord:
        """Record a model of a session (lock held): its ids, after the checks that need no model file."""
        s = self._session(user, session_id)
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 10**9:
            raise Refused(400, f"{kind} seq id must be an integer in [0, 1e9)")
        if f"{kind}:{seq}" in s.seqs:
            raise Refused(400, f"session {s.session_id} already has {kind} client {seq}")
        mine = sum(1 for m in self.models.values() if m.user == user and m.status != "ended")
        if mine >= self.cfg.max_sessions_per_user:
            raise Refused(400, f"user {user!r} has {mine} open models, the server's max_sessions_per_user; "
                               "close a ServiceClient first")  # fmt: skip
        self._base_dir_name_check(base_model)
        model_id = f"{s.session_id}:{kind}:{seq}"
        m = ModelRecord(model_id, job_of(model_id), s.session_id, user, str(base_model), seed=seq)
        s.seqs.add(f"{kind}:{seq}")
        s.models.append(model_id)
        self.models[model_id] = m
        self._by_job[m.job_id] = m
        return m

    def _base_dir_name_check(self, name: Any) -> None:
        """The cheap part of `_base_dir` (no conversion): a served name, or a path under the roots."""
        if isinstance(name, str) and name in self.cfg.models:
            return
        self._base_dir(name)

    def create_model(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """A LoRA (or, by metadata, full) training client: its session job is prepared and submitted; the future
        completes once its state is on a service."""
        lora = body.get("lora_config")
        meta = body.get("user_metadata") or {}
        full = isinstance(meta, dict) and str(meta.get(FULL_FINETUNE, "")).lower() == "true"
        optimizer = body.get("optimizer_config") or {}
        if isinstance(optimizer, dict) and optimizer.get("type", "adamw") != "adamw":
            raise Refused(400, "PlexRL serves the AdamW optimizer only (optimizer_config type 'adamw')")
        if full and not self.cfg.full_finetuning:
            raise Refused(400, "this server does not allow full fine-tuning sessions (tinker.full_finetuning: false)")
        rank: int | None = None
        targets: tuple[str, ...] = ()
        if not full:
            if not isinstance(lora, dict):
                raise Refused(
                    400, "create_model needs a lora_config (or user_metadata {'plexrl.full_finetune': 'true'})"
                )
            rank = lora.get("rank")
            if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= self.cfg.max_lora_rank:
                raise Refused(400, f"LoRA rank must be 1..{self.cfg.max_lora_rank} on this server")
            targets = _targets(lora)
        with self._lock:
            m = self._new_model(user, body.get("session_id"), body.get("model_seq_id"), body.get("base_model"))
            m.lora_rank, m.targets = rank, targets
            if isinstance(lora, dict) and isinstance(lora.get("seed"), int):
                m.seed = int(lora["seed"]) & 0x7FFFFFFF
            fut = self.futures.new(user, "create_model", "preparing the model")
            m.waiting.append(fut.request_id)
        answer = {"model_id": m.model_id, "type": "create_model"}
        self._open(m, lambda: self.futures.complete(fut.request_id, "json", answer))
        return {"request_id": fut.request_id, "model_id": m.model_id}

    def _open(self, m: ModelRecord, on_ready: Callable[[], None], first: tuple[Call, Any] | None = None) -> None:
        """Prepare (find the base model: a pretrained one converts on first use) and open the model's job in a
        thread; `first`: a call it runs before any other (a load) and its `done`."""

        def prepare() -> None:
            try:
                model_dir = self._base_dir(m.base_model)
                m.limits = _limits(model_dir)
                m.model_dir = model_dir
                write_owner(self.root, m)
                cfg = self._session_config(m, model_dir)
            except Exception as exc:
                self._ended(m, "failed", f"preparing the model failed: {type(exc).__name__}: {exc}")
                return

            def ready() -> None:
                with self._lock:
                    if m.status == "opening":
                        m.status, m.reason, m.waiting = "open", "", []
                on_ready()

            self.backend.open(cfg, m.user, ready, lambda status, reason: self._ended(m, status, reason))
            if first is not None:
                self.backend.call(m.job_id, first[0].kind, first[0], first[1])

        threading.Thread(target=prepare, name=f"tinker-open-{m.job_id}", daemon=True).start()

    def _session_config(self, m: ModelRecord, model_dir: Path) -> SessionConfig:
        model: dict[str, Any] = {"path": str(model_dir)}
        if m.lora_rank is not None:
            model["lora"] = {"r": m.lora_rank, "alpha": self.cfg.lora_alpha, "target_modules": list(m.targets)}
        return SessionConfig(
            kind="session", name=m.job_id, seed=m.seed, run_dir=str(self.root.parent), engine=self.cfg.engine,  # type: ignore[arg-type]
            model=model,  # type: ignore[arg-type]
            client={"model_id": m.model_id, "session_id": m.session_id, "base_model": m.base_model},
        )  # fmt: skip

    def _ended(self, m: ModelRecord, status: str, reason: str) -> None:
        """The model's job ended (or could not start): its waiting requests fail (the backend's calls fail
        themselves)."""
        with self._lock:
            if m.status == "ended":
                return
            m.status, m.reason = "ended", reason or status
            waiting = [rid for _, _, rid, _ in m.held.values()] + m.waiting
            m.held.clear()
            m.waiting = []
        for rid in waiting:
            self.futures.fail(rid, f"the model's session {status}: {reason}", "server")

    def get_info(self, user: str | None, model_id: Any) -> dict[str, Any]:
        with self._lock:
            m = self._model(user, model_id)
        tok = str(m.model_dir) if m.model_dir is not None else None
        data = {"arch": "llama", "model_name": m.base_model, "tokenizer_id": tok}
        return {"type": "get_info", "model_id": m.model_id, "model_name": m.base_model,
                "is_lora": m.lora_rank is not None, "lora_rank": m.lora_rank, "model_data": data}  # fmt: skip

    # -- training calls --------------------------------------------------------------------------------
    def _ordered(self, m: ModelRecord, seq: Any, kind: str, call: Call, finish: Finish) -> dict[str, Any]:
        """Pass a training request on in seq-id order (lock held); its future's answer."""
        if seq is None:
            seq = m.next_seq if m.next_seq is not None else 0
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise Refused(400, "seq_id must be a non-negative integer")
        if m.next_seq is None:
            m.next_seq = seq  # (a model resumed after a restart: its client's numbering goes on)
        if seq in m.seen:
            return {"request_id": m.seen[seq], "model_id": m.model_id}
        if seq < m.next_seq or seq > m.next_seq + MAX_AHEAD:
            raise Refused(400, f"seq_id {seq} is out of order (the next is {m.next_seq})")
        fut = self.futures.new(m.user, kind)
        m.seen[seq] = fut.request_id
        if len(m.seen) > 4 * MAX_AHEAD:
            for old in sorted(m.seen)[: len(m.seen) - 2 * MAX_AHEAD]:
                del m.seen[old]
        m.held[seq] = (kind, call, fut.request_id, finish)
        while m.next_seq in m.held:
            k, c, rid, fin = m.held.pop(m.next_seq)
            self.backend.call(m.job_id, k, c, _replying(self.futures, rid, fin))
            m.next_seq += 1
        return {"request_id": fut.request_id, "model_id": m.model_id}

    def forward_backward(self, user: str | None, wire: proto.WireForwardBackward) -> dict[str, Any]:
        with self._lock:
            m = self._model(user, wire.model_id)
            limits = self._limits_of(m)
            call = dec.forward_backward(wire, limits, self.cfg)

            def finish(value: dict[str, Any]) -> tuple[str, Any]:
                return "proto", proto.encode_forward_backward_output(value["outputs"], value["metrics"])

            return self._ordered(m, wire.seq_id, call.kind, call, finish)

    def optim_step(self, user: str | None, body: dict[str, Any]) -> dict[str, Any]:
        params = body.get("adam_params", body.get("optim_params", body.get("optimizer_params")))
        call = dec.optim_step(params)
        with self._lock:
            m = self._model(user, body.get("model_id"))
            return self._ordered(m, body.get("seq_id"), call.kind, call,
                                 lambda v: ("json", {"metrics": v.get("metrics") or {}}))  # fmt: skip

    def save_weights(self, user: str | None, body: dict[str, Any]) -> dict[str, Any]:
        """save_state: the model's state under a name (`tinker://<model>/weights/<name>`)."""
        name = checked_name(body.get("path"), "the checkpoint name")
        with self._lock:
            m = self._model(user, body.get("model_id"))
            target = file_of(self.root, m.model_id, "weights", name)
            if target.exists() and not body.get("overwrite"):
                raise Refused(400, f"checkpoint {name!r} exists; pass overwrite=True or another name")
            path = tinker_path(m.model_id, "weights", name)
            return self._ordered(m, body.get("seq_id"), "save", Save(str(target), "state"),
                                 lambda v: ("json", {"path": path, "type": "save_weights"}))  # fmt: skip

    def save_for_sampler(self, user: str | None, body: dict[str, Any]) -> dict[str, Any]:
        """The model's trained weights for sampling: under a name (`tinker://<model>/sampler_weights/<name>`), or
        as an unnamed snapshot bound to a new sampling client (`save_weights_and_get_sampling_client`)."""
        if body.get("kind", "snapshot") != "snapshot":
            raise Refused(400, "inflight sampling clients are not served by PlexRL; use kind='snapshot'")
        with self._lock:
            m = self._model(user, body.get("model_id"))
            name = body.get("path")
            if name is not None:
                target = file_of(self.root, m.model_id, "sampler_weights", checked_name(name, "the sampler name"))
                answer = {"path": tinker_path(m.model_id, "sampler_weights", name), "type": "save_weights_for_sampler"}
                return self._ordered(m, body.get("seq_id"), "save", Save(str(target), "sampler"),
                                     lambda v: ("json", answer))  # fmt: skip
            s = self._session(user, m.session_id)
            seq = body.get("sampling_session_seq_id")
            if not isinstance(seq, int) or isinstance(seq, bool) or f"sample:{seq}" in s.seqs:
                raise Refused(400, "save_weights_for_sampler needs a new sampling_session_seq_id (or a path)")
            s.seqs.add(f"sample:{seq}")
            sampler_id = f"{s.session_id}:sample:{seq}"
            snapshot = f"{len(m.snapshots)}-{secrets.token_hex(4)}.safetensors"
            target = self.root / m.job_id / "snapshots" / snapshot

            def bind(value: dict[str, Any]) -> tuple[str, Any]:
                with self._lock:
                    record = SamplerRecord(sampler_id, s.session_id, m.user, m.model_id, m.base_model)
                    record.weights, record.weights_id = target, value["weights_id"]
                    self.samplers[sampler_id] = record
                    m.snapshots.append(target)
                    for old in m.snapshots[:-KEEP_SNAPSHOTS]:
                        old.unlink(missing_ok=True)
                    m.snapshots = m.snapshots[-KEEP_SNAPSHOTS:]
                return "json", {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

            return self._ordered(m, body.get("seq_id"), "save", Save(str(target), "sampler"), bind)

    def load_weights(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """A client made from saved weights (`create_training_client_from_state[_with_optimizer]`): a new model
        whose first call loads them; or (legacy `load_state`) a load on an existing model."""
        src_model, kind, name = parse_path(body.get("path"))
        source = self._source(user, src_model, kind, name)
        optimizer = bool(body.get("optimizer"))
        if body.get("model_id") is not None:
            with self._lock:
                m = self._model(user, body.get("model_id"))
                load = Load(str(source), optimizer)
                return self._ordered(m, body.get("seq_id"), "load", load, lambda v: ("json", {
                    "path": body["path"], "model_id": m.model_id, "type": "load_weights"}))  # fmt: skip
        owner = read_owner(self.root, src_model) or {}
        base = body.get("base_model") or owner.get("base_model")
        with self._lock:
            m = self._new_model(user, body.get("session_id"), body.get("model_seq_id"), base)
            m.lora_rank, m.targets = owner.get("lora_rank"), tuple(owner.get("targets") or ())
            fut = self.futures.new(user, "load_weights", "preparing the model")
            m.waiting.append(fut.request_id)
        answer = {"path": body["path"], "model_id": m.model_id, "type": "load_weights"}
        loaded = _replying(self.futures, fut.request_id, lambda v: ("json", answer))
        self._open(m, lambda: None, (Load(str(source), optimizer), loaded))
        return {"request_id": fut.request_id, "model_id": m.model_id}

    def _source(self, user: str | None, model_id: str, kind: str, name: str) -> Path:
        """The file of a saved path the user may read (404 otherwise, whether it exists or not)."""
        owner = read_owner(self.root, model_id)
        path = file_of(self.root, model_id, kind, name)
        if owner is None or (user is not None and owner.get("user") != user) or not path.is_file():
            raise Refused(404, f"no saved weights tinker://{model_id}/{kind}/{name}")
        return path

    # -- sampling --------------------------------------------------------------------------------------
    def create_sampler(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """A sampling client: on the live model that saved its weights (reading them from the file), or on a job
        opened for it (the base model, or weights loaded from a path whose model ended)."""
        model_path, base = body.get("model_path"), body.get("base_model")
        seq = body.get("sampling_session_seq_id")
        with self._lock:
            s = self._session(user, body.get("session_id"))
            if model_path is not None:
                src_model, kind, name = parse_path(model_path)
                source = self._source(user, src_model, kind, name)
                live = self.models.get(src_model)
                if kind == "sampler_weights" and live is not None and live.status != "ended" and live.user == user:
                    if not isinstance(seq, int) or isinstance(seq, bool) or f"sample:{seq}" in s.seqs:
                        raise Refused(400, "create_sampling_session needs a new sampling_session_seq_id")
                    s.seqs.add(f"sample:{seq}")
                    sid = f"{s.session_id}:sample:{seq}"
                    self.samplers[sid] = SamplerRecord(sid, s.session_id, user, live.model_id, live.base_model,
                                                       model_path, source, _weights_id(source))  # fmt: skip
                    return {"type": "create_sampling_session", "sampling_session_id": sid}
                owner = read_owner(self.root, src_model) or {}
                base = base or owner.get("base_model")
                load: Load | None = Load(str(source), False)
            else:
                owner, load = {"lora_rank": 1, "targets": list(TARGETS["attn"])}, None  # a zero adapter: the base
            m = self._new_model(user, s.session_id, seq, base, kind="sample")
            m.lora_rank, m.targets, m.sampler_only = owner.get("lora_rank"), tuple(owner.get("targets") or ()), True
            if m.lora_rank is None and not self.cfg.full_finetuning:
                raise Refused(400, "that checkpoint is a full fine-tune, which this server does not load")
            sampler = self.samplers[m.model_id] = SamplerRecord(m.model_id, s.session_id, user, m.model_id,
                                                                m.base_model, model_path)  # fmt: skip

        def loaded(reply: dict[str, Any] | None, error: str | None) -> None:
            why = error if reply is None else reply.get("error")
            if why:
                sampler.broken = f"loading {model_path} failed: {why}"

        self._open(m, lambda: None, None if load is None else (load, loaded))
        return {"type": "create_sampling_session", "sampling_session_id": m.model_id}

    def get_sampler(self, user: str | None, sampler_id: str) -> dict[str, Any]:
        with self._lock:
            s = self._sampler(user, sampler_id)
        return {"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    def asample(self, user: str | None, body: dict[str, Any]) -> dict[str, Any]:
        sid = body.get("sampling_session_id")
        if sid is None:
            raise Refused(400, "sample without a sampling client is not served; create_sampling_client first")
        seq = body.get("seq_id") or 0
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise Refused(400, "seq_id must be a non-negative integer")
        with self._lock:
            s = self._sampler(user, sid)
            if s.broken is not None:
                raise Refused(400, f"sampling session {sid}: {s.broken}")
            m = self._model(user, s.model_id)
            call = dec.sample(body, self._limits_of(m), self.cfg, dec.sample_seed(m.seed, sid.rsplit(":", 1)[-1], seq))
            if s.weights is not None:
                call = _with_weights(call, str(s.weights), s.weights_id)
            fut = self.futures.new(m.user, "sample")

        def finish(value: dict[str, Any]) -> tuple[str, Any]:
            return "proto", proto.encode_sample_response(value["sequences"], value.get("prompt_logprobs"))

        self.backend.call(m.job_id, "sample", call, _replying(self.futures, fut.request_id, finish))
        ids = [f"{sid}/{seq}/{i}" for i in range(call.num_samples)]
        return {"request_id": fut.request_id, "model_id": None, "sample_sequence_ids": ids}

    def _limits_of(self, m: ModelRecord) -> dec.ModelLimits:
        if m.limits is None:
            raise Refused(400, f"model {m.model_id} is still being prepared; wait for its client")
        return m.limits

    # -- futures ---------------------------------------------------------------------------------------
    def reason(self, fut: Any) -> str:
        return str(fut.reason)


Finish = Callable[[dict[str, Any]], tuple[str, Any]]
"""How a call's reply value becomes its future's result: ("json", a dict) or ("proto", bytes)."""


def _replying(futures: Futures, request_id: str, finish: Finish) -> Callable[..., None]:
    """The `done(reply, error)` of a call: the reply's value made the future's result (`finish`), a refusal on
    the service a user error, a call that did not run a server error."""

    def done(reply: dict[str, Any] | None, error: str | None) -> None:
        if reply is None:
            futures.fail(request_id, error or "the call did not run", "server")
        elif reply.get("error"):
            futures.fail(request_id, str(reply["error"]), "user")
        else:
            try:
                kind, payload = finish(reply.get("value") or {})
            except Exception as exc:  # a reply we cannot encode: the server's fault, said so
                log.exception("encoding the reply of request %s failed", request_id)
                futures.fail(request_id, f"encoding the reply failed: {type(exc).__name__}: {exc}", "server")
                return
            futures.complete(request_id, kind, payload)  # type: ignore[arg-type]

    return done


def _targets(lora: dict[str, Any]) -> tuple[str, ...]:
    out: list[str] = []
    if lora.get("train_attn", True):
        out += TARGETS["attn"]
    if lora.get("train_mlp", True):
        out += TARGETS["mlp"]
    if lora.get("train_unembed", True):
        out.append("lm_head")
    if not out:
        raise Refused(400, "a LoRA adapter needs at least one of train_attn, train_mlp, train_unembed")
    return tuple(out)


def _limits(model_dir: Path) -> dec.ModelLimits:
    cfg = json.loads((model_dir / "config.json").read_text())
    return dec.ModelLimits(int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings", 2048)))


def _weights_id(path: Path) -> str | None:
    """The weights id a sampler file was saved with (safetensors metadata)."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        meta = f.metadata() or {}
    return meta.get("weights_id")


def _with_weights(call: Any, path: str, weights_id: str | None) -> Any:
    return dataclasses.replace(call, weights=path, weights_id=weights_id)


__all__ = ["FULL_FINETUNE", "Backend", "Refused", "Registry"]
