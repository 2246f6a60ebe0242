"""The default device budget of a CUDA service and the headroom a job mix needs beside it. Part of
`plexrl.devices`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plexrl.devices.base import (
    CUDA_CONTEXT_BYTES,
    DEFAULT_MINIBATCH_ROWS,
    FRAGMENTATION_SHARE,
    LOGIT_COPIES,
    Device,
    DeviceError,
    GiB,
    Shape,
    dtype_bytes,
)

if TYPE_CHECKING:
    from plexrl.graph import PipelineGraph
    from plexrl.job.config import JobConfig


def job_defaults(cfg: JobConfig, kind: str, *, group: bool = False) -> JobConfig:
    """`cfg` with the defaults of a device where the job left them unset: on CUDA `model.dtype: bfloat16`
    (fp32 masters and moments: the optimizer never steps bf16 weights; not on a worker group, `group`, whose
    FSDP engine trains in fp32) and `model.attention: sdpa` (eager materialises [N, heads, L, L]); on CPU the
    config as it is. A value the job sets is kept."""
    if kind != "cuda":
        return cfg
    update: dict[str, Any] = {}
    if "dtype" not in cfg.model.model_fields_set and not group:
        update["dtype"] = "bfloat16"
    if "attention" not in cfg.model.model_fields_set:
        update["attention"] = "sdpa"
    if not update:
        return cfg
    model = cfg.model.model_copy(update=update)
    return cfg.model_copy(update={"model": model})


def minibatch_rows(graph: PipelineGraph) -> tuple[int, int]:
    """(rows of the largest train minibatch, rows of one generation) of a pipeline, from its nodes' parameters:
    prompts drawn (`batch_size`) x samples each (`n`), over the fewest `minibatches` of a train node;
    `DEFAULT_MINIBATCH_ROWS` where the pipeline does not say."""

    def ints(name: str) -> list[int]:
        out = []
        for n in graph.nodes:
            v = getattr(n.params, name, None)
            if v is None and name == "minibatches":
                v = getattr(getattr(n.params, "optimiser", None), "minibatches", None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                out.append(v)
        return out

    prompts, samples, minibatches = ints("batch_size"), ints("n"), ints("minibatches")
    if not prompts:
        return DEFAULT_MINIBATCH_ROWS, DEFAULT_MINIBATCH_ROWS
    generation = max(prompts) * max(samples, default=1)
    return -(-generation // min(minibatches, default=1)), generation


@dataclass(frozen=True, slots=True)
class Headroom:
    """What one job needs on a device beside its state (bytes): its largest minibatch's activations, its
    optimizer's temporaries, the KV cache of a paused generation (sliced jobs), and its vLLM engine's working
    memory (`vllm_headroom`; keyed by engine: jobs of one key share it)."""

    activations: int = 0
    optimizer: int = 0
    paused_kv: int = 0
    vllm: int = 0
    vllm_key: str = ""


def job_headroom(
    cfg: JobConfig, graph: PipelineGraph, shape: Shape, length: int, *, vllm: bool, vllm_key: str = ""
) -> Headroom:
    """The `Headroom` of a job whose model has `shape` and whose sequences reach `length` tokens (the scored
    response: its largest `max_new_tokens`); `vllm`: its rollouts run on vLLM. A LoRA job's optimizer steps
    megabytes (its adapter): counted 0."""
    from plexrl.devices.engines import engine_dtype, vllm_headroom
    from plexrl.job.checks import response_budget

    m = cfg.model
    response = response_budget(graph)
    rows, generation = minibatch_rows(graph)
    optimizer = 0 if m.lora is not None else optimizer_temp_bytes(shape, m.dtype)
    paused = generation * length * 2 * shape.layers * shape.hidden * dtype_bytes(m.dtype) if cfg.slices else 0
    engine = vllm_headroom(shape, engine_dtype(Device("cuda"), m.dtype), max(length, 4096)) if vllm else 0
    scored = response[0] if response is not None else None
    activations = train_activation_bytes(shape, rows, length, m.dtype, m.gradient_checkpointing, scored)
    return Headroom(activations, optimizer, paused, engine, vllm_key if vllm else "")


def mix_headroom(jobs: list[Headroom]) -> dict[str, int]:
    """What a service running any of `jobs` keeps free beside its budget (`device_split`'s keywords): one
    node runs at a time, so the largest activations and optimizer temporaries; every paused generation may
    wait at once; one working memory per distinct vLLM engine (asleep or awake)."""
    engines = {h.vllm_key: h.vllm for h in jobs if h.vllm}
    return {
        "activations": max((h.activations for h in jobs), default=0),
        "optimizer": max((h.optimizer for h in jobs), default=0),
        "paused_kv": sum(h.paused_kv for h in jobs),
        "vllm": sum(engines.values()),
    }


def train_activation_bytes(
    shape: Shape, rows: int, length: int, dtype: str, checkpointing: bool = False, scored: int | None = None
) -> int:
    """Peak activations of one train minibatch of `rows` x `length` tokens: the logits [rows, scored, vocab] of
    the `scored` columns (the response: `scored_logprobs` runs the head there only; None: all `length`) in the
    model's dtype plus `LOGIT_COPIES` fp32 copies (the upcast, log_softmax and its exp for the entropy in
    `token_logprobs`), and the layers' saved activations (~(8 hidden + 3 intermediate) values a token a layer;
    one layer with gradient checkpointing)."""
    tokens = rows * length
    logits = rows * min(scored or length, length) * shape.vocab * (dtype_bytes(dtype) + LOGIT_COPIES * 4)
    layers = 1 if checkpointing else shape.layers
    return logits + layers * tokens * (8 * shape.hidden + 3 * shape.intermediate) * dtype_bytes(dtype)


def optimizer_temp_bytes(shape: Shape, dtype: str) -> int:
    """Device bytes a train step holds beyond the job's state: the gradients (in the model's dtype, plus their
    fp32 copy on the masters for bf16) and AdamW's foreach temporaries (about one fp32 copy of the parameters)."""
    grads = shape.params * (dtype_bytes(dtype) + (4 if dtype != "float32" else 0))
    return grads + shape.params * 4


