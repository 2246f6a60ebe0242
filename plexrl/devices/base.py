"""The description of a device (`Device`, `Shape`), the constants of PlexRL's device arithmetic, and the few
functions that look at the machine (`describe`, `visible_gpus`, `host_available`). Part of `plexrl.devices`."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

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


def _nvidia_smi(*args: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def parse_gpu_query(text: str) -> dict[str, Device]:
    """`nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.free,compute_cap --format=csv,noheader,
    nounits` as Devices, by index and by UUID (the two names `CUDA_VISIBLE_DEVICES` takes).

    >>> g = parse_gpu_query("0, GPU-ab12, NVIDIA H200, 143771, 143000, 9.0")
    >>> g["0"].total // 2**20, g["GPU-ab12"].capability, g["0"].name
    (143771, (9, 0), 'NVIDIA H200')
    """
    out: dict[str, Device] = {}
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6:
            continue
        index, uuid, name, total, free, cap = parts
        major, _, minor = cap.partition(".")
        dev = Device("cuda", int(index), int(total) * MiB, int(free) * MiB, (int(major), int(minor or 0)), name)
        out[index] = out[uuid] = dev
    return out


def query_gpus() -> dict[str, Device]:
    """This machine's GPUs as they are now, by index and UUID, without creating a CUDA context (`nvidia-smi`;
    where it is missing, torch's device properties, by index, free taken as total); {} where there is none.
    `index` is the machine's numbering (a service's process sees its one GPU as 0)."""
    fields = "index,uuid,name,memory.total,memory.free,compute_cap"
    text = _nvidia_smi(f"--query-gpu={fields}", "--format=csv,noheader,nounits")
    if text:
        return parse_gpu_query(text)
    import torch  # no nvidia-smi: torch's device properties; the free memory is then taken as the total

    if not torch.cuda.is_available():
        return {}
    out = {}
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out[str(i)] = Device("cuda", i, int(p.total_memory), int(p.total_memory), (p.major, p.minor), p.name)
    return out


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs this machine offers to PlexRL, as `CUDA_VISIBLE_DEVICES` names them, without creating a CUDA
    context (`nvidia-smi -L`): this process's own `CUDA_VISIBLE_DEVICES` when it is set, else every GPU's index.
    [] where there is none."""
    env = os.environ if environ is None else environ
    own = env.get("CUDA_VISIBLE_DEVICES")
    if own is not None:
        return [g.strip() for g in own.split(",") if g.strip() and not g.strip().startswith("-")]
    out = _nvidia_smi("-L")
    if out is None:  # no nvidia-smi: torch's count (no CUDA context is made for it)
        import torch

        return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return [str(i) for i, line in enumerate(line for line in out.splitlines() if line.startswith("GPU "))]


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
