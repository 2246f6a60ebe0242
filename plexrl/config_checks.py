"""Checks of a validated job against its compiled pipeline and the machine, run by `plexrl.config.load_job`
(and `prepare_job` for a LoadedJob built otherwise): chunked nodes, what a LoRA job cannot do yet, and
whether vLLM can serve the model. Each returns problems (or a reason); none raises or imports user code.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from plexrl.errors import Problem

if TYPE_CHECKING:
    from plexrl.config import JobConfig, ModelConfig
    from plexrl.graph import PipelineGraph


def lora_problems(config: JobConfig, graph: PipelineGraph | None) -> list[Problem]:
    """What a LoRA job cannot do yet: generate on vLLM, or train a critic."""
    problems = []
    if config.engine == "vllm":
        problems.append(
            Problem("engine", "a LoRA job generates on the torch engine (vLLM adapters are not wired yet); set auto")
        )
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
        if op.placement != "service":
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


def vllm_problem(model: ModelConfig) -> str | None:
    """Why vLLM cannot generate for this model (not installed, unsupported architecture or head size)."""
    from plexrl.engines.vllm_engine import VLLM_EXTRA_HINT, config_problem, model_problem, vllm_installed

    if not vllm_installed():
        return f"vLLM is not installed; {VLLM_EXTRA_HINT}"
    if model.path is not None:
        return model_problem(model.path)
    built = {"architectures": ["LlamaForCausalLM"], "hidden_size": model.hidden, "num_attention_heads": model.heads}
    return config_problem(built)


__all__ = ["chunk_problems", "lora_problems", "vllm_problem"]
