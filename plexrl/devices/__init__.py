"""Every decision PlexRL makes about a device, in one place: plain functions over a small frozen description of
one device (`Device`: kind, index, total and free bytes, compute capability, name), which the tests build by
hand. Nothing here allocates, builds an engine or starts a process; the callers (the services, the vLLM engines,
the executors, the cluster loader) ask and carry out. Only `describe`, `visible_gpus` and `configure_process`
touch the machine, and each is a thin shell around the pure functions.

What is decided here (docs/gpu.md has the arithmetic and the reasons):

- the vLLM engine's arguments (`vllm_args`): on CPU fp32 and eager (vLLM's CPU build, tested against the torch
  engine token for token); on CUDA the job's `model.dtype` (bf16 by default there), CUDA graphs for decode
  (`cudagraph_mode: FULL_DECODE_ONLY`, no torch.compile: nothing slow to build), sleep mode, and a
  `gpu_memory_utilization` computed from what the engine needs (`vllm_need`): vLLM refuses to start unless
  `utilization x total` bytes are free, so its default 0.9 fails as soon as a trainer shares the GPU. A LoRA
  engine on CUDA never runs fp32: vLLM's LoRA kernels take fp16/bf16 only (`vllm_problem`);
- what an idle vLLM engine becomes (`idle_engine`): on CUDA it sleeps (level 2 for a full-weights engine, whose
  weights are reloaded from the next job anyway; level 1 for a LoRA engine when host memory holds its base)
  instead of being shut down and rebuilt: in-process vLLM does not give its memory back on shutdown;
- which GPU each service and each rank uses, and each worker's environment (`service_gpus`, `worker_env`):
  one GPU per worker through `CUDA_VISIBLE_DEVICES` (the CPU pool sees none), `services.devices` or the visible
  GPUs in order, refused when there are fewer GPUs than services x ranks;
- the default device budget of a CUDA service (`device_split`): the free memory minus the CUDA context, the
  activations of the largest minibatch, the optimizer's temporaries, each vLLM engine's working memory, paused
  KV caches and a fragmentation margin;
- the CUDA environment (`cuda_env`) and the opt-in deterministic mode (`deterministic_env`, `configure_process`).

What a job becomes on a device, read from its config (the defaults a device implies: bf16 and sdpa on CUDA; the
headroom it needs; what a worker group refuses), is `plexrl.job.devices`, one layer up: this package imports
nothing of PlexRL but itself, so the engines and services below the job can use it.
"""

from __future__ import annotations

from plexrl.devices.assignment import (
    build_device,
    configure_process,
    cores_per_service,
    cuda_env,
    deterministic_env,
    inline_devices,
    resolve_device,
    service_gpus,
    worker_env,
    worker_envs,
)
from plexrl.devices.base import (
    CPU,
    CUDA_CONTEXT_BYTES,
    MAX_ASLEEP,
    VLLM_OVERHEAD_BYTES,
    Device,
    DeviceError,
    GiB,
    Shape,
    describe,
    dtype_bytes,
    host_available,
    parse_gpu_query,
    query_gpus,
    visible_gpus,
)
from plexrl.devices.budget import (
    Headroom,
    Split,
    device_split,
    mix_headroom,
    optimizer_temp_bytes,
    services_budget,
    train_activation_bytes,
)
from plexrl.devices.engines import (
    dtype_problem,
    engine_dtype,
    gpu_memory_utilization,
    idle_engine,
    vllm_activation_bytes,
    vllm_args,
    vllm_headroom,
    vllm_need,
    vllm_problem,
)

__all__ = [
    "CPU",
    "CUDA_CONTEXT_BYTES",
    "MAX_ASLEEP",
    "VLLM_OVERHEAD_BYTES",
    "Device",
    "DeviceError",
    "GiB",
    "Headroom",
    "Shape",
    "Split",
    "build_device",
    "configure_process",
    "cores_per_service",
    "cuda_env",
    "describe",
    "deterministic_env",
    "device_split",
    "dtype_bytes",
    "dtype_problem",
    "engine_dtype",
    "gpu_memory_utilization",
    "host_available",
    "idle_engine",
    "inline_devices",
    "mix_headroom",
    "optimizer_temp_bytes",
    "parse_gpu_query",
    "query_gpus",
    "resolve_device",
    "service_gpus",
    "services_budget",
    "train_activation_bytes",
    "visible_gpus",
    "vllm_activation_bytes",
    "vllm_args",
    "vllm_headroom",
    "vllm_need",
    "vllm_problem",
    "worker_env",
    "worker_envs",
]
