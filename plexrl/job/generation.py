"""The vLLM engine's sizes from the job: its context (`max_model_len`) and its KV cache, and the checks that
refuse a job whose sequences cannot fit, in PlexRL's words, before vLLM is built.

`generation_sizes(config, graph, model_dir, longest_prompt)`:
- context = the prompt bound + the pipeline's longest generation (`max_new_tokens`, or an episode's
  `token_budget`). The prompt bound is `data.max_prompt_tokens` when set (longer rows are dropped), else
  the longest rendered prompt of the job's data (measured when the task is prepared:
  `DatasetTask.longest_prompt`), else unknown (a generated task): then the model's own positions.
  Without this, a job on SmolLM2 without `max_prompt_tokens` asked vLLM for 8,192 positions in a 64 MiB
  cache and failed in vLLM's own words.
- KV cache = `vllm.kv_cache_mb` when set, else enough for the rollout batch at once: the rows of the largest
  generating node (`batch_size` x `n`) times the context rounded up to whole KV blocks (`vllm.block_size`,
  else vLLM's CPU default of 128), times the model's KV bytes per token (2 x layers x KV heads x head size x
  4: the engine runs in float32). At least one sequence's worth; at least `MIN_KV_BYTES`.

`sizing_problems(...)` names the two numbers and the setting to change when the context passes the model's
positions, or when a `vllm.kv_cache_mb` that was set cannot hold one sequence. `plexrl.job.spec.prepare_job`
raises them for a job that rolls out on vLLM; `JobSpec.generation_sizes()` is what the service builds the
engine with and what the planner counts (the engine's arguments themselves are `engines/vllm_engine.py`'s).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from plexrl.errors import Problem
from plexrl.job.checks import context_length, response_budget

if TYPE_CHECKING:
    from plexrl.graph import PipelineGraph
    from plexrl.job.config import JobConfig

KV_DTYPE_BYTES = 4  # the vLLM engine runs in float32 (plexrl/engines/vllm_engine.py)
CPU_BLOCK = 128  # vLLM's KV block size on CPU when vllm.block_size is unset
MIN_KV_BYTES = 16 * 2**20  # the smallest KV cache an engine is built with


@dataclass(frozen=True, slots=True)
class GenerationSizes:
    """`max_model_len`: positions one sequence may reach (None: the model's own); `kv_cache_bytes`: the
    engine's KV cache; `prompt`/`prompt_source`: the prompt bound and where it comes from; `rows`: the rollout
    batch the cache is sized for; `per_token`: KV bytes per token (None: not known)."""

    max_model_len: int | None
    kv_cache_bytes: int
    prompt: int | None
    prompt_source: str
    rows: int
    per_token: int | None


def kv_bytes_per_token(model_dir: Path | None) -> int | None:
    """KV-cache bytes per token of the model in `model_dir` (its config.json), in the engine's float32; None
    when it cannot be read.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "config.json").write_text('{"num_hidden_layers": 30, "num_attention_heads": 9, '
    ...                                    '"num_key_value_heads": 3, "hidden_size": 576}')
    >>> kv_bytes_per_token(d)  # SmolLM2-135M: 2 x 30 layers x 3 KV heads x 64 x 4 bytes
    46080
    """
    if model_dir is None:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        layers, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    return 2 * layers * kv_heads * head_dim * KV_DTYPE_BYTES


def rollout_rows(graph: PipelineGraph | None) -> int:
    """The most sequences a rollout makes at once: for each generating node with samples per prompt (`n`),
    `n` x the `batch_size` of the node itself or of the nodes that feed it (1 when none is given). An
    evaluation's greedy pass (no `n`) is not counted: vLLM runs what does not fit in waves."""
    best = 1
    if graph is None:
        return best
    for node in graph.nodes:
        n = getattr(node.params, "n", None)
        if not isinstance(n, int) or not any(
            isinstance(getattr(node.params, f, None), int) for f in ("max_new_tokens", "token_budget")
        ):
            continue
        best = max(best, n * _batch(graph, node.name, set()))
    return best


def _batch(graph: PipelineGraph, name: str, seen: set[str]) -> int:
    node = graph.node(name)
    batch = getattr(node.params, "batch_size", None)
    if isinstance(batch, int):
        return batch
    seen.add(name)
    upstream = [_batch(graph, src, seen) for src in dict(node.inputs).values() if src not in seen]
    return max(upstream, default=1)


