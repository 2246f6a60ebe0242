"""The vLLM engine's arguments on a device, and what becomes of an idle engine. Part of `plexrl.devices`."""

from __future__ import annotations

import math
from typing import Any, Literal

from plexrl.devices.base import (
    MAX_UTILIZATION,
    SAMPLER_COPIES,
    VLLM_MAX_NUM_SEQS,
    VLLM_OVERHEAD_BYTES,
    Device,
    DeviceError,
    GiB,
    Shape,
    dtype_bytes,
)


def dtype_problem(device: Device, dtype: str) -> str | None:
    """Why `dtype` cannot run on `device`, or None."""
    if dtype == "bfloat16" and not device.bf16:
        return (
            f"{device.name} (compute capability {device.capability[0]}.{device.capability[1]}) has no bfloat16 "
            "kernels; set model.dtype: float32"
        )
    return None


def engine_dtype(device: Device, model_dtype: str) -> str:
    """The vLLM engine's dtype: the job's on CUDA (its behaviour log-probs then come from the weights it
    trains, in the same arithmetic); fp32 on CPU (the CPU build's tested setting)."""
    return model_dtype if device.cuda else "float32"


def vllm_problem(device: Device, model_dtype: str, *, lora: bool) -> str | None:
    """Why vLLM cannot generate for a job of `model_dtype` on a device of `device.kind` (a LoRA job when
    `lora`), or None: vLLM's CUDA LoRA kernels (its Triton shrink/expand ops) assert fp16/bf16 activations and
    weights, and the engine would compute in the job's fp32. (Whether the GPU itself has the dtype is
    `dtype_problem`.)"""
    if device.cuda and lora and engine_dtype(device, model_dtype) == "float32":
        return (
            "vLLM's CUDA LoRA kernels take fp16/bf16 only, and this LoRA job's model.dtype is float32; set "
            "model.dtype: bfloat16"
        )
    return None


def vllm_activation_bytes(shape: Shape, dtype: str, batched_tokens: int, seqs: int = VLLM_MAX_NUM_SEQS) -> int:
    """Peak working memory of one vLLM step (its weights and KV cache apart): the hidden states of
    `batched_tokens` tokens through one layer (residual, norm, q/k/v, attention out: ~6 x hidden; gate, up and
    their product: 3 x intermediate) in the engine's dtype, and the sampler's fp32 [seqs, vocab] copies."""
    layer = batched_tokens * (6 * shape.hidden + 3 * shape.intermediate) * dtype_bytes(dtype)
    return layer + SAMPLER_COPIES * seqs * shape.vocab * 4


def vllm_headroom(shape: Shape, dtype: str, batched_tokens: int) -> int:
    """What a vLLM engine uses beyond what the planner reserves for it (weights and KV cache): one step's
    activations and `VLLM_OVERHEAD_BYTES`."""
    return vllm_activation_bytes(shape, dtype, batched_tokens) + VLLM_OVERHEAD_BYTES


def vllm_need(shape: Shape, dtype: str, kv_cache_bytes: int, batched_tokens: int, lora_bytes: int = 0) -> int:
    """Device bytes one vLLM engine needs: weights in its dtype, the KV cache, LoRA slots and its headroom
    (`vllm_headroom`)."""
    weights = shape.params * dtype_bytes(dtype)
    return weights + kv_cache_bytes + lora_bytes + vllm_headroom(shape, dtype, batched_tokens)


