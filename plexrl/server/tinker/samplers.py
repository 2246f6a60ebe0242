"""What the Tinker API's sampling requests do (`routes.py` calls these; the model requests: `handlers.py`): a
sampling client is made on a live model's sampler weights, on a job opened for it (a base model through a zero
adapter, or weights loaded from a path whose model ended), or on the job of its session's first client on the
same base; a sample is a call of the job that serves its client. Checked completely before anything is passed
on (`decode.Refused` otherwise: nothing changed)."""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path
from typing import Any

from plexrl.server.tinker import decode as dec
from plexrl.server.tinker import durable, proto
from plexrl.server.tinker.futures import replying
from plexrl.server.tinker.handlers import TARGETS, limits_of, source
from plexrl.server.tinker.records import KEEP_SNAPSHOTS, SamplerRecord, alpha_of, read_owner
from plexrl.server.tinker.registry import Refused, Registry
from plexrl.sessions.calls import Load


def create_sampler(reg: Registry, user: str, body: dict[str, Any]) -> dict[str, Any]:
    """A sampling client: on the live model that saved its weights (reading them from the file), or on a job
    opened for it (the base model through a zero adapter, or weights loaded from a path whose model ended).
    Every client of one session on one base model is served by the first one's job (one open model, however
    many such clients a loop makes)."""
    model_path, base = body.get("model_path"), body.get("base_model")
    seq = body.get("sampling_session_seq_id")
    load: Load | None = None
    owner: dict[str, Any] = {"lora_rank": 1, "targets": list(TARGETS["attn"])}  # a zero adapter: the base itself
    reg.check_writes(user)  # (every client writes its record, a new model its files: refused on a full disk)
    with reg.lock:
        s = reg.session(user, body.get("session_id"))
        if model_path is None:
            for other in (reg.models[m] for m in s.models if m in reg.models):
                mine = reg.samplers.get(other.model_id)
                if other.sampler_only and other.status in ("opening", "open") and other.base_model == str(base) and (
                    mine is not None and mine.model_path is None
                ):  # fmt: skip
                    return _served_by(reg, s, seq, other, None, None)
        if model_path is not None:
            src_model, kind, found = source(reg, user, model_path)
            live = reg.models.get(src_model)
            live = live if live is not None and live.status in ("opening", "open") else None  # (not ended, closing)
            if kind == "sampler_weights" and live is not None and live.user == user:
                return _served_by(reg, s, seq, live, model_path, found)
            owner = read_owner(reg.root, src_model) or {}
            base = base or owner.get("base_model")
            load = Load(str(found), False)
        m = reg.new_model(user, s.session_id, seq, base, kind="sample")
        m.lora_rank, m.targets = owner.get("lora_rank"), tuple(owner.get("targets") or ())
        m.lora_alpha = alpha_of(owner, reg.cfg.lora_alpha)
        if m.lora_rank is None and not reg.cfg.full_finetuning:
            raise Refused(400, "that checkpoint is a full fine-tune, which this server does not load")
        record = reg.samplers[m.model_id] = SamplerRecord(m.model_id, s.session_id, user, m.model_id, m.base_model,
                                                           model_path)  # fmt: skip

    def loaded(reply: dict[str, Any] | None, error: str | None) -> None:
        why = error if reply is None else reply.get("error")
        if why:
            record.broken = f"loading {model_path} failed: {why}"

    reg.open(m, None if load is None else (load, loaded))
    return {"type": "create_sampling_session", "sampling_session_id": m.model_id}


def _served_by(reg: Registry, s: Any, seq: Any, m: Any, model_path: str | None, found: Path | None) -> dict[str, Any]:
    """A sampling client of session `s` served by model `m`'s job (lock held), reading the sampler weights file
    `found` (None: the job's own weights); recorded so that it comes back after a restart with its model."""
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0 or f"sample:{seq}" in s.seqs:
        raise Refused(400, "create_sampling_session needs a new sampling_session_seq_id")
    s.seqs.add(f"sample:{seq}")
    sid = f"{s.session_id}:sample:{seq}"
    record = SamplerRecord(sid, s.session_id, m.user, m.model_id, m.base_model, model_path)
    if found is not None:
        record.weights, record.weights_id = found, weights_id(found)
    reg.samplers[sid] = record
    durable.keep_sampler(reg.root, record)
    return {"type": "create_sampling_session", "sampling_session_id": sid}


def get_sampler(reg: Registry, user: str | None, sampler_id: str) -> dict[str, Any]:
    with reg.lock:
        s = reg.sampler(user, sampler_id)
    return {"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path}


def asample(reg: Registry, user: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """One sample request of a sampling client: a call of the job that serves it, with the sampler's weights;
    its seed, when the request names none, a fresh random one (Tinker's; a request that names one samples the
    same tokens every time). A call still queued may be cancelled by its client (`Futures.cancel`)."""
    sid = body.get("sampling_session_id")
    if sid is None:
        raise Refused(400, "sample without a sampling client is not served; create_sampling_client first")
    seq = body.get("seq_id") or 0
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise Refused(400, "seq_id must be a non-negative integer")
    with reg.lock:
        s = reg.sampler(user, sid)
        if s.broken is not None:
            raise Refused(400, f"sampling session {sid}: {s.broken}")
        if s.weights is not None and not s.weights.is_file():
            why = f"its weights snapshot was dropped (a model keeps its latest {KEEP_SNAPSHOTS}); make a new one"
            raise Refused(
                400, f"sampling session {sid}: {why}; make a new one with save_weights_and_get_sampling_client"
            )
        m = reg.model(user, s.model_id)
        call = dec.sample(body, limits_of(m), reg.cfg, secrets.randbits(31))
        if s.weights is not None:
            call = dataclasses.replace(call, weights=str(s.weights), weights_id=s.weights_id)
        fut = reg.futures.new(m.user, "sample", session=s.session_id)
        job_id = m.job_id

    def finish(value: dict[str, Any]) -> tuple[str, Any]:
        return "proto", proto.encode_sample_response(value["sequences"], value.get("prompt_logprobs"),
                                                     value.get("topk_prompt_logprobs"))  # fmt: skip

    done = replying(reg.futures, fut.request_id, finish)
    fut.withdraw = lambda: reg.backend.withdraw(job_id, done)  # (`cancel_future`: while it is still queued)
    reg.backend.call(job_id, "sample", call, done)
    ids = [f"{sid}/{seq}/{i}" for i in range(call.num_samples)]
    return {"request_id": fut.request_id, "model_id": None, "sample_sequence_ids": ids}


def weights_id(path: Path) -> str | None:
    """The weights id a sampler file was saved with (its safetensors metadata)."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        meta = f.metadata() or {}
    return meta.get("weights_id")


__all__ = ["asample", "create_sampler", "get_sampler", "weights_id"]
