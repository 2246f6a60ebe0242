"""vLLM rollouts for LoRA jobs: `SharedLoRALLM` (one in-process `vllm.LLM` with LoRA enabled, per service,
base model and LoRA settings) and `VLLMLoRAEngine` (one LoRA job's `Engine`: generation on the shared engine
under the job's own `LoRARequest`; scoring, training and state on its `LoRAEngine`).

Weights: the BASE is loaded into vLLM once, when the engine is built, and never reloaded for a LoRA job: what
is a job's there is its adapter only. Before a job generates, its engine makes sure vLLM has the job's adapter
at the job's current version. If not (it trained since, or never generated here), the adapter is written in
peft's format (`LoRAEngine.save_pretrained`: megabytes, not the base) into the engine's own temporary
directory and registered with vLLM under a FRESH int id and name (`LLMEngine.add_lora`); the job's previous
version is then removed (`LLMEngine.remove_lora`) and its files deleted. That one mechanism is the weight
sync after `train`, timed and reported as a `WeightLoad` of kind "sync" carrying the adapter's bytes.
Switching between LoRA jobs loads nothing: each job's current adapter stays registered (up to
`MAX_CPU_LORAS` adapters; vLLM's LRU cache reloads an evicted one from its files, which stay until the next
version replaces them).

Prefix caching stays on: vLLM keys a cached KV block by the adapter's name and path, both fresh per version,
so no block computed under another adapter or another version is ever reused, and nothing is reset.

Numerics: vLLM applies an adapter as peft computes it (tests/test_vllm_lora.py). The engine holds the base in
the dtype `plexrl.devices.vllm_args` gives it: fp32 on CPU, the job's `model.dtype` on CUDA, where vLLM's LoRA
kernels take fp16/bf16 only (a LoRA job in fp32 on CUDA is refused there, `plexrl.devices.vllm_problem`), and
the adapters compute in that dtype too. Sampling is seeded per row
exactly as `SharedLLM.generate` does. A job's rollout node is one call of its own; `generate_together` runs
several jobs' rollouts in ONE call (a LoRARequest per request, each job's seeds): co-scheduled rollouts
(`batch_rollouts`) and the sample calls of LoRA sessions queued together (`plexrl/sessions/sampling.py`).
Decode-step slices (`begin_generation` / `resume`) are partial rollouts (`plexrl/engines/partial.py`) under
the job's adapter.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plexrl.devices import CPU, Device
from plexrl.engines.base import GenerationOutput
from plexrl.engines.vllm_engine import DEFAULT_KV_CACHE_BYTES, SharedLLM, WeightLoad, generator_key, guarded

if TYPE_CHECKING:
    from plexrl.engines.lora import LoRAEngine

# vLLM's accepted `max_lora_rank` values (vllm/config/lora.py MaxLoRARanks); an engine serves ranks up to its own
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# projections vLLM's Llama-family models apply adapters to (q/k/v packed as qkv_proj, gate/up as gate_up_proj)
VLLM_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORAS = 4  # adapters one engine step may mix (device slots; one job per call uses one)
MAX_CPU_LORAS = 16  # adapters kept registered (vLLM's LRU cache); beyond, the oldest reloads from its files


def lora_rank_slot(r: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that serves an adapter of rank `r`.

    >>> lora_rank_slot(4), lora_rank_slot(16), lora_rank_slot(17)
    (8, 16, 32)
    """
    for slot in VLLM_LORA_RANKS:
        if slot >= r:
            return slot
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {r}")


