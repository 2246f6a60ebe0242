"""Which GPU each service and rank uses, each worker's environment, the settings of a process that uses a
GPU, and where a job's engine is built. Part of `plexrl.devices`."""

from __future__ import annotations

import os
from collections.abc import Sequence

from plexrl.devices.base import CUBLAS_WORKSPACE, DeviceError


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


def resolve_device(name: str, visible: Sequence[str]) -> str:
    """The device of a single job's run (`plexrl run JOB.yaml --device`): "auto" is the first visible GPU when
    there is one, else the CPU; "cuda" is "cuda:0"; "cuda:N" must be visible.

    >>> resolve_device("auto", []), resolve_device("auto", ["2"]), resolve_device("cuda", ["0", "1"])
    ('cpu', 'cuda:0', 'cuda:0')
    """
    if name == "cpu" or (name == "auto" and not visible):
        return "cpu"
    if name in ("auto", "cuda"):
        name = "cuda:0"
    kind, _, index = name.partition(":")
    if kind != "cuda" or not index.isdigit():
        raise DeviceError(f"--device {name!r}: give cpu, cuda, cuda:N or auto")
    if int(index) >= len(visible):
        raise DeviceError(
            f"--device {name}: this machine shows {len(visible)} GPU(s) ({', '.join(visible) or 'none'}); pick one "
            "of them, or --device cpu"
        )
    return name


def cores_per_service(kind: str, threads: int | None) -> int:
    """Cores a pinned service worker gets (`pin_cores`): its torch threads (`services.threads`, default 1); on
    CUDA at least 2, since the thread that launches kernels shares them with the background moves, Dask's event
    loop and the driver's own threads (one core made background swaps steal launch time).

    >>> cores_per_service("cpu", None), cores_per_service("cuda", None), cores_per_service("cuda", 4)
    (1, 2, 4)
    """
    return max(threads or 1, 2 if kind == "cuda" else 1)


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


def worker_envs(
    kind: str, services: int, ranks: int, named: Sequence[str] | None, visible: Sequence[str], *, deterministic: bool
) -> dict[str, dict[str, str]]:
    """The environment of every worker of a local Dask cluster, by worker name (`service-I`, `service-I-rankR`,
    `cpu-0`): on CUDA each service rank sees its GPU (`service_gpus`), the CPU pool none (`worker_env`).

    >>> worker_envs("cuda", 2, 1, None, ["0", "1"], deterministic=False)["service-1"]["CUDA_VISIBLE_DEVICES"]
    '1'
    """
    cuda = kind == "cuda"
    gpus = service_gpus(services, ranks, named, visible) if cuda else None
    env = {}
    for i in range(services):
        for r in range(ranks):
            gpu = gpus[i][r] if gpus is not None else ""
            env[f"service-{i}" + (f"-rank{r}" if r else "")] = worker_env(gpu, cuda=cuda, deterministic=deterministic)
    env["cpu-0"] = worker_env(None, cuda=cuda)
    return env


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


def build_device(device: str, tier: str) -> str:
    """Where a job's engine is built on a service whose device is `device`, when the planner admits its state
    to `tier`: on the device for "device"; on the host ("cpu") for "host" or "disk". The planner admits a job
    off device exactly when the device has no room for it, so building it there first would run out of memory;
    its tensors go to their tier from the host and reach the device only when the planner brings them in.

    >>> build_device("cuda:0", "device"), build_device("cuda:0", "host")
    ('cuda:0', 'cpu')
    """
    return device if tier == "device" else "cpu"
