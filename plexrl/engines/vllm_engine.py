"""vLLM as the generation engine: `SharedLLM` (one in-process `vllm.LLM` per service and model architecture)
and `VLLMEngine` (one job's `Engine`: generation on a SharedLLM, everything else on the job's TorchEngine).

Weights: the job's torch policy is the only source of truth. Before a job generates, its VLLMEngine makes
sure the SharedLLM holds *this job's* weights at *its current version*; if not (the job trained since, or
another job generated last), it streams the policy's tensors into vLLM (`reload_weights` with a
`weights_iterator`, no files) and resets vLLM's prefix cache (cached KV blocks of other weights must never
be reused). That one mechanism is both the weight sync after `train` and the per-job weight swap of a
shared engine; each is timed and reported (`take_syncs`). Jobs with the same architecture, tokenizer and dtype
(`generator_key`) share one SharedLLM on a service: its process, KV cache and warm-up stay.

Device: the engine's arguments that depend on the device are `plexrl.devices.vllm_args`' (CPU: fp32, eager;
CUDA: the job's dtype, so behaviour log-probs come from the weights it trains in the same arithmetic, CUDA
graphs for decode, sleep mode, and a `gpu_memory_utilization` computed from what the engine needs, since vLLM
refuses to start unless that share of the GPU is free). An engine no job uses any more sleeps on CUDA
(`sleep` / `wake`; `plexrl.devices.idle_engine`) instead of being shut down and rebuilt; a shutdown frees what
in-process vLLM lets go of (`shutdown`).

Sampling: one vLLM request per prompt with `n` samples, seeded from (seed, row); vLLM seeds sample j with
seed + j, so every row has its own seed. On CPU a job's samples then depend only on its seed and weights,
never on other jobs or batch composition (tests/test_vllm.py). On CUDA they follow the same distribution but
not the same bits: vLLM's kernels reduce in an order that depends on the batch, so a co-batched job's logits
move in their last bits and a seeded sample can flip (`deterministic: true` turns on vLLM's batch-invariant
kernels; docs/gpu.md). Log-probs are vLLM's *processed* log-probs: temperature (and top-p) applied, the same
distribution as the torch engine's behaviour log-probs.

vLLM runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, forced here): it spawns no process and works inside a
daemonic Dask worker. Building an LLM seeds the global RNGs (CPU and CUDA) and replaces `torch.set_num_threads`
with a no-op on CPU; `SharedLLM` restores all of them.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from plexrl.devices import CPU, Device, vllm_args
from plexrl.engines.base import GenerationOutput
from plexrl.engines.steps import row_seed as row_seed
from plexrl.engines.vllm_env import VLLM_EXTRA_HINT as VLLM_EXTRA_HINT
from plexrl.engines.vllm_env import _free_cuda, _import_vllm, _process_state_kept, _quiet, model_shape
from plexrl.engines.vllm_env import config_problem as config_problem
from plexrl.engines.vllm_env import model_problem as model_problem
from plexrl.engines.vllm_env import vllm_cpu_build as vllm_cpu_build
from plexrl.engines.vllm_env import vllm_installed as vllm_installed

T = TypeVar("T")

if TYPE_CHECKING:
    from torch import Tensor

    from plexrl.engines.torch_engine import TorchEngine

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 64 * 2**20


def generator_key(
    model_dir: str | Path, max_model_len: int | None = None, block_size: int | None = None, dtype: str = "float32"
) -> str:
    """Jobs whose models share this key (architecture config and tokenizer, the `max_model_len` and KV
    `block_size` the engine is built with, None: the model's positions, vLLM's default, and the job's
    `model.dtype`, which the engine computes in on CUDA) can share one SharedLLM."""
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
        + ("" if dtype == "float32" else f"-{dtype}")
    )


_LIVE: weakref.WeakSet[SharedLLM] = weakref.WeakSet()  # engines not shut down, in this process


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
        device: Device = CPU,
        dtype: str = "float32",
        lora_bytes: int = 0,
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
        self.device = device
        self.asleep = 0  # the sleep level it is at (0: awake)
        self._lock = threading.Lock()
        batched = max(self.max_model_len, 4096)
        lora = bool(engine_args and engine_args.get("enable_lora"))
        on_device = vllm_args(device, dtype=dtype, shape=model_shape(model_dir), kv_cache_bytes=kv_cache_bytes,
                              batched_tokens=batched, lora_bytes=lora_bytes, lora=lora)  # fmt: skip
        self.dtype = str(on_device["dtype"])
        t0 = time.perf_counter()
        with _process_state_kept(), _quiet():
            self.llm: Any = vllm.LLM(
                model=str(model_dir),
                **on_device,  # dtype, eager or CUDA graphs, sleep mode, gpu_memory_utilization (plexrl.devices)
                kv_cache_memory_bytes=kv_cache_bytes,
                max_model_len=self.max_model_len,
                logprobs_mode="processed_logprobs",
                use_tqdm_on_load=False,
                # whole prompts per step: a seeded request whose prefill is split makes vLLM rewind its
                # generator, which CPU generators cannot do ("CPU Generator does not use offset")
                enable_chunked_prefill=False,
                max_num_batched_tokens=batched,
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
        _LIVE.add(self)
        log.info("vLLM engine for %s built in %.1fs (%s, %s)", model_dir, self.build_seconds, self.dtype,
                 device.torch_name)  # fmt: skip

    def sleep(self, level: int) -> None:
        """Free the engine's GPU memory until the next `wake` (CUDA only: `plexrl.devices.idle_engine`): level 1
        offloads the weights to pinned host memory and drops the KV cache, level 2 drops both (the next job's
        weights are loaded on waking). Cached prefixes go either way."""
        with self._lock:
            if self.asleep:
                return
            self.llm.reset_prefix_cache()
            self.llm.sleep(level=level)
            self.asleep = level
            if level == 2:
                self.holds = None  # nobody's weights are left

    def wake(self) -> None:
        """Give the engine its memory back (after `sleep`); at level 2 its weights are undefined until loaded."""
        with self._lock:
            self._wake()

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = 0

    def load_weights(self, job_id: str, version: int, named: Sequence[tuple[str, Tensor]]) -> WeightLoad:
        """Copy `named` (HF parameter names -> tensors) into the engine; they become `job_id`'s at `version`."""
        with self._lock:
            start = self.clock()
            self._wake()
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
        top_k: int = 0,
    ) -> GenerationOutput:
        """`Engine.generate` on the weights the engine holds; `lora_request`: a vLLM `LoRARequest` applied to
        every row (an engine built with `enable_lora`), else the weights alone."""
        kw = dict(
            n=n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed, greedy=greedy,
            stop_token_ids=stop_token_ids, stop=stop, top_p=top_p, top_k=top_k,
        )  # fmt: skip
        return self.generate_calls([(prompts, kw)], [lora_request])[0]

    def generate_calls(
        self, calls: Sequence[tuple[list[list[int]], dict[str, Any]]], loras: Sequence[Any] | None = None
    ) -> list[GenerationOutput]:
        """Several `generate` calls in ONE vLLM call: `calls[i]` = (prompts, `generate` keywords), each request
        seeded and parameterised as in its own call; `loras[i]`: the `LoRARequest` of call i's rows (None: the
        weights alone). vLLM batches every row at once; each call gets back its own output, in order, with the
        tokens it gets alone (seeded per request) up to the float noise of another batch composition."""
        from vllm.inputs import TokensPrompt

        parts = [self.requests(prompts, **kw) for prompts, kw in calls]  # (bad input raises before the engine runs)
        lora: Any = None
        if loras is not None and any(r is not None for r in loras):
            lora = [r for r, (_, requests, _) in zip(loras, parts, strict=True) for _ in requests]
        with self._lock:
            self._wake()
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for _, requests, _ in parts for p in requests],
                [sp for _, _, params in parts for sp in params], use_tqdm=False, lora_request=lora,
            )  # fmt: skip
        results, start = [], 0
        for rows, requests, _ in parts:
            results.append(self.collect(rows, outs[start : start + len(requests)]))
            start += len(requests)
        return results

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
        top_k: int = 0,
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
                top_k=0 if greedy else top_k,
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
        """Stop the engine and free what it holds (in-process: no process to reap). On CUDA in-process vLLM does
        not give all of its memory back (vLLM #21073: the service lets idle engines sleep instead); what can
        go goes: the engine core, the allocator's cached blocks and, once no other engine is left in the
        process, vLLM's distributed state (`cleanup_dist_env_and_memory`, which would break a live engine)."""
        with self._lock:
            llm, self.llm, self.holds = getattr(self, "llm", None), None, None
            if llm is None:
                return
            _LIVE.discard(self)
            core = getattr(llm.llm_engine, "engine_core", None)
            with contextlib.suppress(Exception):
                if core is not None and hasattr(core, "shutdown"):
                    core.shutdown()
            del llm, core
            gc.collect()
            if self.device.cuda:
                _free_cuda(last=not _LIVE)


def guarded(llm: SharedLLM, run: Callable[[], T]) -> T:
    """`run()` on `llm`: bad input (ValueError) raises as it is, the engine being fine; any other failure marks the
    engine broken (the service rebuilds it for the other jobs) and raises RuntimeError."""
    try:
        return run()
    except ValueError:
        raise
    except Exception as exc:
        llm.broken = True
        raise RuntimeError(f"vLLM engine failed: {type(exc).__name__}: {exc}") from exc


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

    def generate(self, prompts: list[list[int]], **kw: Any) -> GenerationOutput:
        """`Engine.generate` (the keywords of `SharedLLM.generate` but `lora_request`): one call of
        `generate_calls`."""
        return self.generate_calls([(prompts, kw)])[0]

    def generate_calls(self, calls: Sequence[tuple[list[list[int]], dict[str, Any]]]) -> list[GenerationOutput]:
        """Several `generate` calls of this job in ONE vLLM call (`SharedLLM.generate_calls`): a session's sample
        calls sent at once (`plexrl/sessions/sampling.py`)."""
        self.sync()
        return guarded(self.llm, lambda: self.llm.generate_calls(calls))

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
