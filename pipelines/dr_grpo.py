"""Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): GRPO without its two biases:
advantages are not divided by the group's std, and the loss sums each response's tokens and divides by a
constant (the generation budget) instead of the response's own length.

Zero-advantage rows (all-equal groups) are skipped for compute only: the loss keeps the whole batch's
normaliser (`train`'s `skip_norm="full"`), as published.

prompts -> rollout -> verify -> advantage (r - group mean) -> train (seq_sum_token_mean) -> evaluate
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from plexrl.graph import Pipeline, PipelineGraph
from plexrl.roles import pipeline_builder


@pipeline_builder
def dr_grpo(
    *,
    batch_size: int = 64,
    n: Annotated[int, Field(ge=2)] = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 6,
    lr: float = 3e-4,
    clip_eps: float = 0.2,
    minibatches: int = 2,
    adam_beta2: float = 0.98,
    eval_every: int = 20,
    eval_size: int = 500,
) -> PipelineGraph:
    p = Pipeline("dr_grpo")
    prompts = p.add("prompts", "sample_prompts", batch_size=batch_size)
    rollouts = p.add("rollout", "rollout", prompts=prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens)
    rewards = p.add("verify", "verify", rollouts=rollouts)
    adv = p.add("advantage", "grpo_advantage", rollouts=rollouts, rewards=rewards, scale=False)
    train = p.add(
        "train",
        "train",
        rollouts=rollouts,
        advantages=adv,
        objective="dr_grpo",
        policy={"clip_eps": clip_eps},
        normaliser={"agg": "seq_sum_token_mean", "norm_length": float(max_new_tokens)},
        optimiser={"lr": lr, "beta2": adam_beta2, "minibatches": minibatches},
    )
    p.add("evaluate", "evaluate", after=[train], every=eval_every, size=eval_size, max_new_tokens=max_new_tokens)
    return p.build()
