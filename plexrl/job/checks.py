"""Checks of a validated job against its compiled pipeline and the machine, run by `plexrl.job.load.load_job`
(and `prepare_job` for a LoadedJob built otherwise): chunked nodes, what a LoRA job cannot do, whether
vLLM can serve the model, and whether the prompt + response budget fits the model's context length. Each
returns problems (or a reason); none raises or imports user code.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from plexrl.errors import Problem

if TYPE_CHECKING:
    from plexrl.graph import PipelineGraph
    from plexrl.job.config import JobConfig
    from plexrl.job.model_config import ModelConfig


def lora_problems(config: JobConfig, graph: PipelineGraph | None) -> list[Problem]:
    """What a LoRA job cannot do: train a critic; with `engine: vllm`, an adapter vLLM cannot apply (its rank or
    target modules; whether vLLM serves the base is the engine check's)."""
    problems = []
    lora = config.model.lora
    if config.engine == "vllm" and lora is not None:
        from plexrl.engines.vllm_lora import lora_vllm_problem

        why = lora_vllm_problem(lora.r, lora.target_modules)
        if why:
            problems.append(Problem("model.lora", f"{why}; or set `engine: torch` (or auto)"))
    critic = [n.name for n in (graph.nodes if graph else []) if n.operator.name in ("value_estimate", "train_critic")]
    if critic:
        problems.append(
            Problem("model.lora", f"a LoRA job has no critic; nodes {critic} need one: use a pipeline without it")
        )
    return problems


def chunk_problems(chunks: dict[str, int], graph: PipelineGraph) -> list[Problem]:
    """What is wrong with `chunks` for this pipeline: every named node must exist, run on a service and have a
    chunkable operator (one that declares `chunk_input`: a row-sliceable input and a concatenable output)."""
    problems = []
    names = [n.name for n in graph.nodes]
    for name, count in chunks.items():
        where = f"chunks.{name}"
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(Problem(where, f"no pipeline node {name!r}; {hint}nodes: {', '.join(names)}"))
            continue
        op = graph.node(name).operator
        if count == 1:
            continue
        if op.runs_on != "service":
            why = f"node {name!r} ({op.name}) runs on the CPU pool; only service nodes run in chunks: remove it"
            problems.append(Problem(where, why))
        elif not op.chunkable:
            chunkable = sorted(n.name for n in graph.nodes if n.operator.chunkable) or ["none in this pipeline"]
            why = (
                f"operator {op.name!r} of node {name!r} cannot run in chunks (it declares no chunk_input); remove "
                f"it. Chunkable nodes here: {', '.join(chunkable)}"
            )
            problems.append(Problem(where, why))
    return problems


def slice_problems(slices: dict[str, int], graph: PipelineGraph) -> list[Problem]:
    """What is wrong with `slices` (decode-step preemption) for this pipeline: every named node must exist and
    have a sliceable operator (one whose generation pauses between decode steps: `rollout`)."""
    problems = []
    names = [n.name for n in graph.nodes]
    for name in slices:
        where = f"slices.{name}"
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(Problem(where, f"no pipeline node {name!r}; {hint}nodes: {', '.join(names)}"))
        elif not graph.node(name).operator.sliceable:
            op = graph.node(name).operator
            able = sorted(n.name for n in graph.nodes if n.operator.sliceable) or ["none in this pipeline"]
            why = (
                f"operator {op.name!r} of node {name!r} cannot run in slices of decode steps (only a sliceable "
                f"service operator can); remove it. Sliceable nodes here: {', '.join(able)}"
            )
            problems.append(Problem(where, why))
    return problems


def vllm_problem(model: ModelConfig) -> str | None:
    """Why vLLM cannot generate for this model (not installed, unsupported architecture or head size)."""
    from plexrl.engines.vllm_engine import VLLM_EXTRA_HINT, config_problem, model_problem, vllm_installed

    if not vllm_installed():
        return f"vLLM is not installed; {VLLM_EXTRA_HINT}"
    if model.path is not None:
        return model_problem(model.path)
    built = {"architectures": ["LlamaForCausalLM"], "hidden_size": model.hidden, "num_attention_heads": model.heads}
    return config_problem(built)


def context_length(model: ModelConfig) -> tuple[int, str] | None:
    """The model's context length (positions) and where it comes from; None when it cannot be read yet (a
    pretrained model not converted, an unreadable config: other checks report those)."""
    path: Path | None = None
    if model.path is not None:
        path = Path(model.path)
    elif model.pretrained is not None:
        from plexrl.job.pretrained import pretrained_path

        try:
            path = pretrained_path(model.pretrained, convert=False)
        except LookupError:
            return None
    if path is None:
        return model.max_position, "model.max_position"
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int):
            return config[key], f"{key} in {path}/config.json"
    return None


def response_budget(graph: PipelineGraph | None) -> tuple[int, str] | None:
    """The most tokens any node generates after a prompt (`max_new_tokens`, or an episode's `token_budget`)
    and the node's name; None for a pipeline that generates nothing."""
    best: tuple[int, str] | None = None
    for node in graph.nodes if graph else []:
        for field in ("max_new_tokens", "token_budget"):
            value = getattr(node.params, field, None)
            if isinstance(value, int) and (best is None or value > best[0]):
                best = (value, f"{node.name}.{field}")
    return best


def generation_budget(config: JobConfig, graph: PipelineGraph | None) -> int | None:
    """Prompt + response tokens a sequence of this job can reach: `data.max_prompt_tokens` plus the largest
    response budget of its pipeline; None when the prompt length is not bounded (no `max_prompt_tokens`) or
    nothing is generated. What a generation engine needs as its `max_model_len`."""
    prompt = config.data.max_prompt_tokens if config.data is not None else None
    response = response_budget(graph)
    return None if prompt is None or response is None else prompt + response[0]


def budget_problems(config: JobConfig, graph: PipelineGraph | None) -> list[Problem]:
    """The prompt + response budget against the model's context length: `data.max_prompt_tokens` + the
    largest `max_new_tokens` (or `token_budget`) of the pipeline must fit in the model's positions."""
    context, response = context_length(config.model), response_budget(graph)
    if context is None or response is None:
        return []
    (limit, source), (new, node) = context, response
    prompt = config.data.max_prompt_tokens if config.data is not None else None
    if prompt is not None and prompt + new > limit:
        return [
            Problem(
                "data.max_prompt_tokens",
                f"max_prompt_tokens ({prompt}) + {node} ({new}) = {prompt + new} tokens exceeds the model's context "
                f"length {limit} ({source}); lower data.max_prompt_tokens or the node's max_new_tokens so they sum "
                f"to at most {limit}",
            )
        ]
    if new >= limit:
        return [
            Problem(
                f"pipeline.{node}",
                f"{node} ({new}) leaves no room for a prompt in the model's context length {limit} ({source}); "
                f"lower it below {limit}",
            )
        ]
    return []


__all__ = [
    "budget_problems",
    "chunk_problems",
    "context_length",
    "generation_budget",
    "lora_problems",
    "response_budget",
    "vllm_problem",
]
