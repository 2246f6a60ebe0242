"""GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization"): GRPO's group advantages with a
sequence-level importance ratio (the geometric mean of the token ratios), clipped per sequence with a
very narrow range, and a sequence-mean loss.

Zero-advantage rows (all-equal groups) are skipped for compute only: the loss keeps the whole batch's
normaliser (`train`'s `skip_norm="full"`), as published.

prompts -> rollout -> verify -> advantage -> train (ratio_level=sequence, clip 3e-4 / 4e-4) -> evaluate
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from plexrl.graph import Pipeline, PipelineGraph
from plexrl.roles import pipeline_builder


@pipeline_builder
def gspo(
    *,
    batch_size: int = 64,
    n: Annotated[int, Field(ge=2)] = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 6,
    lr: float = 3e-4,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
    minibatches: int = 2,
    adam_beta2: float = 0.98,
    eval_every: int = 20,
    eval_size: int = 500,
) -> PipelineGraph:
    p = Pipeline("gspo")
    prompts = p.add("prompts", "sample_prompts", batch_size=batch_size)
    rollouts = p.add("rollout", "rollout", prompts=prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens)
    rewards = p.add("verify", "verify", rollouts=rollouts)
    adv = p.add("advantage", "grpo_advantage", rollouts=rollouts, rewards=rewards)
    train = p.add(
        "train",
        "train",
        rollouts=rollouts,
        advantages=adv,
        objective="gspo",
        policy={"clip_eps": clip_eps_low, "clip_eps_high": clip_eps_high, "ratio_level": "sequence"},
        optimiser={"lr": lr, "beta2": adam_beta2, "minibatches": minibatches},
    )
    p.add("evaluate", "evaluate", after=[train], every=eval_every, size=eval_size, max_new_tokens=max_new_tokens)
    return p.build()
