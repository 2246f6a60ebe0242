"""What a job will cost before any of its work runs: `footprint(loaded)` reads a compiled job (its config and
pipeline; at most the `config.json` and safetensors headers of `model.path`, nothing else) and returns its
`Footprint`: every size a server limits, each with the config field that sets it (the field a refusal names).

- `parameters`: the model's (a built model's from its sizes: built in preparation, so counted before it is);
- `state_bytes`, `engine_bytes`: the job's device state and its vLLM engine (weights + KV cache), as
  `plexrl.job.budget.device_need` counts them;
- `rollout_tokens`: one rollout batch, `n` x `batch_size` sequences of prompt + response tokens (the prompt
  bounded by `data.max_prompt_tokens`, else the model's positions), and `rollout_bytes`, the tensors a batch
  holds per token (ids, masks, log-probs, rewards, advantages: `TOKEN_BYTES`);
- `train_size`, `eval_size`: problems generated (the task's) or evaluated (the largest of the task's held-out
  split, the warm start's and the pipeline's evaluations);
- `kv_cache_bytes`, `lora_r`, `iterations`, `warm_start_steps`.

`memory_bytes` is the sum a server compares with its per-job limit: state + engine + a rollout batch. All are
upper bounds from the config alone (the planner later replaces the state's with what a service measures). What
this module does NOT do: compare them with limits (`plexrl.server.limits`), or size data files (their size is
bounded where they are opened, `plexrl.paths`).
"""

from __future__ import annotations

from dataclasses import dataclass

from plexrl.job.budget import device_need, estimate_kv_bytes, estimate_weight_bytes
from plexrl.job.checks import context_length, response_budget
from plexrl.job.generation import rollout_rows
from plexrl.job.load import LoadedJob

TOKEN_BYTES = 32  # per rollout token: ids (8), attention mask (8), log-probs (4), old log-probs (4), advantage (4),
# reward share and loss mask (4)


@dataclass(frozen=True, slots=True)
class Footprint:
    """A job's sizes (see the module docstring); `fields` maps each size to the config field that sets it."""

    parameters: int
    state_bytes: int
    engine_bytes: int
    kv_cache_bytes: int
    rollout_rows: int
    rollout_tokens: int
    rollout_bytes: int
    train_size: int
    eval_size: int
    lora_r: int
    iterations: int
    warm_start_steps: int
    fields: dict[str, str]

    @property
    def memory_bytes(self) -> int:
        """The job's memory as a server bounds it: its state, its engine, one rollout batch."""
        return self.state_bytes + self.engine_bytes + self.rollout_bytes


def footprint(loaded: LoadedJob) -> Footprint:
    """The sizes of a compiled job; see the module docstring."""
    cfg, graph = loaded.config, loaded.graph
    need = device_need(loaded)
    rows = rollout_rows(graph)
    response = response_budget(graph)
    prompt = cfg.data.max_prompt_tokens if cfg.data is not None else None
    context = context_length(cfg.model)
    if prompt is None:  # unbounded prompts: the model's positions bound a sequence
        length = context[0] if context is not None else cfg.model.max_position
    else:
        length = prompt + (response[0] if response is not None else 0)
    evals = [cfg.task.eval_size] if cfg.data is None else []
    if cfg.warm_start.enabled:
        evals.append(cfg.warm_start.eval_size)
    for node in graph.nodes:
        for name in ("size", "eval_size"):
            value = getattr(node.params, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                evals.append(value)
    generating = [n for n in graph.nodes if isinstance(getattr(n.params, "n", None), int)]
    batch_field = f"pipeline node {generating[0].name!r}: n x batch_size" if generating else "pipeline.params"
    fields = {
        "parameters": "model.path" if cfg.model.path is not None else "model (layers, hidden, intermediate)",
        "state_bytes": "model",
        "engine_bytes": "vllm.kv_cache_mb",
        "kv_cache_bytes": "vllm.kv_cache_mb",
        "rollout_rows": batch_field,
        "rollout_tokens": batch_field + (" and data.max_prompt_tokens" if prompt is not None else ""),
        "rollout_bytes": batch_field,
        "train_size": "task.train_size",
        "eval_size": "task.eval_size / warm_start.eval_size / pipeline eval_size",
        "lora_r": "model.lora.r",
        "iterations": "iterations",
        "warm_start_steps": "warm_start.max_steps",
    }
    kv = estimate_kv_bytes(cfg, graph) if need.engine else 0
    tokens = rows * length
    return Footprint(
        parameters=estimate_weight_bytes(cfg) // 4,
        state_bytes=need.state,
        engine_bytes=need.engine,
        kv_cache_bytes=kv,
        rollout_rows=rows,
        rollout_tokens=tokens,
        rollout_bytes=tokens * TOKEN_BYTES,
        train_size=cfg.task.train_size if cfg.data is None else 0,
        eval_size=max(evals, default=0),
        lora_r=cfg.model.lora.r if cfg.model.lora is not None else 0,
        iterations=cfg.iterations,
        warm_start_steps=cfg.warm_start.max_steps if cfg.warm_start.enabled else 0,
        fields=fields,
    )


__all__ = ["TOKEN_BYTES", "Footprint", "footprint"]
