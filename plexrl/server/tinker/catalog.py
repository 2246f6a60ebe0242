"""Which base models a Tinker client may name, and what the server tells it about them.

Each entry of `tinker.models` (the server's YAML) serves one model under one or more names:
- a pretrained model (`plexrl/job/pretrained.py`): by its Hugging Face name
  (`HuggingFaceTB/SmolLM2-135M-Instruct`, the name Tinker clients and the cookbook use) and its short name
  (`smollm2-135m-instruct`), either way in the entry;
- a model directory (an absolute path holding config.json): by the Hugging Face name its config declares
  (`_name_or_path`, as transformers writes it, or `_model_name_or_path`), when that is an `org/name` id, and by
  its path.
A model directory under the server's allowed roots may also be named by path without an entry (the registry's
rule, unchanged).

What a client learns of a model (`describe`): its architecture (config.json's `model_type`, e.g. `llama`,
`qwen2`), its context length (`max_position_embeddings`) and the tokenizer id it loads (`tokenizer_id`): the
Hugging Face name where there is one (the server places the pretrained tokenizers in its Hugging Face cache:
`plexrl pretrained NAME` does the same on a client's machine), else the name the client gave.

What it does NOT do: look anything up on a hub, or list directories under the allowed roots.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plexrl.job.pretrained import PRETRAINED, pretrained_path, short_name

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
DECLARED_KEYS = ("_name_or_path", "_model_name_or_path")  # where a config.json names its model


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a client is told of a model: `arch` (config.json's model_type), `context` (positions)."""

    arch: str | None
    context: int | None


def names_of(entry: str) -> tuple[str, ...]:
    """The names a `tinker.models` entry serves, its preferred (Hugging Face) name first."""
    short = short_name(entry)
    if short is not None:
        return (PRETRAINED[short].hub_name, short)
    path = Path(entry)
    if path.is_absolute():
        declared = declared_name(path)
        return (declared, entry) if declared is not None else (entry,)
    return (entry,)


def entry_of(models: list[str], name: Any) -> str | None:
    """The `tinker.models` entry that serves `name` (None: no entry does)."""
    if not isinstance(name, str):
        return None
    for entry in models:
        if name in names_of(entry):
            return entry
    return None


def directory(entry: str, resolve_pretrained: Callable[[str], Path]) -> Path:
    """The model directory of an entry (a pretrained one converted on first use by `resolve_pretrained`)."""
    short = short_name(entry)
    return resolve_pretrained(short) if short is not None else Path(entry).resolve()


def declared_name(model_dir: Path) -> str | None:
    """The Hugging Face id a model directory's config.json declares (None: none, or not an `org/name` id)."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in DECLARED_KEYS:
        value = cfg.get(key) if isinstance(cfg, dict) else None
        if isinstance(value, str) and HUB_ID.fullmatch(value) and ".." not in value:
            return value
    return None


def facts(model_dir: Path) -> ModelFacts:
    """Architecture and context length from a model directory's config.json (None where it says nothing)."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return ModelFacts(None, None)
    arch = cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else None
    context = cfg.get("max_position_embeddings")
    return ModelFacts(arch, int(context) if isinstance(context, int) and not isinstance(context, bool) else None)


def tokenizer_id(models: list[str], name: str) -> str:
    """The id a client loads the tokenizer of the model it named `name` by: the entry's Hugging Face name if
    it has one, else `name` itself (a path: loadable where the client sees that path)."""
    entry = entry_of(models, name)
    if entry is None:
        return name
    preferred = names_of(entry)[0]
    return preferred if HUB_ID.fullmatch(preferred) else name


def supported(models: list[str]) -> list[dict[str, Any]]:
    """`get_server_capabilities`' list: every name of every entry, with its context length (a pretrained model
    not converted yet: converted now, once)."""
    out: list[dict[str, Any]] = []
    for entry in models:
        short = short_name(entry)
        try:
            model_dir = pretrained_path(short) if short is not None else Path(entry)
        except LookupError:  # (its package is missing: listed, without a context length)
            model_dir = None
        context = facts(model_dir).context if model_dir is not None else None
        for name in names_of(entry):
            out.append({"model_name": name, "max_context_length": context, "trainable": True, "sampleable": True})
    return out


__all__ = [
    "ModelFacts",
    "declared_name",
    "directory",
    "entry_of",
    "facts",
    "names_of",
    "supported",
    "tokenizer_id",
]
