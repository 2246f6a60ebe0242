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
- the job defaults a device implies (`job_defaults`: bf16 and sdpa on CUDA where the job left them unset), the
  CUDA environment (`cuda_env`) and the opt-in deterministic mode (`deterministic_env`, `configure_process`).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from plexrl.config import JobConfig

log = logging.getLogger(__name__)

GiB = 2**30
MiB = 2**20

# -- constants of the arithmetic (docs/gpu.md, "The memory of a GPU") ---------------------------------------
CUDA_CONTEXT_BYTES = 1 * GiB  # a process's CUDA context, cuBLAS/cuDNN handles and workspaces (0.5-1 GiB seen)
VLLM_OVERHEAD_BYTES = 1 * GiB  # per vLLM engine beyond weights, KV and activations: CUDA graph pool, sampler
FRAGMENTATION_SHARE = 0.05  # of the total: the caching allocator's rounding and fragmentation
MAX_UTILIZATION = 0.95  # the most of a GPU one vLLM engine is given
VLLM_MAX_NUM_SEQS = 256  # sequences a vLLM step runs at most (set on CUDA: its default depends on the GPU)
SAMPLER_COPIES = 4  # fp32 [seqs, vocab] copies vLLM's sampler holds at once (logits, processed, probs, sort)
LOGIT_COPIES = 3  # fp32 [rows, L, vocab] copies a train step holds beside the model's logits (upcast, log_softmax, exp)
MAX_ASLEEP = 2  # idle vLLM engines a service keeps asleep; beyond, the one idle longest is shut down
DEFAULT_MINIBATCH_ROWS = 64  # rows of a train minibatch when the pipeline does not say
CUBLAS_WORKSPACE = ":4096:8"  # what torch's deterministic mode asks of cuBLAS (CUDA >= 10.2)


class DeviceError(ValueError):
    """A device setting that cannot work (too few GPUs, an engine that does not fit, a dtype the device lacks);
    the message names the numbers and the fix."""


@dataclass(frozen=True, slots=True)
class Device:
    """What PlexRL needs to know of one device. `total` and `free` in bytes (0 on CPU: not budgeted here);
    `capability` the CUDA compute capability ((0, 0) on CPU); `index` the CUDA index inside the process that
    uses it (0 in a worker that sees one GPU)."""

    kind: Literal["cpu", "cuda"] = "cpu"
    index: int = 0
    total: int = 0
    free: int = 0
    capability: tuple[int, int] = (0, 0)
    name: str = "cpu"

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def bf16(self) -> bool:
        """bfloat16 kernels: CPUs (torch's), and GPUs from compute capability 8.0 (Ampere) on."""
        return not self.cuda or self.capability >= (8, 0)

    @property
    def torch_name(self) -> str:
        return f"cuda:{self.index}" if self.cuda else "cpu"


CPU = Device()


def describe(device: str) -> Device:
    """The device `device` ("cpu", "cuda", "cuda:1") as it is now (CUDA: `mem_get_info`, the properties)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return CPU
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    props = torch.cuda.get_device_properties(index)
    return Device("cuda", index, int(total), int(free), (props.major, props.minor), props.name)


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs this machine offers to PlexRL, as `CUDA_VISIBLE_DEVICES` names them, without creating a CUDA
    context (`nvidia-smi -L`): this process's own `CUDA_VISIBLE_DEVICES` when it is set, else every GPU's index.
    [] where there is none."""
    env = os.environ if environ is None else environ
    own = env.get("CUDA_VISIBLE_DEVICES")
    if own is not None:
        return [g.strip() for g in own.split(",") if g.strip() and not g.strip().startswith("-")]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(line for line in out.splitlines() if line.startswith("GPU "))]


