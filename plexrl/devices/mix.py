"""The device budget of a cluster's CUDA services from its GPUs and its job mix (`services_budget`), and what a
worker group refuses (`group_problems`). Read from the validated configs, before anything is built; nothing
here touches a GPU (the GPUs come described: `plexrl.devices.query_gpus`). Part of `plexrl.devices`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from plexrl.devices.base import Device, DeviceError, Shape
from plexrl.devices.budget import Headroom, device_split, job_defaults, job_headroom, mix_headroom
from plexrl.devices.placement import service_gpus

if TYPE_CHECKING:
    from plexrl.graph import PipelineGraph
    from plexrl.job.config import JobConfig
    from plexrl.job.load import LoadedJob

SERVER_HEADROOM_SHARE = 0.10  # of the total: what a server (its jobs unknown at start) keeps beside the budget


def model_dir(cfg: JobConfig) -> Path | None:
    """The job's model directory when it exists already (`model.path`, or a converted `model.pretrained`)."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    if cfg.model.pretrained is not None:
        from plexrl.job.pretrained import pretrained_path

        try:
            return pretrained_path(cfg.model.pretrained, convert=False)
        except (FileNotFoundError, LookupError, ValueError):
            return None
    return None


def job_shape(cfg: JobConfig) -> Shape:
    """The model's sizes: from its `config.json` and weights when it exists, else from the sizes of the model
    the job builds (`model.layers`, `hidden`, ...; the vocabulary of its task's tokenizer)."""
    path = model_dir(cfg)
    if path is not None and (path / "config.json").is_file():
        from plexrl.job.sizes import count_parameters

        config = json.loads((path / "config.json").read_text())
        try:
            params = count_parameters(path)
        except (FileNotFoundError, ValueError):
            params = 0
        return Shape.of(config, params)
    from plexrl.job.sizes import built_weight_bytes
    from plexrl.job.tasks import tokenizer_size

    m = cfg.model
    vocab = tokenizer_size(cfg.task.name)
    params = built_weight_bytes(vocab, m.layers, m.hidden, m.intermediate, m.tie_embeddings) // 4
    return Shape(params, m.hidden, m.intermediate, m.layers, vocab)


def job_length(cfg: JobConfig, graph: PipelineGraph) -> int:
    """The longest sequence (prompt + response) a job's nodes compute on: its generation budget, else the
    model's positions."""
    from plexrl.job.checks import generation_budget

    budget = generation_budget(cfg, graph)
    if budget is not None:
        return budget
    path = model_dir(cfg)
    if path is not None and (path / "config.json").is_file():
        return int(json.loads((path / "config.json").read_text()).get("max_position_embeddings", 2048))
    return cfg.model.max_position


def headroom_of(cfg: JobConfig, graph: PipelineGraph, *, vllm: bool) -> Headroom:
    """`job_headroom` of a validated job; `vllm`: its rollouts will run on vLLM (jobs of one model, dtype and
    KV size share an engine)."""
    key = f"{model_dir(cfg) or cfg.model.model_dump_json()}|{cfg.model.dtype}|{cfg.vllm.kv_cache_mb}"
    return job_headroom(cfg, graph, job_shape(cfg), job_length(cfg, graph), vllm=vllm, vllm_key=key)


def services_budget(
    gpus: Mapping[str, Device],
    *,
    services: int,
    ranks: int,
    named: Sequence[str] | None,
    visible: Sequence[str],
    jobs: Sequence[Headroom] | None,
    reserve: int | None = None,
) -> int:
    """The device budget (bytes) of every rank of every CUDA service: the smallest `device_split` budget over
    the GPUs they get (`service_gpus`), each described in `gpus` (by the name `CUDA_VISIBLE_DEVICES` uses).
    The headroom: `reserve` when given, else what `jobs` need together (`mix_headroom`), else (a server, whose
    jobs come later) `SERVER_HEADROOM_SHARE` of each GPU."""
    budgets = []
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
        budgets.append(split.budget)
    return min(budgets)


def device_jobs(kind: str, group: bool, jobs: list[LoadedJob]) -> list[LoadedJob]:
    """The jobs with the defaults of the services' device (`job_defaults`: bfloat16 and sdpa on CUDA where a
    job leaves them unset; float32 kept on worker groups, `group`)."""
    import dataclasses

    return [dataclasses.replace(j, config=job_defaults(j.config, kind, group=group)) for j in jobs]


def group_problems(cfg: JobConfig) -> list[str]:
    """What a job asks that a worker group (services.ranks > 1: FSDP2 training in fp32) does not do, each with
    its fix; [] when it runs there as asked."""
    m, fix = cfg.model, "or set services.ranks: 1"
    out = []
    if m.lora is not None:
        out.append(f"model.lora: worker groups train every weight (FSDP2), not an adapter; remove model.lora, {fix}")
    if m.dtype != "float32":
        out.append(f"model.dtype {m.dtype}: worker groups train in float32; set model.dtype: float32, {fix}")
    if m.gradient_checkpointing:
        out.append(f"model.gradient_checkpointing: not built on worker groups; set it false, {fix}")
    return out


__all__ = [
    "device_jobs",
    "group_problems",
    "headroom_of",
    "job_length",
    "job_shape",
    "model_dir",
    "services_budget",
]
