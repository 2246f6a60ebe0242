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

from typing import Any, Literal

from pydantic import Field

from plexrl.graph import NodeRef, Pipeline, PipelineGraph
from plexrl.pipelines.skeleton import Knobs, build
from plexrl.roles import pipeline_builder


class PpoKnobs(Knobs):
    n: int = Field(8, ge=1, description="Samples per prompt.")
    critic_lr: float = Field(1e-3, gt=0, lt=1, description="The critic's AdamW learning rate.")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE's discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE's lambda.")
    std: Literal["biased", "unbiased"] = Field("biased", description="The advantages' whitening std divisor.")


@pipeline_builder
def ppo(**params: Any) -> PipelineGraph:
    """PPO's pipeline; `params`: `PpoKnobs`."""
    knobs = PpoKnobs(**params)
    values: list[NodeRef] = []

    def gae(p: Pipeline, rollouts: NodeRef, rewards: NodeRef) -> NodeRef:
        values.append(p.add("values", "value_estimate", rollouts=rollouts))
        return p.add("gae", "gae_advantage", rollouts=rollouts, rewards=rewards, values=values[0], gamma=knobs.gamma,
                     lam=knobs.lam, std=knobs.std)  # fmt: skip

    def critic(p: Pipeline, train: NodeRef) -> list[NodeRef]:
        rollouts, adv = NodeRef("rollout"), NodeRef("gae")
        return [
            p.add("critic", "train_critic", rollouts=rollouts, advantages=adv, values=values[0], lr=knobs.critic_lr)
        ]

    return build("ppo", knobs, objective="ppo", advantage=gae, after_train=critic)
