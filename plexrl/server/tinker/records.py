"""What the Tinker API keeps of its clients: sessions (a client program: its heartbeat, its models and samplers),
models (a training client: ONE PlexRL session job, whose id is derived from the model's), samplers (a sampling
client: the weights it reads and the job whose service serves it), and where saved weights live on disk.

Names and paths:
- session `s<hex>`; model `<session>:train:<n>` (the id the SDK derives itself for a client created from a
  checkpoint) with job `<session>-train-<n>`; a job opened to serve a sampler `<session>-sample-<n>`;
- saved weights `tinker://<model>/weights/<name>` (a state: trained weights, optimizer, gradients) and
  `tinker://<model>/sampler_weights/<name>` (trained weights only), stored as
  `<root>/<job>/weights/<name>.pt` and `<root>/<job>/sampler_weights/<name>.safetensors`; a sampling client
  made by `save_weights_and_get_sampling_client` reads an unnamed snapshot `<root>/<job>/snapshots/<k>` (the
  latest `KEEP_SNAPSHOTS` of each model are kept);
- `<root>/<job>/owner.json`: who owns the job's files and what model they fit (base, rank, alpha, modules), so
  that a path stays usable after the model ended or the server restarted (on another `tinker.lora_alpha` too).
A name is `[A-Za-z0-9][A-Za-z0-9_.-]{0,63}` matched whole: nothing a client sends becomes a path otherwise.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plexrl.server.tinker.decode import ModelLimits, Refused

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SESSION = re.compile(r"s[0-9a-f]{16}")
DIGITS = re.compile(r"[0-9]{1,9}")
KEEP_SNAPSHOTS = 8
KINDS = {"weights": ("weights", ".pt"), "sampler_weights": ("sampler_weights", ".safetensors")}


@dataclass(slots=True)
class ClientSession:
    """A client program (`create_session`): alive while it heartbeats or calls."""

    session_id: str
    user: str
    last_seen: float
    ended: str | None = None  # why it ended (finished by its client, or timed out)
    models: list[str] = field(default_factory=list)  # model ids, its samplers' jobs included
    seqs: set[str] = field(default_factory=set)  # model and sampler sequence ids used ("train:3", "sample:0")


@dataclass(slots=True)
class ModelRecord:
    """A training client (or a job that only serves samplers): one session job."""

    model_id: str
    job_id: str  # the session job's id ("" until opened)
    session_id: str
    user: str
    base_model: str  # as the client named it
    model_dir: Path | None = None  # resolved once prepared
    lora_rank: int | None = None  # None: full fine-tuning
    lora_alpha: float | None = None  # its adapter's, fixed when it was created (None: the server's `lora_alpha`)
    targets: tuple[str, ...] = ()
    seed: int = 0
    metadata: dict[str, str] | None = None  # the client's `user_metadata` at creation (its training run shows it)
    limits: ModelLimits | None = None
    status: str = "opening"  # opening -> open -> ended; closing (unloaded by its client, its job ending) -> ended
    reason: str = ""  # why it ended (or is closing), or what it waits for
    next_seq: int | None = 1  # the next training request's seq id (None: adopt the first one seen)
    held: dict[int, Any] = field(default_factory=dict)  # seq id -> a request that came before its turn
    gap_since: float | None = None  # since when `held` waits for a seq id that has not come (`turn_wait_s`)
    ended_at: float | None = None  # when it ended (on the registry's clock): its record goes `FORGET_S` later
    seen: dict[int, str] = field(default_factory=dict)  # seq id -> request id (a retried request)
    snapshots: list[Path] = field(default_factory=list)  # unnamed sampler snapshots, oldest first
    sampler_only: bool = False
    saved: str | None = None  # where its state was saved as it ended (a session that timed out)
    # futures that complete (with their result) once its job is on its service; they fail if it ends first
    waiting: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    unloads: list[str] = field(default_factory=list)  # `unload_model` futures: they complete once its job ended


@dataclass(slots=True)
class SamplerRecord:
    """A sampling client: the job that serves it and the weights it reads (None: the job's live weights)."""

    sampler_id: str
    session_id: str
    user: str
    model_id: str
    base_model: str
    model_path: str | None = None
    weights: Path | None = None
    weights_id: str | None = None
    broken: str | None = None  # its weights could not be loaded: why


def job_of(model_id: str) -> str:
    """The job id of a model id (`s..:train:n` -> `s..-train-n`); Refused for anything else."""
    parts = model_id.split(":")
    if len(parts) != 3 or not SESSION.fullmatch(parts[0]) or parts[1] not in ("train", "sample"):
        raise Refused(404, f"no model {model_id!r}")
    if not DIGITS.fullmatch(parts[2]):  # (ASCII digits: str.isdigit() takes '²', which int() refuses)
        raise Refused(404, f"no model {model_id!r}")
    return f"{parts[0]}-{parts[1]}-{int(parts[2])}"


def checked_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise Refused(400, f"{what} must be a name of 1-64 characters [A-Za-z0-9_.-] starting with a letter or digit")
    return name


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def parse_path(path: Any) -> tuple[str, str, str]:
    """(model id, kind, name) of a `tinker://` path; Refused (400) for anything else."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise Refused(400, "a weights path must be tinker://<model id>/weights/<name> (or sampler_weights)")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise Refused(400, f"{path!r} is not tinker://<model id>/weights/<name> (or sampler_weights)")
    job_of(parts[0])
    return parts[0], parts[1], checked_name(parts[2], "the checkpoint name")


def file_of(root: Path, model_id: str, kind: str, name: str) -> Path:
    folder, suffix = KINDS[kind]
    return root / job_of(model_id) / folder / f"{name}{suffix}"


FORGET_S = 3600.0  # an ended model's record (its 410 answer) and its sampling clients' are kept this long


def forget_ended(models: dict[str, ModelRecord], samplers: dict[str, SamplerRecord], by_job: dict[str, ModelRecord],
                 live_sessions: set[str], now: float) -> None:  # fmt: skip
    """Drop the records of models that ended `FORGET_S` ago whose session is gone, and the sampling clients they
    served (a long-running server keeps no record of every client it ever had; their files stay, loadable by
    path). Call with the registry's lock held."""
    for m in [m for m in models.values() if m.ended_at is not None and now - m.ended_at > FORGET_S]:
        if m.session_id not in live_sessions:
            del models[m.model_id]
            by_job.pop(m.job_id, None)
    for k in [k for k, r in samplers.items() if r.model_id not in models]:
        del samplers[k]


def write_owner(root: Path, model: ModelRecord) -> None:
    folder = root / job_of(model.model_id)
    folder.mkdir(parents=True, exist_ok=True)
    facts = {"user": model.user, "model_id": model.model_id, "base_model": model.base_model,
             "lora_rank": model.lora_rank, "lora_alpha": model.lora_alpha, "targets": list(model.targets),
             "user_metadata": model.metadata}  # fmt: skip
    tmp = folder / ".owner.json.tmp"
    tmp.write_text(json.dumps(facts))
    tmp.replace(folder / "owner.json")


MAX_TTL_S = 10 * 365 * 86400
MAX_METADATA = 32  # entries of a checkpoint's user_metadata (keys up to 64 characters, values up to 512)


def checkpoint_facts(body: dict[str, Any], now: float) -> dict[str, Any]:
    """What a save request asks to keep with its checkpoint (`<root>/<job>/meta.json`, which the RestClient's
    routes read): `expires_at` from `ttl_seconds`, and `user_metadata`; Refused (400) for bad ones."""
    ttl = body.get("ttl_seconds")
    if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool) or not 1 <= ttl <= MAX_TTL_S):
        raise Refused(400, f"ttl_seconds must be 1..{MAX_TTL_S} (or null: no expiry)")
    meta = checked_metadata(body.get("user_metadata"))
    when = None if ttl is None else dt.datetime.fromtimestamp(now + ttl, dt.UTC).isoformat()
    return {"expires_at": when, "user_metadata": meta}


