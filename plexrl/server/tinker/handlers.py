"""What each request of the Tinker API does (`routes.py` calls these; the state they read and change is the
`Registry`'s). Every function checks the request completely before it passes anything on (`decode.Refused`
otherwise: nothing changed), and answers with what the SDK expects: an `UntypedAPIFuture`
(`{"request_id", "model_id"}`) for a call, a plain response for the rest."""

from __future__ import annotations

import dataclasses
import secrets
import time
from pathlib import Path
from typing import Any

from plexrl.server.tinker import catalog, durable, proto
from plexrl.server.tinker import decode as dec
from plexrl.server.tinker.futures import replying
from plexrl.server.tinker.records import (
    KEEP_SNAPSHOTS,
    SamplerRecord,
    alpha_of,
    checked_name,
    checkpoint_facts,
    file_of,
    job_of,
    note_checkpoint,
    parse_path,
    read_owner,
    tinker_path,
)
from plexrl.server.tinker.registry import Refused, Registry
from plexrl.sessions.calls import Load, Save

TARGETS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
FULL_FINETUNE = "plexrl.full_finetune"  # user_metadata key: a full fine-tuning session (a PlexRL extension)


# -- models ------------------------------------------------------------------------------------------
def create_model(reg: Registry, user: str, body: dict[str, Any]) -> dict[str, Any]:
    """A LoRA (or, by metadata, full) training client: its session job is submitted; the future completes
    once its state is on a service."""
    cfg = reg.cfg
    lora = body.get("lora_config")
    meta = checkpoint_facts({"user_metadata": body.get("user_metadata")}, 0.0)["user_metadata"]  # (checked)
    full = meta is not None and str(meta.get(FULL_FINETUNE, "")).lower() == "true"
    _adamw_only(body)
    if full and not cfg.full_finetuning:
        raise Refused(400, "this server does not allow full fine-tuning sessions (tinker.full_finetuning: false)")
    rank: int | None = None
    targets: tuple[str, ...] = ()
    if not full:
        if not isinstance(lora, dict):
            raise Refused(400, f"create_model needs a lora_config (or user_metadata {{'{FULL_FINETUNE}': 'true'}})")
        rank = lora.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= cfg.max_lora_rank:
            raise Refused(400, f"LoRA rank must be 1..{cfg.max_lora_rank} on this server")
        targets = _targets(lora)
    reg.check_writes(user)
    with reg.lock:
        reg.futures.room(user)
        m = reg.new_model(user, body.get("session_id"), body.get("model_seq_id"), body.get("base_model"))
        m.lora_rank, m.targets, m.lora_alpha = rank, targets, None if full else cfg.lora_alpha  # (kept: owner.json)
        m.metadata = meta
        given = lora.get("seed") if isinstance(lora, dict) else None
        # Tinker's: no seed, a random one (recorded with the session's config: a resumed model keeps it)
        m.seed = given & 0x7FFFFFFF if isinstance(given, int) and not isinstance(given, bool) else secrets.randbits(31)
        fut = reg.futures.new(user, "create_model", "preparing the model")
        m.waiting.append((fut.request_id, {"model_id": m.model_id, "type": "create_model"}))
    try:
        reg.open(m)
    except Refused as exc:
        reg.futures.fail(fut.request_id, exc.message)
        raise
    reg.futures.set_reason(fut.request_id, reg.waiting_reason(m))
    return {"request_id": fut.request_id, "model_id": m.model_id}


def _adamw_only(body: dict[str, Any]) -> None:
    """Refuse an `optimizer_config` other than AdamW's (Tinker's default), which is all PlexRL serves."""
    optimizer = body.get("optimizer_config") or {}
    if not isinstance(optimizer, dict) or optimizer.get("type", "adamw") != "adamw":
        raise Refused(400, "PlexRL serves the AdamW optimizer only (optimizer_config type 'adamw')")