def _prompt(config: JobConfig, longest_prompt: int | None) -> tuple[int | None, str]:
    bound = config.data.max_prompt_tokens if config.data is not None else None
    if bound is not None:
        return bound, "data.max_prompt_tokens"
    if longest_prompt is not None:
        return longest_prompt, "the longest rendered prompt of the data"
    return None, ""


def sequence_bytes(length: int, per_token: int, block: int) -> int:
    """KV bytes of one sequence of `length` tokens in whole blocks of `block` tokens.

    >>> sequence_bytes(100, 46080, 128) / 2**20
    5.625
    """
    return math.ceil(length / block) * block * per_token


def generation_sizes(
    config: JobConfig, graph: PipelineGraph | None, model_dir: Path | None, longest_prompt: int | None = None
) -> GenerationSizes:
    """The engine's context and KV cache for this job (see the module docstring). Pure but for reading the
    model's config.json."""
    prompt, source = _prompt(config, longest_prompt)
    response = response_budget(graph)
    length = None if prompt is None or response is None else prompt + response[0]
    rows, per_token = rollout_rows(graph), kv_bytes_per_token(model_dir)
    if config.vllm.kv_cache_mb is not None:
        kv = config.vllm.kv_cache_mb * 2**20
    elif per_token is None:
        kv = 64 * 2**20
    else:
        block = config.vllm.block_size or CPU_BLOCK
        if length is not None:
            kv = rows * sequence_bytes(length, per_token, block)
        else:  # the model's positions: room for one such sequence
            context = context_length(config.model)
            kv = sequence_bytes(context[0], per_token, block) if context is not None else 64 * 2**20
        kv = max(MIN_KV_BYTES, math.ceil(kv / 2**20) * 2**20)
    return GenerationSizes(length, kv, prompt, source, rows, per_token)


def sizing_problems(
    config: JobConfig, graph: PipelineGraph | None, model_dir: Path | None, longest_prompt: int | None = None
) -> list[Problem]:
    """Why the vLLM engine cannot serve this job's sequences: the context passes the model's positions (the
    prompt bound + the generation, both numbers named), or a `vllm.kv_cache_mb` that was set cannot hold one
    sequence (the MiB needed and the setting). Empty when it fits."""
    sizes = generation_sizes(config, graph, model_dir, longest_prompt)
    context, response = context_length(config.model), response_budget(graph)
    problems = []
    if sizes.max_model_len is not None and context is not None and response is not None:
        (limit, where), (new, node) = context, response
        if sizes.max_model_len > limit:
            fix = (
                "lower data.max_prompt_tokens"
                if sizes.prompt_source == "data.max_prompt_tokens"
                else "set data.max_prompt_tokens (longer rows are dropped)"
            )
            problems.append(
                Problem(
                    "data.max_prompt_tokens",
                    f"{sizes.prompt_source} ({sizes.prompt} tokens) + {node} ({new}) = {sizes.max_model_len} "
                    f"positions, more than the model's {limit} ({where}); {fix} or lower {node}",
                )
            )
    if config.vllm.kv_cache_mb is not None and sizes.per_token is not None:
        length = sizes.max_model_len or (context[0] if context is not None else None)
        if length is not None:
            one = sequence_bytes(length, sizes.per_token, config.vllm.block_size or CPU_BLOCK)
            if one > sizes.kv_cache_bytes:
                batch = sizes.rows * one
                problems.append(
                    Problem(
                        "vllm.kv_cache_mb",
                        f"one sequence of {length} tokens needs {one / 2**20:.1f} MiB of KV cache but "
                        f"vllm.kv_cache_mb is {config.vllm.kv_cache_mb} MiB; raise vllm.kv_cache_mb to at least "
                        f"{math.ceil(one / 2**20)} (the rollout batch of {sizes.rows} rows at once: "
                        f"{math.ceil(batch / 2**20)}), or remove it to size the cache from the job, or set "
                        "data.max_prompt_tokens",
                    )
                )
    return problems


__all__ = [
    "GenerationSizes",
    "generation_sizes",
    "kv_bytes_per_token",
    "rollout_rows",
    "sequence_bytes",
    "sizing_problems",
]
