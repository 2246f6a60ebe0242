"""`Generators`: the shared vLLM engines of one service, one per generator key (architecture, tokenizer, lengths,
dtype; a LoRA engine also per base and rank slot), what becomes of them when no job uses them, and when they
are shut down.

An engine is built for the first job of its key, with the device's part of its arguments decided by
`plexrl.devices.vllm_args` from the service's device as it is at that moment (free memory included). When its
last job leaves, it is retired (`plexrl.devices.idle_engine`): on CUDA it sleeps (level 2, or 1 for a LoRA
engine whose base host memory can hold) and the next job of its key wakes it, since in-process vLLM does not
give its GPU memory back on shutdown and a rebuild would leak a copy each time a job mix comes and goes; at most
`MAX_ASLEEP` sleep, the one idle longest is shut down beyond. On CPU (vLLM's CPU build has no sleep mode) it
is shut down. An engine whose call failed is shut down at once and its jobs get a fresh one.

Not thread-safe: the service calls it from its one node at a time (and its load and release tasks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from plexrl.devices import Device
    from plexrl.job.spec import JobSpec

log = logging.getLogger(__name__)


class Generators:
    """The shared vLLM engines of a service on `device` (see the module docstring)."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.time) -> None:
        self.device, self.clock = device, clock
        self._engines: dict[str, Any] = {}  # key -> SharedLLM / SharedLoRALLM
        self._idle: dict[str, int] = {}  # key -> when it went to sleep (an order), while it sleeps
        self._order = 0

    def __len__(self) -> int:
        return len(self._engines)

    def __iter__(self) -> Iterator[str]:
        return iter(self._engines)

    def __contains__(self, key: object) -> bool:
        return key in self._engines

    def __getitem__(self, key: str) -> Any:
        return self._engines[key]

    def values(self) -> list[Any]:
        return list(self._engines.values())

    def awake(self) -> int:
        """Engines a job uses (not asleep)."""
        return len(self._engines) - len(self._idle)

    def loads(self) -> int:
        return sum(g.loads for g in self._engines.values())

    def describe(self) -> Device:
        """The service's device as it is now (free memory measured now on CUDA)."""
        from plexrl.devices import describe

        return describe(str(self.device))

    def engine_for(self, job: JobSpec, trainer: Any) -> Any:
        """The job's VLLMEngine on the shared engine of its key (built on first use, woken if asleep); a LoRA
        job's VLLMLoRAEngine on the LoRA-enabled engine of its base (plexrl/engines/vllm_lora.py: the base loaded
        once, each job's adapter under its own LoRARequest)."""
        from plexrl.engines.vllm_engine import SharedLLM, VLLMEngine, generator_key

        cfg = job.config
        sizes = job.generation_sizes()  # from the job: its prompts + generation, its rollout batch
        budget = sizes.max_model_len  # None: the model's positions
        lora, dtype, block = cfg.model.lora, cfg.model.dtype, cfg.vllm.block_size
        common: dict[str, Any] = {
            "eos_id": job.tokenizer.eos_token_id, "pad_id": job.tokenizer.pad_token_id,
            "kv_cache_bytes": sizes.kv_cache_bytes, "max_model_len": budget, "block_size": block,
            "clock": self.clock, "dtype": dtype,
        }  # fmt: skip
        if lora is not None:
            from plexrl.engines.vllm_lora import SharedLoRALLM, VLLMLoRAEngine, lora_generator_key

            key = lora_generator_key(job.model_path, lora.r, budget, block, dtype)
            if key not in self._engines:
                self._engines[key] = SharedLoRALLM(job.model_path, r=lora.r, device=self.describe(), **common)
            self._idle.pop(key, None)  # a sleeping engine wakes on its first use
            return VLLMLoRAEngine(trainer, self._engines[key], job.job_id)
        # jobs share an engine only at one max_model_len, block size and dtype
        key = generator_key(job.model_path, budget, block, dtype)
        if key not in self._engines:
            self._engines[key] = SharedLLM(job.model_path, device=self.describe(), **common)
        self._idle.pop(key, None)
        return VLLMEngine(trainer, self._engines[key], job.job_id)

    def drop(self, engines: dict[str, Any], jobs: dict[str, JobSpec], *, only_broken: bool = False) -> None:
        """Shut down the engines that failed and give the jobs on them (`engines`, the service's job engines, by
        job id; `jobs`, their specs) fresh ones; unless `only_broken`, retire those no job uses (`retire`)."""
        used = {id(e.llm) for e in engines.values() if hasattr(e, "llm")}
        for key, llm in list(self._engines.items()):
            if llm.broken:
                self.shutdown(key)
                for job_id, engine in engines.items():
                    if getattr(engine, "llm", None) is llm:
                        engines[job_id] = self.engine_for(jobs[job_id], engine.trainer)
            elif not only_broken and id(llm) not in used and key not in self._idle:
                self.retire(key)

    def retire(self, key: str) -> None:
        """An engine no job uses: asleep on CUDA (`plexrl.devices.idle_engine`), at most `MAX_ASLEEP` of them;
        shut down on CPU."""
        from plexrl.devices import MAX_ASLEEP, host_available, idle_engine
        from plexrl.sizes import model_bytes

        llm = self._engines[key]
        weights = model_bytes(llm.model_dir, llm.dtype)
        action = idle_engine(self.describe(), lora=hasattr(llm, "adapters"), weight_bytes=weights,
                             host_free=host_available())  # fmt: skip
        if action == "shutdown":
            self.shutdown(key)
            return
        llm.sleep(1 if action == "sleep1" else 2)
        log.info("vLLM engine %s asleep (%s) until a job of its key comes", key, action)
        self._order += 1
        self._idle[key] = self._order
        while len(self._idle) > MAX_ASLEEP:
            self.shutdown(min(self._idle, key=self._idle.__getitem__))

    def shutdown(self, key: str) -> None:
        self._idle.pop(key, None)
        self._engines.pop(key).shutdown()

    def close(self) -> None:
        for key in list(self._engines):
            self.shutdown(key)


__all__ = ["Generators"]