# -- which GPU runs what ------------------------------------------------------------------------------------
def service_gpus(services: int, ranks: int, named: Sequence[str] | None, visible: Sequence[str]) -> list[list[str]]:
    """The GPU of each rank of each service (`[service][rank]`, as `CUDA_VISIBLE_DEVICES` names it): `named`
    (`services.devices`) in order, else the visible GPUs in order; service i rank r takes GPU i * ranks + r.
    Refused when there are fewer GPUs than services x ranks, or a GPU is named twice.

    >>> service_gpus(2, 1, None, ["0", "1", "2"])
    [['0'], ['1']]
    >>> service_gpus(1, 2, ["3", "1"], ["0", "1", "2", "3"])
    [['3', '1']]
    """
    need = services * ranks
    pool = list(named) if named is not None else list(visible)
    where = "services.devices" if named is not None else "the visible GPUs"
    if len(set(pool)) < len(pool):
        dup = sorted({g for g in pool if pool.count(g) > 1})
        raise DeviceError(f"{where} name GPU {', '.join(dup)} twice; each service rank needs a GPU of its own")
    if len(pool) < need:
        raise DeviceError(
            f"{services} service(s) x {ranks} rank(s) need {need} GPUs, but {where} are {len(pool)} "
            f"({', '.join(pool) or 'none'}); lower services.count or services.ranks, or list more GPUs in "
            "services.devices (CUDA_VISIBLE_DEVICES names)"
        )
    return [[pool[i * ranks + r] for r in range(ranks)] for i in range(services)]


def inline_devices(kind: str, services: int, named: Sequence[str] | None, visible: Sequence[str]) -> list[str]:
    """The torch device of each service of an in-process executor: all "cpu", or one GPU each (`cuda:K`, K the
    GPU's index in this process: its position in the visible list)."""
    if kind != "cuda":
        return ["cpu"] * services
    gpus = [g[0] for g in service_gpus(services, 1, named, visible)]
    where = list(visible)
    missing = [g for g in gpus if g not in where]
    if missing:
        raise DeviceError(
            f"GPU {', '.join(missing)} is not visible to this process (CUDA_VISIBLE_DEVICES: {', '.join(where)}); "
            "name visible GPUs in services.devices"
        )
    return [f"cuda:{where.index(g)}" for g in gpus]


def cuda_env(deterministic: bool = False) -> dict[str, str]:
    """The CUDA settings of every process that uses a GPU (set before CUDA starts in it):
    - `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`: states of different sizes come and go all the time;
      growable segments keep the allocator from fragmenting (vLLM's sleep-mode pool turns it off around itself);
    - `TORCH_NCCL_ASYNC_ERROR_HANDLING=2` (clean up only): a failed or timed-out NCCL collective aborts its
      communicator and raises in the caller, so the worker group's own failure handling sees it (a broken
      group, re-formed) instead of the watchdog killing the worker with every job on it (the default, 3);
    - with `deterministic`: `deterministic_env()`."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    if deterministic:
        env.update(deterministic_env())
    return env


def deterministic_env() -> dict[str, str]:
    """What deterministic mode sets in the environment: cuBLAS's fixed workspace (torch's deterministic mode
    requires it on CUDA) and vLLM's batch-invariant kernels (a request's tokens do not depend on what else is
    in its batch: Hopper or newer)."""
    return {"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE, "VLLM_BATCH_INVARIANT": "1"}


def worker_env(gpu: str | None, *, cuda: bool, deterministic: bool = False) -> dict[str, str]:
    """The environment of one Dask worker: a service rank's worker sees its one GPU (`gpu`) and gets the CUDA
    settings; the CPU pool (`gpu` None) sees no GPU at all. On a CPU cluster (`cuda` False) service workers
    keep the machine's environment; the CPU pool still sees no GPU.

    >>> worker_env("3", cuda=True)["CUDA_VISIBLE_DEVICES"], worker_env(None, cuda=True)
    ('3', {'CUDA_VISIBLE_DEVICES': ''})
    """
    if gpu is None:
        return {"CUDA_VISIBLE_DEVICES": ""}
    if not cuda:
        return {}
    return {"CUDA_VISIBLE_DEVICES": gpu, **cuda_env(deterministic)}


def configure_process(kind: str, deterministic: bool = False) -> None:
    """Apply the device settings to THIS process (an in-process executor, `plexrl run JOB.yaml`): the CUDA
    environment (kept where the user set a variable; only effective before CUDA starts here) and, with
    `deterministic`, torch's deterministic algorithms (ops without a deterministic kernel warn, they are listed
    in `torch.use_deterministic_algorithms`' documentation)."""
    if kind == "cuda":
        for k, v in cuda_env(deterministic).items():
            os.environ.setdefault(k, v)
    if deterministic:
        import torch

        for k, v in deterministic_env().items():
            os.environ.setdefault(k, v)
        torch.use_deterministic_algorithms(True, warn_only=True)


