"""What the Tinker API keeps on disk so that a restarted `plexrl serve` knows its clients again:
- a session (`create_session`) is written as `<root>/clients/<session>.json` (its user) before its client hears of
  it, and removed when it ends (`forget`);
- a sampling client served by another client's live model (`save_weights_and_get_sampling_client`'s snapshot,
  `create_sampling_client` on a model's named sampler weights, or on a base model its session samples already)
  is written as `<root>/clients/<session>/<seq>.json` before its client hears of it, and removed with its session.
Its models are the journal's session jobs (`recover`, from the entries the controller resumes); a session with no
model yet has only its file. A sampler comes back when its session and its model both do."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plexrl.server.tinker.decode import model_limits
from plexrl.server.tinker.records import SESSION, ClientSession, ModelRecord, SamplerRecord
from plexrl.sessions.spec import SessionConfig

log = logging.getLogger(__name__)


def _file(root: Path, session_id: str) -> Path:
    return root / "clients" / f"{session_id}.json"


def _write(path: Path, value: dict[str, Any]) -> None:
    """Write `value` as JSON atomically (a crash leaves the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def keep(root: Path, session_id: str, user: str) -> None:
    """Record an open session of `user` (atomically)."""
    _write(_file(root, session_id), {"user": user})


def forget(root: Path, session_id: str) -> None:
    """The session ended: a restart does not bring it (or its samplers) back."""
    _file(root, session_id).unlink(missing_ok=True)
    shutil.rmtree(root / "clients" / session_id, ignore_errors=True)


def drop_sampler(root: Path, session_id: str, seq: str) -> None:
    """A sampling client whose snapshot was dropped (a model keeps its latest few) is not brought back."""
    (root / "clients" / session_id / f"{seq}.json").unlink(missing_ok=True)


def kept(root: Path) -> list[tuple[str, str]]:
    """The (session id, user) of every session recorded and not ended; unreadable records are skipped, logged."""
    out: list[tuple[str, str]] = []
    for path in sorted((root / "clients").glob("*.json")):
        try:
            user = json.loads(path.read_text())["user"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("session record %s cannot be read (%s); skipped", path, exc)
            continue
        if SESSION.fullmatch(path.stem) and isinstance(user, str):
            out.append((path.stem, user))
    return out


def keep_sampler(root: Path, r: SamplerRecord) -> None:
    """Record a sampling client served by its live model `r.model_id`'s job, reading `r.weights` (None: that
    job's own weights: a client on a base model the session samples already), atomically."""
    seq = r.sampler_id.rsplit(":", 1)[1]
    _write(root / "clients" / r.session_id / f"{seq}.json", {
        "sampler_id": r.sampler_id, "user": r.user, "model_id": r.model_id, "base_model": r.base_model,
        "model_path": r.model_path, "weights": None if r.weights is None else str(r.weights),
        "weights_id": r.weights_id,
    })  # fmt: skip


def kept_samplers(root: Path, session_id: str, user: str) -> list[SamplerRecord]:
    """The sampling clients recorded for an open session of `user`, in seq order; unreadable ones skipped."""
    out: list[tuple[int, SamplerRecord]] = []
    for path in (root / "clients" / session_id).glob("*.json"):
        try:
            v = json.loads(path.read_text())
            weights = None if v["weights"] is None else Path(v["weights"])  # (None: its model's own weights)
            r = SamplerRecord(v["sampler_id"], session_id, v["user"], v["model_id"], v["base_model"], v["model_path"],
                              weights, v["weights_id"])  # fmt: skip
            seq = int(path.stem)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("sampler record %s cannot be read (%s); skipped", path, exc)
            continue
        if r.user == user and r.sampler_id == f"{session_id}:sample:{seq}":
            out.append((seq, r))
    return [r for _, r in sorted(out, key=lambda x: x[0])]


def recover(
    root: Path, entries: Sequence[Any], now: float
) -> tuple[dict[str, ClientSession], dict[str, ModelRecord], dict[str, SamplerRecord]]:
    """At a server start: the sessions recorded open, the models of the journal's unfinished session jobs
    (`entries`, their numbering going on from what the client sends next) and the samplers recorded for both."""
    sessions = {sid: ClientSession(sid, user, now) for sid, user in kept(root)}
    models: dict[str, ModelRecord] = {}
    samplers: dict[str, SamplerRecord] = {}
    for e in entries:
        cfg = SessionConfig.model_validate(e.config)
        client = cfg.client
        sid, model_id = str(client.get("session_id", "")), str(client.get("model_id", ""))
        if not sid or not model_id:
            continue
        s = sessions.setdefault(sid, ClientSession(sid, e.user, now))
        s.models.append(model_id)
        s.seqs.add(":".join(model_id.split(":")[1:]))  # ("train:3")
        lora = cfg.model.lora
        m = ModelRecord(model_id, e.job_id, sid, e.user, str(client.get("base_model", "")), seed=cfg.seed)
        m.model_dir = Path(cfg.model.path) if cfg.model.path else None
        m.lora_rank, m.targets = (lora.r, tuple(lora.target_modules)) if lora is not None else (None, ())
        m.lora_alpha = lora.alpha if lora is not None else None  # (its job's, whatever the server's is now)
        m.limits = model_limits(m.model_dir) if m.model_dir is not None else None
        m.next_seq, m.sampler_only = None, bool(client.get("sampler_only"))
        models[model_id] = m
        if m.sampler_only:
            samplers[model_id] = SamplerRecord(model_id, sid, e.user, model_id, m.base_model)
        log.info("session model %s (job %s of %r) recovered from the journal", model_id, e.job_id, e.user)
    for s in sessions.values():
        for r in kept_samplers(root, s.session_id, s.user):
            live = models.get(r.model_id)
            if live is None or live.user != r.user:  # (its model ended: the sampler ended with it)
                continue
            samplers[r.sampler_id] = r
            s.seqs.add(r.sampler_id.split(":", 1)[1])  # ("sample:2")
            if r.weights is not None and r.weights.parent.name == "snapshots":
                live.snapshots.append(r.weights)  # (oldest first: the latest KEEP_SNAPSHOTS stay)
            log.info("sampling client %s of %r recovered (weights %s)", r.sampler_id, r.user, r.weights)
    return sessions, models, samplers


__all__ = ["drop_sampler", "forget", "keep", "keep_sampler", "kept", "kept_samplers", "recover"]
