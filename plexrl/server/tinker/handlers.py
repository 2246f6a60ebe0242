"""What each request of the Tinker API does (`routes.py` calls these; the state they read and change is the
`Registry`'s). Every function checks the request completely before it passes anything on (`decode.Refused`
otherwise: nothing changed), and answers with what the SDK expects: an `UntypedAPIFuture`
(`{"request_id", "model_id"}`) for a call, a plain response for the rest."""

from __future__ import annotations

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
    checked_metadata,
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
    meta = checked_metadata(body.get("user_metadata"))
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
        fut = reg.futures.new(user, "create_model", "preparing the model", session=m.session_id)
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
        fut = reg.futures.new(m.user, "unload_model", session=m.session_id)
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


def limits_of(m: Any) -> dec.ModelLimits:
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
        with reg.turns.turn(m, wire.seq_id):
            call = dec.forward_backward(wire, limits_of(m), reg.cfg)
            return reg.turns.ordered(m, wire.seq_id, call, finish)


def optim_step(reg: Registry, user: str | None, body: dict[str, Any]) -> dict[str, Any]:
    with reg.lock:
        m = reg.model(user, body.get("model_id"))
        with reg.turns.turn(m, body.get("seq_id")):
            call = dec.optim_step(body.get("adam_params", body.get("optim_params", body.get("optimizer_params"))))
            return reg.turns.ordered(
                m, body.get("seq_id"), call, lambda v: ("json", {"metrics": v.get("metrics") or {}})
            )


def save_weights(reg: Registry, user: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """save_state: the model's state under a name (`tinker://<model>/weights/<name>`)."""
    with reg.lock:
        m = reg.model(user, body.get("model_id"))
        with reg.turns.turn(m, body.get("seq_id")):
            reg.check_writes(m.user)
            name = checked_name(body.get("path"), "the checkpoint name")
            target = file_of(reg.root, m.model_id, "weights", name)
            if target.exists() and not body.get("overwrite"):
                raise Refused(400, f"checkpoint {name!r} exists; pass overwrite=True or another name")
            facts = checkpoint_facts(body, time.time())
            answer = {"path": tinker_path(m.model_id, "weights", name), "type": "save_weights"}
            return reg.turns.ordered(m, body.get("seq_id"), Save(str(target), "state"),
                               _noting(reg, m.model_id, f"weights/{name}", facts, answer))  # fmt: skip


def save_for_sampler(reg: Registry, user: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """The model's trained weights for sampling: under a name (`tinker://<model>/sampler_weights/<name>`), or
    as an unnamed snapshot bound to a new sampling client (`save_weights_and_get_sampling_client`; the latest
    `KEEP_SNAPSHOTS` of a model are kept)."""
    with reg.lock:
        m = reg.model(user, body.get("model_id"))
        with reg.turns.turn(m, body.get("seq_id")):
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
                return reg.turns.ordered(m, body.get("seq_id"), Save(str(target), "sampler"),
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

            return reg.turns.ordered(m, body.get("seq_id"), Save(str(target), "sampler"), bind)


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
            with reg.turns.turn(m, body.get("seq_id")):  # (a refused path uses its turn like any refusal)
                _, _, found = source(reg, user, body.get("path"))
                answer = {"path": body["path"], "model_id": m.model_id, "type": "load_weights"}
                load = Load(str(found), bool(body.get("optimizer")))
                return reg.turns.ordered(m, body.get("seq_id"), load, lambda v: ("json", answer))
    _adamw_only(body)
    meta = checked_metadata(body.get("user_metadata"))
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
        fut = reg.futures.new(user, "load_weights", "preparing the model", session=m.session_id)
    answer = {"path": body["path"], "model_id": m.model_id, "type": "load_weights"}
    reg.open(m, (load, replying(reg.futures, fut.request_id, lambda v: ("json", answer))))
    return {"request_id": fut.request_id, "model_id": m.model_id}


__all__ = [
    "FULL_FINETUNE",
    "TARGETS",
    "create_model",
    "forward_backward",
    "get_info",
    "get_server_capabilities",
    "limits_of",
    "load_weights",
    "optim_step",
    "save_for_sampler",
    "save_weights",
    "source",
    "unload_model",
]