def get_info(reg: Registry, user: str | None, model_id: Any) -> dict[str, Any]:
    """The model's architecture (its config.json's model_type), the name it was created under, and the tokenizer
    id a client loads (`catalog.tokenizer_id`: the Hugging Face name where the model has one)."""
    with reg.lock:
        m = reg.model(user, model_id)
    arch = catalog.facts(m.model_dir).arch if m.model_dir is not None else None
    tokenizer = catalog.tokenizer_id(reg.cfg.models, m.base_model)
    data = {"arch": arch, "model_name": m.base_model, "tokenizer_id": tokenizer}
    return {"type": "get_info", "model_id": m.model_id, "model_name": m.base_model,
            "is_lora": m.lora_rank is not None, "lora_rank": m.lora_rank, "model_data": data}  # fmt: skip


def get_server_capabilities(reg: Registry) -> dict[str, Any]:
    """Every model the server serves by name (each of its names), with its context length."""
    return {"supported_models": catalog.supported(reg.cfg.models)}


def unload_model(reg: Registry, user: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """Tinker's `unload_model` (SDK 0.38 has no method that sends it): the model's session job closes as
    `Registry.finish` closes each model of a session: its call in flight (or announced) runs, calls still queued
    and requests held for their turn fail, and further calls get the ended model's 410. Its future completes once
    the job ended (`Registry.job_ended`); at once for a model that ended already. The other models of its
    session go on; its saved weights stay. 404 for an unknown model or another user's (a sampler with no job of
    its own, made by `save_weights_and_get_sampling_client` or served by its session's first client on its
    base model, is no model here)."""
    model_id = body.get("model_id")
    with reg.lock:
        m = reg.models.get(model_id) if isinstance(model_id, str) else None
        if m is None or (user is not None and m.user != user):
            raise Refused(404, f"no model {model_id!r}")
        fut = reg.futures.new(m.user, "unload_model")
        close = m.job_id if m.status in ("opening", "open") else ""  # ("": closed already, or `open` closes it)
        if m.status == "ended":
            reg.futures.complete(fut.request_id, "json", {"model_id": m.model_id, "type": "unload_model"})
        else:
            m.unloads.append(fut.request_id)
            m.status, m.reason = "closing", "unloaded by its client"
    if close:
        reg.backend.close(close)
    return {"request_id": fut.request_id, "model_id": m.model_id}


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


def _limits_of(m: Any) -> dec.ModelLimits:
    if m.limits is None:
        raise Refused(400, f"model {m.model_id} is still being prepared; wait for its client")
    limits: dec.ModelLimits = m.limits
    return limits


# -- training calls ----------------------------------------------------------------------------------
def forward_backward(reg: Registry, user: str | None, wire: proto.WireForwardBackward) -> dict[str, Any]:
    def finish(value: dict[str, Any]) -> tuple[str, Any]:
        return "proto", proto.encode_forward_backward_output(value["outputs"], value["metrics"])

    with reg.lock:
        m = reg.model(user, wire.model_id)
        with reg.turn(m, wire.seq_id):
            call = dec.forward_backward(wire, _limits_of(m), reg.cfg)
            return reg.ordered(m, wire.seq_id, call, finish)


def optim_step(reg: Registry, user: str | None, body: dict[str, Any]) -> dict[str, Any]:
    with reg.lock:
        m = reg.model(user, body.get("model_id"))
        with reg.turn(m, body.get("seq_id")):
            call = dec.optim_step(body.get("adam_params", body.get("optim_params", body.get("optimizer_params"))))
            return reg.ordered(m, body.get("seq_id"), call, lambda v: ("json", {"metrics": v.get("metrics") or {}}))


def save_weights(reg: Registry, user: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """save_state: the model's state under a name (`tinker://<model>/weights/<name>`)."""
    with reg.lock:
        m = reg.model(user, body.get("model_id"))
        with reg.turn(m, body.get("seq_id")):
            reg.check_writes(m.user)
            name = checked_name(body.get("path"), "the checkpoint name")
            target = file_of(reg.root, m.model_id, "weights", name)
            if target.exists() and not body.get("overwrite"):
                raise Refused(400, f"checkpoint {name!r} exists; pass overwrite=True or another name")
            facts = checkpoint_facts(body, time.time())
            answer = {"path": tinker_path(m.model_id, "weights", name), "type": "save_weights"}
            return reg.ordered(m, body.get("seq_id"), Save(str(target), "state"),
                               _noting(reg, m.model_id, f"weights/{name}", facts, answer))  # fmt: skip


def save_for_sampler(reg: Registry, user: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """The model's trained weights for sampling: under a name (`tinker://<model>/sampler_weights/<name>`), or
    as an unnamed snapshot bound to a new sampling client (`save_weights_and_get_sampling_client`; the latest
    `KEEP_SNAPSHOTS` of a model are kept)."""
    with reg.lock:
        m = reg.model(user, body.get("model_id"))
        with reg.turn(m, body.get("seq_id")):
            reg.check_writes(m.user)
            if body.get("kind", "snapshot") != "snapshot":
                raise Refused(400, "inflight sampling clients are not served by PlexRL; use kind='snapshot'")
            name = body.get("path")
            if name is not None:
                target = file_of(reg.root, m.model_id, "sampler_weights", checked_name(name, "the sampler name"))
                if target.exists():  # (the SDK has no overwrite for sampler weights: a name is used once)
                    raise Refused(400, f"sampler weights {name!r} exist; save under another name (or delete them "
                                       "first: RestClient.delete_checkpoint_from_tinker_path)")  # fmt: skip
                facts = checkpoint_facts(body, time.time())
                answer = {"path": tinker_path(m.model_id, "sampler_weights", name), "type": "save_weights_for_sampler"}
                return reg.ordered(m, body.get("seq_id"), Save(str(target), "sampler"),
                                   _noting(reg, m.model_id, f"sampler_weights/{name}", facts, answer))  # fmt: skip
            s = reg.session(user, m.session_id)
            seq = body.get("sampling_session_seq_id")
            if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0 or f"sample:{seq}" in s.seqs:
                raise Refused(400, "save_weights_for_sampler needs a new sampling_session_seq_id (or a path)")
            s.seqs.add(f"sample:{seq}")
            sampler_id = f"{s.session_id}:sample:{seq}"
            target = reg.root / job_of(m.model_id) / "snapshots" / f"{seq}-{secrets.token_hex(4)}.safetensors"

            def bind(value: dict[str, Any]) -> tuple[str, Any]:
                with reg.lock:
                    record = SamplerRecord(sampler_id, s.session_id, m.user, m.model_id, m.base_model)
                    record.weights, record.weights_id = target, value["weights_id"]
                    reg.samplers[sampler_id] = record
                    durable.keep_sampler(reg.root, record)  # (before its client hears of it: a restart knows it)
                    m.snapshots.append(target)
                    for old in m.snapshots[:-KEEP_SNAPSHOTS]:  # (named `<seq>-<hex>`: its client's seq id)
                        old.unlink(missing_ok=True)
                        durable.drop_sampler(reg.root, s.session_id, old.name.split("-")[0])
                    m.snapshots = m.snapshots[-KEEP_SNAPSHOTS:]
                return "json", {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

            return reg.ordered(m, body.get("seq_id"), Save(str(target), "sampler"), bind)


def _noting(reg: Registry, model_id: str, checkpoint: str, facts: dict[str, Any], answer: dict[str, Any]) -> Any:
    """A save's `finish`: once its file is written, its ttl and metadata are kept with it (`note_checkpoint`)."""

    def finish(value: dict[str, Any]) -> tuple[str, Any]:
        with reg.lock:
            note_checkpoint(reg.root, model_id, checkpoint, facts)
        return "json", answer

    return finish


def source(reg: Registry, user: str | None, path: Any) -> tuple[str, str, Path]:
    """(model id, kind, file) of a saved `tinker://` path the user may read (404 otherwise, whether it exists or
    not: another user's paths do not leak)."""
    model_id, kind, name = parse_path(path)
    owner = read_owner(reg.root, model_id)
    found = file_of(reg.root, model_id, kind, name)
    if owner is None or (user is not None and owner.get("user") != user) or not found.is_file():
        raise Refused(404, f"no saved weights {path}")
    return model_id, kind, found


def load_weights(reg: Registry, user: str, body: dict[str, Any]) -> dict[str, Any]:
    """A client made from saved weights (`create_training_client_from_state[_with_optimizer]`): a new model
    whose first call loads them; or (legacy `load_state`) a load on an existing model."""
    if body.get("model_id") is not None:
        with reg.lock:
            m = reg.model(user, body.get("model_id"))
            with reg.turn(m, body.get("seq_id")):  # (a refused path uses its turn like any refusal)
                _, _, found = source(reg, user, body.get("path"))
                answer = {"path": body["path"], "model_id": m.model_id, "type": "load_weights"}
                load = Load(str(found), bool(body.get("optimizer")))
                return reg.ordered(m, body.get("seq_id"), load, lambda v: ("json", answer))
    _adamw_only(body)
    meta = checkpoint_facts({"user_metadata": body.get("user_metadata")}, 0.0)["user_metadata"]  # (checked)
    src_model, _, found = source(reg, user, body.get("path"))
    load = Load(str(found), bool(body.get("optimizer")))
    owner = read_owner(reg.root, src_model) or {}
    reg.check_writes(user)  # (a new model: refused on a full disk, as `create_model`)
    with reg.lock:
        reg.futures.room(user)
        m = reg.new_model(user, body.get("session_id"), body.get("model_seq_id"),
                          body.get("base_model") or owner.get("base_model"))  # fmt: skip
        m.metadata = meta
        m.lora_rank, m.targets = owner.get("lora_rank"), tuple(owner.get("targets") or ())
        m.lora_alpha = alpha_of(owner, reg.cfg.lora_alpha)  # (the weights' own, whatever this server's is now)
        fut = reg.futures.new(user, "load_weights", "preparing the model")
    answer = {"path": body["path"], "model_id": m.model_id, "type": "load_weights"}
    reg.open(m, (load, replying(reg.futures, fut.request_id, lambda v: ("json", answer))))
    return {"request_id": fut.request_id, "model_id": m.model_id}


# -- sampling ----------------------------------------------------------------------------------------
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
        record.weights, record.weights_id = found, _weights_id(found)
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
        call = dec.sample(body, _limits_of(m), reg.cfg, secrets.randbits(31))
        if s.weights is not None:
            call = dataclasses.replace(call, weights=str(s.weights), weights_id=s.weights_id)
        fut = reg.futures.new(m.user, "sample")
        job_id = m.job_id

    def finish(value: dict[str, Any]) -> tuple[str, Any]:
        return "proto", proto.encode_sample_response(value["sequences"], value.get("prompt_logprobs"),
                                                     value.get("topk_prompt_logprobs"))  # fmt: skip

    done = replying(reg.futures, fut.request_id, finish)
    fut.withdraw = lambda: reg.backend.withdraw(job_id, done)  # (`cancel_future`: while it is still queued)
    reg.backend.call(job_id, "sample", call, done)
    ids = [f"{sid}/{seq}/{i}" for i in range(call.num_samples)]
    return {"request_id": fut.request_id, "model_id": None, "sample_sequence_ids": ids}


def _weights_id(path: Path) -> str | None:
    """The weights id a sampler file was saved with (its safetensors metadata)."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        meta = f.metadata() or {}
    return meta.get("weights_id")


__all__ = [
    "FULL_FINETUNE",
    "asample",
    "create_model",
    "create_sampler",
    "forward_backward",
    "get_info",
    "get_sampler",
    "get_server_capabilities",
    "load_weights",
    "optim_step",
    "save_for_sampler",
    "save_weights",
    "source",
    "unload_model",
]
