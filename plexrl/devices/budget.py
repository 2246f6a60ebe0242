"""The default device budget of a CUDA service and the headroom a job mix needs beside it: arithmetic over
described devices and per-job `Headroom`s (what a job needs is read from its config by `plexrl.job.devices`).
Part of `plexrl.devices`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from plexrl.devices.assignment import service_gpus
from plexrl.devices.base import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION_SHARE,
    LOGIT_COPIES,
    Device,
    DeviceError,
    GiB,
    Shape,
    dtype_bytes,
)

SERVER_HEADROOM_SHARE = 0.10  # of the total: what a server (its jobs unknown at start) keeps beside the budget


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


def services_budget(
    gpus: Mapping[str, Device],
    *,
    services: int,
    ranks: int,
    named: Sequence[str] | None,
    visible: Sequence[str],
    jobs: Sequence[Headroom] | None,
    reserve: int | None = None,
) -> Split:
    """The device split of every rank of every CUDA service: the one with the smallest budget among the
    `device_split`s of the GPUs they get (`service_gpus`), each described in `gpus` (by the name
    `CUDA_VISIBLE_DEVICES` uses). The headroom: `reserve` when given, else what `jobs` need together
    (`mix_headroom`), else (a server, whose jobs come later) `SERVER_HEADROOM_SHARE` of each GPU."""
    splits = []
    for gpu in (g for ranks_of in service_gpus(services, ranks, named, visible) for g in ranks_of):
        if gpu not in gpus:
            raise DeviceError(
                f"GPU {gpu} is not on this machine (nvidia-smi lists {', '.join(sorted(gpus)) or 'none'})"
            )
        dev = gpus[gpu]
        if reserve is not None:
            split = device_split(dev, activations=reserve)
        elif jobs is not None:
            split = device_split(dev, **mix_headroom(list(jobs)))
        else:
            split = device_split(dev, activations=int(dev.total * SERVER_HEADROOM_SHARE))
        splits.append(split)
    return min(splits, key=lambda sp: sp.budget)