@dataclass(frozen=True, slots=True)
class Split:
    """How PlexRL divides one GPU (bytes): `budget` is the device tier the planner fills with job states and
    the shared engines it reserves (vLLM weights and KV caches, LoRA bases); the rest is headroom no state may
    take."""

    total: int
    free: int
    context: int
    activations: int
    optimizer: int
    vllm: int
    paused_kv: int
    fragmentation: int
    budget: int

    def describe(self) -> str:
        parts = ["context", "activations", "optimizer", "vllm", "paused_kv", "fragmentation"]
        held = ", ".join(f"{p} {getattr(self, p) / GiB:.2f}" for p in parts)
        return (
            f"device budget {self.budget / GiB:.2f} GiB = free {self.free / GiB:.2f} of {self.total / GiB:.2f} "
            f"GiB minus headroom ({held} GiB)"
        )


def device_split(
    device: Device,
    *,
    activations: int = 0,
    optimizer: int = 0,
    vllm: int = 0,
    paused_kv: int = 0,
    context: int = CUDA_CONTEXT_BYTES,
) -> Split:
    """The default device budget of a CUDA service: what is free now (`device.free`, from `mem_get_info`) minus
    the headroom nothing the planner places may use: the CUDA context of the service's process (`context`; 0
    when measured after it exists), the largest train minibatch's `activations` (`train_activation_bytes`), the
    optimizer's temporaries (`optimizer_temp_bytes`), the vLLM engines' working memory beyond the weights and
    KV caches the planner reserves (`vllm`: `vllm_headroom` of each engine the service may hold), the KV caches
    of paused generations (`paused_kv`), and `FRAGMENTATION_SHARE` of the total. Raises `DeviceError` when
    nothing is left.

    >>> s = device_split(Device("cuda", total=100 * GiB, free=100 * GiB), activations=4 * GiB)
    >>> round(s.budget / GiB, 2)
    90.0
    """
    frag = int(device.total * FRAGMENTATION_SHARE)
    budget = device.free - context - activations - optimizer - vllm - paused_kv - frag
    split = Split(device.total, device.free, context, activations, optimizer, vllm, paused_kv, frag, budget)
    if budget <= 0:
        raise DeviceError(
            f"{device.name}: nothing is left for job states: {split.describe()}; free the GPU, use smaller "
            "minibatches or models, or set services.device_memory yourself"
        )
    return split