def lora_vllm_problem(r: int, targets: Sequence[str], dtype: str = "float32", cuda: bool = False) -> str | None:
    """Why vLLM cannot apply a LoRA adapter of rank `r` on `targets` to a base of `dtype` (on CUDA when `cuda`:
    vLLM's LoRA kernels there take fp16/bf16 only), or None when it can. Pure (no import of vLLM: whether vLLM
    can serve the base itself is `vllm_engine.model_problem`)."""
    from plexrl.devices import vllm_problem

    why = vllm_problem(Device("cuda") if cuda else CPU, dtype, lora=True)
    if why:
        return why
    if r > VLLM_LORA_RANKS[-1]:
        return f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; model.lora.r is {r}"
    other = [t for t in targets if t not in VLLM_LORA_MODULES]
    if other:
        return f"vLLM applies adapters to {', '.join(VLLM_LORA_MODULES)} only; model.lora.target_modules has {other}"
    return None


def lora_generator_key(
    model_dir: str | Path, r: int, max_model_len: int | None = None, block_size: int | None = None,
    dtype: str = "float32",
) -> str:  # fmt: skip
    """Jobs whose models share this key share one SharedLoRALLM: `generator_key` (architecture, tokenizer,
    max_model_len, block size, dtype), the LoRA rank slot the engine is built with, and the base itself (its
    resolved directory, as `lora.base_key`): its weights stay loaded, and an adapter applies to the base it trains
    on."""
    import hashlib

    base = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:8]
    return f"{generator_key(model_dir, max_model_len, block_size, dtype)}-lora{lora_rank_slot(r)}-base{base}"


