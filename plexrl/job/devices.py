"""What a job becomes on a device, read from its validated config: the defaults a device implies
(`job_defaults`), what a worker group refuses (`group_problems`), the headroom a job needs beside its state
(`headroom_of`, for `plexrl.devices.services_budget`) and the dtype a vLLM engine holds its weights in
(`vllm_weight_dtype`). The arithmetic itself is `plexrl.devices`' (below the job: engines and services use it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plexrl.devices import CPU, Device, Shape, engine_dtype
from plexrl.devices.base import DEFAULT_MINIBATCH_ROWS, dtype_bytes
from plexrl.devices.budget import Headroom, optimizer_temp_bytes, train_activation_bytes

if TYPE_CHECKING:
    from plexrl.graph import PipelineGraph
    from plexrl.job.config import JobConfig
    from plexrl.job.load import LoadedJob


def vllm_weight_dtype(model_dtype: str) -> str:
    """The dtype a vLLM engine holds a job's weights in (`plexrl.devices.engine_dtype`): the job's on CUDA,
    fp32 where the installed vLLM is its CPU build."""
    from plexrl.engines.vllm_engine import vllm_cpu_build

    return engine_dtype(CPU if vllm_cpu_build() else Device("cuda"), model_dtype)


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


def job_headroom(
    cfg: JobConfig, graph: PipelineGraph, shape: Shape, length: int, *, vllm: bool, vllm_key: str = ""
) -> Headroom:
    """The `Headroom` of a job whose model has `shape` and whose sequences reach `length` tokens (the scored
    response: its largest `max_new_tokens`); `vllm`: its rollouts run on vLLM. A LoRA job's optimizer steps
    megabytes (its adapter): counted 0."""
    from plexrl.devices import vllm_headroom
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
        from plexrl.sizes import count_parameters

        config = json.loads((path / "config.json").read_text())
        try:
            params = count_parameters(path)
        except (FileNotFoundError, ValueError):
            params = 0
        return Shape.of(config, params)
    from plexrl.job.tasks import tokenizer_size
    from plexrl.sizes import built_weight_bytes

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
    "job_defaults",
    "job_headroom",
    "job_length",
    "job_shape",
    "minibatch_rows",
    "model_dir",
    "vllm_weight_dtype",
]
