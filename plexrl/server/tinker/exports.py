"""External weights: `TrainingClient.save_weights_external(name, ttl_seconds, age_encryption_recipients)` writes
a model's trained weights as files a user loads without PlexRL, and `RestClient.get_external_weights_urls` signs
a download URL per file (the cookbook's `weights.download` uses both; `rest.py` serves the URLs and the files).

What an export holds (`<root>/<job>/external_weights/<name>/`, `tinker://<model>/external_weights/<name>`):
- a LoRA session: a PEFT adapter, `adapter_config.json` (r, lora_alpha = the session's: `tinker.lora_alpha` when
  it was created, target_modules, base_model_name_or_path = the base as its client named it) and
  `adapter_model.safetensors` under peft's key names (`base_model.model.<module>.lora_A.weight`):
  `peft.PeftModel.from_pretrained(base, dir)` loads it;
- a full-parameter session: a Hugging Face model directory, `model.safetensors` (every trained weight, float32,
  a tied output head left to its config) beside the base's `config.json` (its dtype set to float32),
  `generation_config.json` and tokenizer files: `AutoModelForCausalLM.from_pretrained(dir)` loads it.
With recipients (at most `MAX_RECIPIENTS` `age1...` or SSH public keys) every file is age-encrypted to them and
kept only as `<file>.age`: the server keeps no plaintext of it.

How it is written: the export is a call of the model like `save_weights_for_sampler` (in the model's seq-id
order), whose service writes the trained tensors into a hidden staging folder; once that reply comes, the
server converts and encrypts them there, and the folder becomes the export in one rename, so an export is
whole or absent; then its future completes (with the error, if that failed). The conversion runs on a thread of
`WORKERS` (at most two exports at once, each holding one model's tensors), not on the runner's thread that
delivers every session's replies: an adapter takes milliseconds, a full model about one read and one write of
its weights (and one more with encryption), and no other reply waits for it. An export counts
against `tinker.max_saved_bytes_per_user` like the other saved files of its model (`quotas.saved_bytes`).

Signed URLs (`Signer`): `<server>/api/v1/external_weights/download/<model>/<name>/<file>?expires=<unix s>&
signature=<hex>`; the signature is an HMAC-SHA256, under a secret of this server (`<root>/.export-secret`, made
at first use, mode 0600, so URLs outlive a restart), of the model, the name, the export's own random id (a
deleted export's URLs do not fetch a later one of the same name), the file and the expiry. The route takes no
key (the SDK's `urllib` download sends none): the signature is the credential, checked in constant time."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plexrl.server.tinker.records import checked_name, checkpoint_facts, job_of, note_checkpoint, tinker_path
from plexrl.server.tinker.registry import Refused, Registry
from plexrl.sessions.calls import Save

log = logging.getLogger(__name__)

KIND = "external_weights"
MAX_RECIPIENTS = 10  # Tinker's bound
MAX_RECIPIENT_CHARS = 16384  # an SSH RSA public key is under 1 KiB
URL_TTL_S = 3600  # how long a signed URL fetches (the cookbook signs again 5 minutes before)
AGE = ".age"
RAW = "trained.safetensors"  # what the service writes into the staging folder (the trained tensors)
FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # an export's files are flat: no '/' in a name
STALE_STAGING_S = 3600.0  # a staging folder left by a failed save is removed after this long
WORKERS = ThreadPoolExecutor(2, thread_name_prefix="tinker-export")  # (threads made on first use)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")  # fmt: skip


def export_dir(root: Path, model_id: str, name: str) -> Path:
    """Where export `name` of a model lives (`job_of` refuses a foreign id; `name` checked by the caller)."""
    return root / job_of(model_id) / KIND / name


def export_files(folder: Path) -> list[str]:
    """The files of an export, by name (sorted; hidden names and anything not a plain file left out)."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if FILE.fullmatch(p.name) and p.is_file() and not p.is_symlink())


def export_size(folder: Path) -> int:
    return sum((folder / f).stat().st_size for f in export_files(folder))