def checked_metadata(meta: Any) -> dict[str, str] | None:
    """A request's `user_metadata` (a save's, a new model's) as kept; Refused (400) for one out of bounds."""
    if meta is not None and (
        not isinstance(meta, dict) or len(meta) > MAX_METADATA
        or any(not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512 for k, v in meta.items())
    ):  # fmt: skip
        raise Refused(400, f"user_metadata must map at most {MAX_METADATA} strings (keys <= 64, values <= 512 "
                           "characters) to strings")  # fmt: skip
    return meta


def note_checkpoint(root: Path, model_id: str, checkpoint: str, facts: dict[str, Any]) -> None:
    """Keep `facts` of checkpoint `<kind>/<name>` of a model in its `meta.json` (replacing earlier ones)."""
    path = root / job_of(model_id) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        meta = {}
    meta[checkpoint] = facts
    tmp = path.with_name(".meta.json.tmp")
    tmp.write_text(json.dumps(meta))
    tmp.replace(path)


def alpha_of(owner: dict[str, Any], current: float) -> float | None:
    """The LoRA alpha of the weights `owner` (`read_owner`) describes: the one recorded with them, or `current`
    (the server's) for a record written before alphas were; None for a full fine-tune."""
    if owner.get("lora_rank") is None:
        return None
    alpha = owner.get("lora_alpha")
    return float(alpha) if isinstance(alpha, int | float) and not isinstance(alpha, bool) and alpha > 0 else current


def read_owner(root: Path, model_id: str) -> dict[str, Any] | None:
    """What `write_owner` wrote for a model's job (None: no such model's files)."""
    try:
        facts: dict[str, Any] = json.loads((root / job_of(model_id) / "owner.json").read_text())
        return facts
    except (OSError, ValueError, Refused):  # (Refused: not a model's folder, such as `clients`)
        return None


__all__ = [
    "FORGET_S",
    "KEEP_SNAPSHOTS",
    "ClientSession",
    "ModelRecord",
    "SamplerRecord",
    "alpha_of",
    "checked_metadata",
    "checked_name",
    "checkpoint_facts",
    "file_of",
    "forget_ended",
    "job_of",
    "note_checkpoint",
    "parse_path",
    "read_owner",
    "tinker_path",
    "write_owner",
]
