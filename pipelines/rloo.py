"""RLOO (Ahmadian et al., 2024, "Back to Basics"): REINFORCE with a leave-one-out baseline per prompt.

Departure: the update uses the clipped surrogate; with one minibatch (the default here) the ratio is 1
and the update is exactly REINFORCE with the RLOO baseline.

Zero-advantage rows (all-equal groups) are skipped for compute only: the loss keeps the whole batch's
normaliser (`train`'s `skip_norm="full"`), as published.

prompts -> rollout -> verify -> advantage (leave-one-out) -> train (seq_mean) -> evaluate
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from plexrl.graph import Pipeline, PipelineGraph
from plexrl.roles import pipeline_builder


@pipeline_builder
def rloo(
    *,
    batch_size: int = 64,
    n: Annotated[int, Field(ge=2)] = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 6,
    lr: float = 3e-4,
    minibatches: int = 1,
    adam_beta2: float = 0.98,
    eval_every: int = 20,
    eval_size: int = 500,
    verifier_latency_s: Annotated[
        float, Field(ge=0, description="> 0: verify through a remote verifier with this round trip (remote_verify)")
    ] = 0.0,
) -> PipelineGraph:
    p = Pipeline("rloo")
    prompts = p.add("prompts", "sample_prompts", batch_size=batch_size)
    rollouts = p.add("rollout", "rollout", prompts=prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens)
    remote = {"latency_s": verifier_latency_s} if verifier_latency_s > 0 else {}
    rewards = p.add("verify", "remote_verify" if remote else "verify", rollouts=rollouts, **remote)
    adv = p.add("advantage", "rloo_advantage", rollouts=rollouts, rewards=rewards)
    train = p.add(
        "train",
        "train",
        rollouts=rollouts,
        advantages=adv,
        objective="rloo",
        optimiser={"lr": lr, "beta2": adam_beta2, "minibatches": minibatches},
    )
    p.add("evaluate", "evaluate", after=[train], every=eval_every, size=eval_size, max_new_tokens=max_new_tokens)
    return p.build()