def recipients_of(raw: Any) -> list[Any]:
    """The age recipients of a request (pyrage objects; [] for none); Refused (400) naming a bad one."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_RECIPIENTS:
        raise Refused(400, f"age_encryption_recipients must be a list of 1 to {MAX_RECIPIENTS} public keys (or null)")
    import pyrage

    out: list[Any] = []
    for i, key in enumerate(raw):
        if not isinstance(key, str) or not key.strip() or len(key) > MAX_RECIPIENT_CHARS:
            raise Refused(400, f"age_encryption_recipients[{i}] must be an age1... or SSH public key string")
        key = key.strip()
        try:
            if key.startswith("age1"):
                out.append(pyrage.x25519.Recipient.from_str(key))
            elif key.startswith(("ssh-ed25519 ", "ssh-rsa ")):
                out.append(pyrage.ssh.Recipient.from_str(key))
            else:
                raise ValueError("not an age1... (X25519) or ssh-ed25519 / ssh-rsa public key")
        except Exception as exc:  # (pyrage.RecipientError and the above)
            raise Refused(400, f"age_encryption_recipients[{i}] is not a usable public key: {exc}") from None
    return out


@dataclass(frozen=True, slots=True)
class Export:
    """What one export writes: the model's facts and where (`staging` becomes `target`)."""

    model_id: str
    name: str
    base_model: str  # as the client named it
    model_dir: Path  # the base's directory (a full export copies its config and tokenizer)
    lora_rank: int | None
    lora_alpha: float
    targets: tuple[str, ...]
    staging: Path
    target: Path

    @property
    def path(self) -> str:
        return tinker_path(self.model_id, KIND, self.name)


