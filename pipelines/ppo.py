"""PPO for LLMs (Schulman et al., 2017; Ouyang et al., 2022): a critic (the policy's backbone with a
scalar head, value 0 at start) estimates token values, GAE turns the verifier's sequence reward into
per-token advantages, and policy and critic are updated with clipped losses.

Departure: several samples per prompt (`n`), as in the other pipelines here, and no KL in the reward.

Rows whose GAE advantages are all 0 are skipped for compute only (`skip_norm="full"`); the advantages are
whitened with the `std` given (biased by default; the reference implementations use unbiased).

prompts -> rollout -> verify --------> gae -> train (policy) -> evaluate
                 \\-> value_estimate --/  \\-> train_critic
"""

from __future__ import annotations

from typing import Literal

from plexrl.graph import Pipeline, PipelineGraph
from plexrl.roles import pipeline_builder


@pipeline_builder
def ppo(
    *,
    batch_size: int = 64,
    n: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 6,
    lr: float = 3e-4,
    critic_lr: float = 1e-3,
    clip_eps: float = 0.2,
    gamma: float = 1.0,
    lam: float = 0.95,
    std: Literal["biased", "unbiased"] = "biased",
    minibatches: int = 2,
    adam_beta2: float = 0.98,
    eval_every: int = 20,
    eval_size: int = 500,
) -> PipelineGraph:
    p = Pipeline("ppo")
    prompts = p.add("prompts", "sample_prompts", batch_size=batch_size)
    rollouts = p.add("rollout", "rollout", prompts=prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens)
    rewards = p.add("verify", "verify", rollouts=rollouts)
    values = p.add("values", "value_estimate", rollouts=rollouts)
    adv = p.add(
        "gae", "gae_advantage", rollouts=rollouts, rewards=rewards, values=values, gamma=gamma, lam=lam, std=std
    )
    train = p.add(
        "train",
        "train",
        rollouts=rollouts,
        advantages=adv,
        objective="ppo",
        policy={"clip_eps": clip_eps},
        optimiser={"lr": lr, "beta2": adam_beta2, "minibatches": minibatches},
    )
    critic = p.add("critic", "train_critic", rollouts=rollouts, advantages=adv, values=values, lr=critic_lr)
    p.add(
        "evaluate", "evaluate", after=[train, critic], every=eval_every, size=eval_size, max_new_tokens=max_new_tokens
    )
    return p.build()
