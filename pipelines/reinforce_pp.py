"""REINFORCE++ (Hu, 2025): advantages normalised over the whole batch instead of per group, with the PPO
clipped surrogate; `group_baseline=True` gives "REINFORCE++-baseline" (group mean subtracted first, which
needs n >= 2: with one sample per prompt every advantage would be 0, so the builder rejects it).

`level` picks where the batch statistics are taken: `sequence` (the default here: one advantage per
response, mean and std over responses) or `token` (the reference implementations' form: the outcome
reward discounted by `gamma` over the response tokens, mean and std over all response tokens, so longer
responses weigh more). `std`: biased (the default here) or unbiased (the reference implementations').

Departures: REINFORCE++ puts a k1 KL penalty into the per-token reward; here KL (off by default) is a loss
term with the k2 estimator. No row is skipped (`skip_zero_advantage=False`): after batch normalisation a
row of an all-equal group has a nonzero advantage (minus the batch mean), as published.

prompts -> rollout -> verify -> advantage (batch-normalised) -> [ref_logprob] -> train -> evaluate
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from plexrl.errors import ConfigError, Problem
from plexrl.graph import PipelineGraph
from plexrl.pipelines.skeleton import Knobs, advantage_by, build
from plexrl.roles import pipeline_builder


class ReinforcePPKnobs(Knobs):
    n: int = Field(8, ge=1, description="Samples per prompt (>= 2 with group_baseline).")
    group_baseline: bool = Field(True, description="Subtract each prompt's group mean before batch whitening.")
    level: Literal["sequence", "token"] = Field("sequence", description="One advantage per sequence or per token.")
    gamma: float = Field(1.0, ge=0, le=1, description="Per-token discount; needs level=token.")
    std: Literal["biased", "unbiased"] = Field("biased", description="The batch std's divisor.")


@pipeline_builder
def reinforce_pp(**params: Any) -> PipelineGraph:
    """REINFORCE++'s pipeline; `params`: `ReinforcePPKnobs` (a KL coef: `kl: {coef: ...}`, k2 by its preset)."""
    knobs = ReinforcePPKnobs(**params)
    problems = []
    if knobs.group_baseline and knobs.n < 2:
        problems.append(
            Problem(
                "pipeline.params.n",
                f"group_baseline needs n >= 2 samples per prompt (got n={knobs.n}): with one sample every reward "
                "minus its group mean is 0 and nothing is learnt; raise n or set group_baseline: false",
            )
        )
    if knobs.gamma != 1.0 and knobs.level != "token":
        problems.append(
            Problem("pipeline.params.gamma", f"gamma={knobs.gamma} discounts per token; set level: token or gamma: 1")
        )
    if problems:
        raise ConfigError(problems)
    advantage = advantage_by("reinforce_pp_advantage", group_baseline=knobs.group_baseline, level=knobs.level,
                             gamma=knobs.gamma, std=knobs.std)  # fmt: skip
    return build("reinforce_pp", knobs, objective="reinforce_pp", advantage=advantage)