def save_external(reg: Registry, user: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """`save_weights_external`: the model's trained weights exported under `path` (a name; an existing one gets
    400), with `ttl_seconds` and `age_encryption_recipients`. A future of `{path, size_bytes}`."""
    with reg.lock:
        m = reg.model(user, body.get("model_id"))
        with reg.turns.turn(m, body.get("seq_id")):
            reg.check_writes(m.user)
            name = checked_name(body.get("path"), "the external weights name")
            keys = recipients_of(body.get("age_encryption_recipients"))
            facts = checkpoint_facts(body, time.time())
            target = export_dir(reg.root, m.model_id, name)
            if target.exists():
                raise Refused(400, f"external weights {name!r} exist; save under another name (or delete them "
                                   "first: RestClient.delete_checkpoint_from_tinker_path)")  # fmt: skip
            if m.model_dir is None:
                raise Refused(400, f"model {m.model_id} is still being prepared; wait for its client")
            _sweep_staging(target.parent)
            staging = target.parent / f".{name}.{secrets.token_hex(6)}.staging"
            alpha = reg.cfg.lora_alpha if m.lora_alpha is None else m.lora_alpha  # (the session's own)
            spec = Export(m.model_id, name, m.base_model, m.model_dir, m.lora_rank, alpha, m.targets, staging, target)

            def finish(value: dict[str, Any]) -> Future[tuple[str, Any]]:  # (on a worker: the reply thread goes on)
                return WORKERS.submit(publish, reg, spec, keys, facts)

            return reg.turns.ordered(m, body.get("seq_id"), Save(str(staging / RAW), "sampler"), finish)


def publish(reg: Registry, spec: Export, keys: list[Any], facts: dict[str, Any]) -> tuple[str, Any]:
    """After the service wrote the trained tensors: the export's files written (and encrypted) in its staging
    folder, which then becomes the export; the future's answer (an error answer when that failed)."""
    try:
        write_export(spec, keys)
        with reg.lock:
            if spec.target.exists():  # (two saves of one name in flight: the first one stands)
                shutil.rmtree(spec.staging, ignore_errors=True)
                return "error", (f"external weights {spec.name!r} exist; save under another name", "user")
            spec.staging.replace(spec.target)
            note_checkpoint(
                reg.root, spec.model_id, f"{KIND}/{spec.name}", {**facts, "export_id": secrets.token_hex(8)}
            )
    except Exception as exc:
        log.exception("exporting %s failed", spec.path)
        shutil.rmtree(spec.staging, ignore_errors=True)
        return "error", (f"exporting the weights failed: {type(exc).__name__}: {exc}", "server")
    return "json", {"path": spec.path, "size_bytes": export_size(spec.target), "type": "save_weights_external"}


def write_export(spec: Export, keys: list[Any]) -> None:
    """The export's files in `spec.staging` from the trained tensors there (`RAW`), then encrypted to `keys`."""
    from safetensors.torch import load_file, save_file

    raw = spec.staging / RAW
    tensors = load_file(str(raw))
    if spec.lora_rank is not None:
        save_file(peft_tensors(tensors), str(spec.staging / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = adapter_config(spec)
        (spec.staging / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    else:
        save_file(tensors, str(spec.staging / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((spec.model_dir / "config.json").read_text())
        dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
        if len(dtypes) == 1:  # (what `dtype="auto"` loads: the trained dtype, not the base's)
            trained = dtypes.pop()
            for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]:
                config[key] = trained
        (spec.staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        for extra in ("generation_config.json", *TOKENIZER_FILES):
            if (spec.model_dir / extra).is_file():
                shutil.copyfile(spec.model_dir / extra, spec.staging / extra)
    del tensors
    raw.unlink()
    if keys:
        encrypt_folder(spec.staging, keys)


def peft_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """A session adapter's tensors under peft's saved names: the adapter's own name taken out
    (`...q_proj.lora_A.adapter.weight` -> `...q_proj.lora_A.weight`, what `get_peft_model_state_dict` gives)."""
    out: dict[str, Any] = {}
    for key, t in tensors.items():
        new = re.sub(r"\.(lora_[AB])\.adapter\.", r".\1.", key)
        if new == key:
            raise ValueError(f"an adapter tensor {key!r} that is not a LoRA A / B matrix")
        out[new] = t
    return out


def adapter_config(spec: Export) -> dict[str, Any]:
    """peft's `adapter_config.json` of a session adapter (what `LoraConfig.save_pretrained` writes, by hand: the
    server imports no peft for it)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": spec.base_model,
        "r": spec.lora_rank, "lora_alpha": spec.lora_alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(spec.targets), "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }  # fmt: skip


def encrypt_folder(folder: Path, keys: list[Any]) -> None:
    """Every file of `folder` age-encrypted to `keys` as `<file>.age`; the plaintext removed."""
    import pyrage

    for name in export_files(folder):
        plain = folder / name
        pyrage.encrypt_file(str(plain), str(folder / (name + AGE)), keys)
        plain.unlink()


def _sweep_staging(folder: Path) -> None:
    """Remove staging folders older than `STALE_STAGING_S` (a save whose service call failed leaves one)."""
    now = time.time()
    for p in folder.glob(".*.staging") if folder.is_dir() else ():
        try:
            if now - p.stat().st_mtime > STALE_STAGING_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            continue


class Signer:
    """Signs and checks download URLs with this server's secret (`<root>/.export-secret`, see the module
    docstring). `now`: the clock (unix seconds)."""

    def __init__(self, root: Path, now: Any = time.time) -> None:
        self.root, self.now = root, now
        self._secret: bytes | None = None

    def secret(self) -> bytes:
        if self._secret is None:
            self._secret = _secret_of(self.root)
        return self._secret

    def signature(self, model_id: str, name: str, export_id: str, file: str, expires: int) -> str:
        message = "\n".join([model_id, name, export_id, file, str(expires)]).encode()
        return hmac.new(self.secret(), message, hashlib.sha256).hexdigest()

    def query(self, model_id: str, name: str, export_id: str, file: str, expires: int) -> str:
        return f"expires={expires}&signature={self.signature(model_id, name, export_id, file, expires)}"

    def check(self, model_id: str, name: str, export_id: str, file: str, expires: Any, signature: Any) -> None:
        """Refused (403) unless `signature` signs these and `expires` is still ahead."""
        try:
            when = int(expires)
        except (TypeError, ValueError):
            raise Refused(403, "a download URL needs its expires and signature: ask get_external_weights_urls "
                               "for a new one") from None  # fmt: skip
        good = self.signature(model_id, name, export_id, file, when)
        if not isinstance(signature, str) or not hmac.compare_digest(signature.encode(), good.encode()):
            raise Refused(403, "this download URL's signature does not match (altered, another file's, or of "
                               "an export since deleted); ask get_external_weights_urls for a new one")  # fmt: skip
        if when < self.now():
            raise Refused(403, "this download URL expired; ask get_external_weights_urls for a new one")


def _secret_of(root: Path) -> bytes:
    """The server's URL secret: read, or made once (written to a private file, then linked into place, so two
    servers starting on one root agree)."""
    path = root / ".export-secret"
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".export-secret.{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    secret = path.read_bytes()
    if len(secret) < 32:
        raise RuntimeError(f"{path} holds {len(secret)} bytes, fewer than 32: remove it (a new one is made)")
    return secret


__all__ = [
    "AGE",
    "KIND",
    "URL_TTL_S",
    "WORKERS",
    "Export",
    "Signer",
    "adapter_config",
    "export_dir",
    "export_files",
    "export_size",
    "peft_tensors",
    "recipients_of",
    "save_external",
]