def gpu_memory_utilization(device: Device, need: int) -> float:
    """The `gpu_memory_utilization` that gives a vLLM engine `need` bytes of `device`: vLLM starts only when
    `ceil(utilization x total)` bytes are free (`vllm.v1.worker.utils.request_memory`), so it must not ask for
    more than what is free beside the trainer. Refused when the engine does not fit.

    >>> gpu_memory_utilization(Device("cuda", total=100 * GiB, free=60 * GiB), 10 * GiB)
    0.1
    """
    if need > MAX_UTILIZATION * device.total:
        raise DeviceError(
            f"the vLLM engine needs {need / GiB:.1f} GiB, more than {MAX_UTILIZATION:.0%} of {device.name}'s "
            f"{device.total / GiB:.1f} GiB; lower vllm.kv_cache_mb or use a smaller model"
        )
    util = math.ceil(need / device.total * 1e4) / 1e4
    if math.ceil(util * device.total) > device.free:
        raise DeviceError(
            f"the vLLM engine needs {need / GiB:.1f} GiB of {device.name} but only {device.free / GiB:.1f} of "
            f"{device.total / GiB:.1f} GiB are free (trainer states and other engines hold the rest); lower "
            "vllm.kv_cache_mb or services.device_memory, or give the service a GPU of its own"
        )
    return util


def vllm_args(
    device: Device,
    *,
    dtype: str,
    shape: Shape,
    kv_cache_bytes: int,
    batched_tokens: int,
    lora_bytes: int = 0,
    lora: bool = False,
) -> dict[str, Any]:
    """The device's part of a `vllm.LLM`'s arguments (`SharedLLM` adds the rest: model, lengths, prefix caching,
    seed, log-probs mode). CPU: fp32, eager. CUDA: the job's dtype (`engine_dtype`), CUDA graphs for decode
    steps only (full graphs, no torch.compile: nothing slow to build, and the launch-bound decode of small
    models is what they speed up), sleep mode (`idle_engine`), at most `VLLM_MAX_NUM_SEQS` sequences a step,
    and a `gpu_memory_utilization` from `vllm_need` (`gpu_memory_utilization`). A LoRA engine's adapters
    compute in its dtype. Raises `DeviceError` where vLLM cannot run (`vllm_problem`) or does not fit."""
    if not device.cuda:
        return {"dtype": "float32", "enforce_eager": True}
    if device.index != 0:
        raise DeviceError(
            f"vLLM in-process builds its engine on the process's first GPU (cuda:0), and this service is on "
            f"cuda:{device.index}: run each service in a worker of its own (driver: dask), which shows each its "
            "GPU as cuda:0, or set engine: torch"
        )
    model_dtype = dtype
    why = vllm_problem(device, model_dtype, lora=lora) or dtype_problem(device, engine_dtype(device, model_dtype))
    if why:
        raise DeviceError(why)
    dtype = engine_dtype(device, model_dtype)
    need = vllm_need(shape, dtype, kv_cache_bytes, batched_tokens, lora_bytes)
    args: dict[str, Any] = {
        "dtype": dtype,
        "enforce_eager": False,
        "compilation_config": {
            "mode": 0,  # CompilationMode.NONE
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "max_cudagraph_capture_size": VLLM_MAX_NUM_SEQS,
        },
        "max_num_seqs": VLLM_MAX_NUM_SEQS,
        "gpu_memory_utilization": gpu_memory_utilization(device, need),
        "enable_sleep_mode": True,
    }
    if lora:
        args["lora_dtype"] = dtype
    return args


IdleAction = Literal["shutdown", "sleep1", "sleep2"]


def idle_engine(device: Device, *, lora: bool, weight_bytes: int, host_free: int | None) -> IdleAction:
    """What becomes of a vLLM engine no job on the service uses any more. CPU: shut down (vLLM's CPU build has
    no sleep mode; in-process shutdown frees its memory there). CUDA: it sleeps and wakes for the next job of
    its key, since in-process vLLM keeps its GPU memory after shutdown (vLLM #21073): level 2 (weights and KV
    dropped) for a full-weights engine, whose weights the next job loads anyway; a LoRA engine keeps its base
    (level 1: offloaded to pinned host memory) when `host_free` (bytes; None: unknown) holds it, else level 2
    and its base is read back from its files on waking.

    >>> idle_engine(Device("cuda", total=GiB), lora=True, weight_bytes=2 * GiB, host_free=GiB)
    'sleep2'
    """
    if not device.cuda:
        return "shutdown"
    if lora and (host_free is None or weight_bytes <= host_free):
        return "sleep1"
    return "sleep2"