# -- what a job becomes on a device -------------------------------------------------------------------------
def job_defaults(cfg: JobConfig, kind: str) -> JobConfig:
    """`cfg` with the defaults of a device where the job left them unset: on CUDA `model.dtype: bfloat16`
    (fp32 masters and moments: the optimizer never steps bf16 weights) and `model.attention: sdpa`; on CPU
    the config as it is. A value the job sets is kept."""
    if kind != "cuda":
        return cfg
    update: dict[str, Any] = {}
    if "dtype" not in cfg.model.model_fields_set:
        update["dtype"] = "bfloat16"
    if "attention" not in cfg.model.model_fields_set:
        update["attention"] = "sdpa"
    if not update:
        return cfg
    model = cfg.model.model_copy(update=update)
    return cfg.model_copy(update={"model": model})


def build_device(device: str, tier: str) -> str:
    """Where a job's engine is built on a service whose device is `device`, when the planner admits its state
    to `tier`: on the device for "device"; on the host ("cpu") for "host" or "disk". The planner admits a job
    off device exactly when the device has no room for it, so building it there first would run out of memory;
    its tensors go to their tier from the host and reach the device only when the planner brings them in.

    >>> build_device("cuda:0", "device"), build_device("cuda:0", "host")
    ('cuda:0', 'cpu')
    """
    return device if tier == "device" else "cpu"


def host_available() -> int | None:
    """Bytes of host memory available now (`MemAvailable` of /proc/meminfo), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


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


@dataclass(frozen=True, slots=True)
class Shape:
    """The sizes of a decoder model that its memory depends on (from its HF `config.json`)."""

    params: int
    hidden: int
    intermediate: int
    layers: int
    vocab: int

    @classmethod
    def of(cls, config: Mapping[str, Any], params: int) -> Shape:
        hidden = int(config.get("hidden_size", 0))
        return cls(params, hidden, int(config.get("intermediate_size", 4 * hidden)),
                   int(config.get("num_hidden_layers", 1)), int(config.get("vocab_size", 0)))  # fmt: skip


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


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


# -- the device budget --------------------------------------------------------------------------------------
def train_activation_bytes(shape: Shape, rows: int, length: int, dtype: str, checkpointing: bool = False) -> int:
    """Peak activations of one train minibatch of `rows` x `length` tokens: the logits [rows, L, vocab] in the
    model's dtype plus `LOGIT_COPIES` fp32 copies (the upcast, log_softmax and its exp for the entropy in
    `token_logprobs`), and the layers' saved activations (~(8 hidden + 3 intermediate) values a token a layer;
    one layer with gradient checkpointing)."""
    tokens = rows * length
    logits = tokens * shape.vocab * (dtype_bytes(dtype) + LOGIT_COPIES * 4)
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


__all__ = [
    "CPU",
    "Device",
    "DeviceError",
    "Shape",
    "Split",
    "build_device",
    "configure_process",
    "cuda_env",
    "describe",
    "device_split",
    "engine_dtype",
    "gpu_memory_utilization",
    "host_available",
    "idle_engine",
    "inline_devices",
    "job_defaults",
    "service_gpus",
    "visible_gpus",
    "vllm_args",
    "vllm_headroom",
    "vllm_need",
    "vllm_problem",
    "worker_env",
]