def lora_slot_bytes(model_dir: str | Path, r: int, dtype: str = "float32") -> int:
    """Device bytes of vLLM's LoRA buffers: `MAX_LORAS` adapter slots of rank `lora_rank_slot(r)` on every
    projection, in the engine's `dtype`."""
    from plexrl.sizes import lora_state_bytes

    fp32 = lora_state_bytes(model_dir, lora_rank_slot(r), list(VLLM_LORA_MODULES)) // 3  # weights, no moments
    return MAX_LORAS * (fp32 if dtype == "float32" else fp32 // 2)


def lora_engine_bytes(model_dir: str | Path, r: int, kv_cache_bytes: int, dtype: str = "float32") -> int:
    """Device bytes of a SharedLoRALLM whose base is in `dtype`: the base, the KV cache, and its LoRA slots
    (`lora_slot_bytes`)."""
    from plexrl.sizes import model_bytes

    return model_bytes(Path(model_dir), dtype) + kv_cache_bytes + lora_slot_bytes(model_dir, r, dtype)


@dataclass(frozen=True, slots=True)
class Registered:
    """A job's adapter as vLLM holds it: the `LoRARequest` to generate under, its version, files and bytes."""

    request: Any
    version: int
    path: Path
    nbytes: int


class SharedLoRALLM(SharedLLM):
    """A SharedLLM built with `enable_lora`, serving the LoRA jobs of one base on a service: the base weights
    once, each job's current adapter registered under its own id. `load_weights` (a full job's weight swap)
    is refused: a LoRA engine's base never changes."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        r: int,
        eos_id: int | None,
        pad_id: int | None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        max_model_len: int | None = None,
        block_size: int | None = None,
        clock: Callable[[], float] = time.time,
        device: Device = CPU,
        dtype: str = "float32",
    ) -> None:
        from plexrl.devices import engine_dtype

        self.rank = lora_rank_slot(r)
        lora = {"enable_lora": True, "max_lora_rank": self.rank, "max_loras": MAX_LORAS, "max_cpu_loras": MAX_CPU_LORAS}
        slots = lora_slot_bytes(model_dir, r, engine_dtype(device, dtype))
        super().__init__(
            model_dir, eos_id=eos_id, pad_id=pad_id, kv_cache_bytes=kv_cache_bytes, max_model_len=max_model_len,
            block_size=block_size, clock=clock, engine_args=lora, device=device, dtype=dtype, lora_bytes=slots,
        )  # fmt: skip
        self.adapters: dict[str, Registered] = {}  # job id -> its adapter in vLLM
        self._ids = itertools.count(1)  # vLLM int ids, never reused (a version is a new id)
        self._dir = Path(tempfile.mkdtemp(prefix="plexrl-vllm-lora-"))

    def load_weights(self, job_id: str, version: int, named: Sequence[tuple[str, Any]]) -> WeightLoad:
        raise RuntimeError("a LoRA engine's base weights never change: register the job's adapter instead")

    def _wake(self) -> None:
        """Level 2 dropped the base: it is read back from its files (the adapters were all forgotten before the
        engine went idle; each job registers its own again)."""
        level = self.asleep
        super()._wake()
        if level == 2:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.model_dir)})

    def register(self, job_id: str, version: int, adapter: LoRAEngine) -> WeightLoad:
        """Write `adapter` (the job's LoRAEngine: its adapter only) and serve it as `job_id`'s at `version`
        under a fresh id; the job's previous version leaves vLLM and the disk."""
        from vllm.lora.request import LoRARequest

        with self._lock:
            start = self.clock()
            self._wake()
            lora_id = next(self._ids)
            name = f"{adapter.adapter}-v{version}-{lora_id}"  # prefix-cache blocks are keyed by name and path
            path = self._dir / name
            adapter.save_pretrained(path)
            nbytes = (path / "adapter_model.safetensors").stat().st_size
            request = LoRARequest(name, lora_id, str(path))
            engine = self.llm.llm_engine
            engine.add_lora(request)
            old = self.adapters.get(job_id)
            self.adapters[job_id] = Registered(request, version, path, nbytes)
            if old is not None:
                self._drop(old)
            self.loads += 1
            return WeightLoad(job_id, version, "sync", start, self.clock(), nbytes)

    def forget(self, job_id: str) -> None:
        """Remove the job's adapter from vLLM and its files (the job ended, or its state was replaced)."""
        with self._lock:
            old = self.adapters.pop(job_id, None)
            if old is not None:
                self._drop(old)

    def _drop(self, old: Registered) -> None:
        if self.llm is not None:
            with contextlib.suppress(Exception):  # an engine that failed has nothing left to remove
                self.llm.llm_engine.remove_lora(old.request.lora_int_id)
        shutil.rmtree(old.path, ignore_errors=True)

    def generate_many(self, calls: Sequence[tuple[str, list[list[int]], dict[str, Any]]]) -> list[GenerationOutput]:
        """Several jobs' generations in ONE vLLM call: `calls` are (job id, prompts, `generate` keywords), each
        job's adapter registered already (`VLLMLoRAEngine.sync`); every request carries its own job's
        LoRARequest and seeds, so a job's rows are sampled as in its own call (vLLM batches the rows of all
        jobs, up to `MAX_LORAS` adapters a step). Returns one output per call, in order."""

        return self.generate_calls([(p, kw) for _, p, kw in calls], [self.adapters[job].request for job, _, _ in calls])

    def served(self) -> set[int]:
        """The int ids vLLM holds (its LRU cache of adapters)."""
        return set(self.llm.llm_engine.list_loras())

    def shutdown(self) -> None:
        super().shutdown()
        self.adapters.clear()
        shutil.rmtree(self._dir, ignore_errors=True)


class VLLMLoRAEngine:
    """The `Engine` of one LoRA job whose rollouts run on vLLM: `generate` on the shared `SharedLoRALLM` under
    the job's own LoRARequest, after registering its current adapter when vLLM does not have it; scoring,
    training and state on the job's `LoRAEngine` (`trainer`). `weight_version` is the trainer's; every rollout is
    generated at it."""

    def __init__(self, trainer: LoRAEngine, llm: SharedLoRALLM, job_id: str) -> None:
        self.trainer, self.llm, self.job_id = trainer, llm, job_id
        self._loads: list[WeightLoad] = []

    @property
    def weight_version(self) -> int:
        return self.trainer.weight_version

    def sync(self) -> WeightLoad | None:
        """Register this job's current adapter with vLLM unless it has it already."""
        version = self.trainer.weight_version
        held = self.llm.adapters.get(self.job_id)
        if held is not None and held.version == version:
            return None
        load = self.llm.register(self.job_id, version, self.trainer)
        self._loads.append(load)
        return load

    def take_loads(self) -> list[WeightLoad]:
        """Adapter loads since the last call (the service reports them per node)."""
        out, self._loads = self._loads, []
        return out

    def generate(self, prompts: list[list[int]], **kw: Any) -> GenerationOutput:
        """`Engine.generate` (the keywords of `SharedLLM.generate` but `lora_request`): one call of
        `generate_calls`."""
        return self.generate_calls([(prompts, kw)])[0]

    def generate_calls(self, calls: Sequence[tuple[list[list[int]], dict[str, Any]]]) -> list[GenerationOutput]:
        """Several `generate` calls of this job in ONE vLLM call under its adapter (a session's sample calls sent
        at once, `plexrl/sessions/sampling.py`)."""

        def run() -> list[GenerationOutput]:
            self.sync()
            request = self.llm.adapters[self.job_id].request
            return self.llm.generate_calls(calls, [request] * len(calls))

        return guarded(self.llm, run)

    @property
    def lora_request(self) -> Any:
        """The vLLM `LoRARequest` of this job's adapter as vLLM holds it (after `sync`)."""
        return self.llm.adapters[self.job_id].request

    def begin_generation(self, prompts: list[list[int]], **kwargs: Any) -> Any:
        """A generation run in slices (decode-step preemption): a partial rollout (`plexrl/engines/partial.py`)
        whose every slice runs under this job's adapter, synced before each slice."""
        from plexrl.engines.partial import begin

        return begin(self, prompts, **kwargs)

    def resume(self, p: Any, max_steps: int | None = None) -> Any:
        """At most `max_steps` more tokens per unfinished row of the partial rollout `p` (one vLLM call)."""
        from plexrl.engines.partial import advance

        return advance(self, p, max_steps)

    def load_state(self, state: dict[str, Any]) -> None:
        self.trainer.load_state(state)
        self.llm.forget(self.job_id)  # same version number, other adapter: register again before generating

    def release(self) -> None:
        """The job leaves the service: its adapter leaves vLLM and the shared base."""
        self.llm.forget(self.job_id)
        self.trainer.release()

    def __getattr__(self, name: str) -> Any:
        if name in ("trainer", "llm", "job_id", "_loads"):
            raise AttributeError(name)
        # logprobs, train_step, state_tensors, export_state, save_pretrained, policy, shared, adapter
        return getattr(self.trainer, name)


def generate_together(
    engines: Sequence[VLLMLoRAEngine], calls: Sequence[tuple[list[list[int]], dict[str, Any]]], *, repeats: bool = False
) -> list[GenerationOutput]:
    """The rollouts of several LoRA jobs on ONE shared engine in one vLLM call: `calls[i]` = (prompts, `generate`
    keywords) of `engines[i]`. Each job's current adapter is synced first (its loads reported with its own
    engine). What a cohort of several jobs' rollouts or sessions' samples calls. `repeats`: a job may come more
    than once (a session's sample calls sent at once, each its own call; a DAG job's rollout is one call)."""
    if len({id(e.llm) for e in engines}) > 1:
        raise ValueError("jobs generate together only on one shared engine (the same base and LoRA settings)")
    unique = list({e.job_id: e for e in engines}.values())
    if len(unique) < len(engines) and not repeats:
        raise ValueError("one call per job: a job's rollouts in one batch go in one call's prompts")

    def run() -> list[GenerationOutput]:
        for e in unique:
            e.sync()
        return engines[0].llm.generate_many([(e.job_id, p, kw) for e, (p, kw) in zip(engines, calls, strict=True)])

    return guarded(engines[0].llm, run)


__all__ = [
    "MAX_CPU_LORAS",
    "MAX_LORAS",
    "SharedLoRALLM",
    "VLLMLoRAEngine",
    "generate_together",
    "lora_engine_bytes",
    "lora_generator_key",
    "lora_rank_slot",
    "lora_slot_bytes",
    "lora_vllm_problem",
]
