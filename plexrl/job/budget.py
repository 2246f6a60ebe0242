"""What a job will need on a service's device, from its validated config alone (before it is prepared: no
model is built, no task generated). A cluster's budget check (`plexrl.cluster.load_cluster`) compares it with
`services.device_memory`; the planner admits a prepared job by `JobSpec.state_bytes()` and
`JobSpec.engine()`, the same sizes (`plexrl.sizes`) read from the prepared model's files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from plexrl.graph import PipelineGraph
from plexrl.job.checks import vllm_problem
from plexrl.job.config import JobConfig, auto_engine_rule
from plexrl.job.generation import generation_sizes
from plexrl.job.load import LoadedJob
from plexrl.job.tasks import tokenizer_size
from plexrl.sizes import built_weight_bytes, estimate_state_bytes, lora_state_bytes, model_bytes, state_parts


@dataclass(frozen=True, slots=True)
class DeviceNeed:
    """A job's device bytes before it runs: its own `state` (what the StateManager moves) and the `engine` it
    shares with other jobs on a service (a vLLM engine, a LoRA base), with words for both."""

    state: int
    engine: int
    holds: str  # what the state is made of, e.g. "weights, 2 AdamW moments"
    shared: str  # what the engine bytes are for, e.g. "its vLLM engine"


def estimate_engine_bytes(cfg: JobConfig, graph: PipelineGraph | None = None) -> int:
    """Device bytes of the vLLM engine the job's rollouts will use (one weight copy in the engine's dtype + the
    KV cache, sized as `plexrl.job.generation` sizes it before the data is measured; shared by the
    same-architecture jobs of a service), 0 when they run on the torch engine."""
    from plexrl.job.devices import vllm_weight_dtype

    small = cfg.engine == "auto" and auto_engine_rule(estimate_weight_bytes(cfg) // 4, cfg.vllm.auto_min_params)
    if cfg.engine == "torch" or small or (cfg.engine == "auto" and vllm_problem(cfg.model)):
        return 0
    half = vllm_weight_dtype(cfg.model.dtype) != "float32"
    return estimate_weight_bytes(cfg) // (2 if half else 1) + estimate_kv_bytes(cfg, graph)


def estimate_kv_bytes(cfg: JobConfig, graph: PipelineGraph | None) -> int:
    """The KV cache the job's vLLM engine gets, known before the job is prepared (no data measured)."""
    model_dir = Path(cfg.model.path) if cfg.model.path is not None else None
    return generation_sizes(cfg, graph, model_dir).kv_cache_bytes


def estimate_weight_bytes(cfg: JobConfig) -> int:
    """fp32 bytes of the job's model weights (for `model.path`: its parameters, whatever dtype the files hold)."""
    m = cfg.model
    if m.path is not None:
        try:
            return model_bytes(Path(m.path))
        except FileNotFoundError:  # no safetensors weights: preparing the job says so
            return 0
    vocab = tokenizer_size(cfg.task.name)  # a model built for the job's task
    return built_weight_bytes(vocab, m.layers, m.hidden, m.intermediate, m.tie_embeddings)


def device_need(job: LoadedJob) -> DeviceNeed:
    """The job's state and shared-engine bytes as `JobSpec.state_bytes()` and `JobSpec.engine()` will count
    them once it is prepared: a LoRA job with a `model.path` holds its adapter and moments, and shares its base
    (and a LoRA-enabled vLLM engine when it rolls out on vLLM)."""
    from plexrl.engines.vllm_lora import lora_engine_bytes

    cfg = job.config
    state = estimate_state_bytes(estimate_weight_bytes(cfg), job.graph, cfg.model.dtype)  # bf16: 14 B a parameter
    engine = estimate_engine_bytes(cfg, job.graph)
    lora = cfg.model.lora
    if lora is None or cfg.model.path is None:
        return DeviceNeed(state, engine, ", ".join(state_parts(job.graph)), "its vLLM engine")
    path, kv = Path(cfg.model.path), estimate_kv_bytes(cfg, job.graph)
    shared = "its base" + (" and its vLLM engine" if engine else "")  # as JobSpec.engine() counts them
    from plexrl.job.devices import vllm_weight_dtype

    vllm = lora_engine_bytes(path, lora.r, kv, vllm_weight_dtype(cfg.model.dtype)) if engine else 0
    return DeviceNeed(
        lora_state_bytes(path, lora.r, list(lora.target_modules)),
        model_bytes(path, cfg.model.dtype) + vllm,
        "adapter, 2 AdamW moments",
        shared,
    )


__all__ = ["DeviceNeed", "device_need", "estimate_engine_bytes", "estimate_kv_bytes", "estimate_weight_bytes"]
