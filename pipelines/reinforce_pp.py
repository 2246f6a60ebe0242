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

from typing import Annotated, Any, Literal

from pydantic import Field

from plexrl.errors import ConfigError, Problem
from plexrl.graph import Pipeline, PipelineGraph
from plexrl.roles import pipeline_builder


@pipeline_builder
def reinforce_pp(
    *,
    batch_size: int = 64,
    n: Annotated[int, Field(ge=1)] = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 6,
    group_baseline: bool = True,
    level: Literal["sequence", "token"] = "sequence",
    gamma: Annotated[float, Field(ge=0, le=1, description="per-token discount; needs level=token")] = 1.0,
    std: Literal["biased", "unbiased"] = "biased",
    lr: float = 3e-4,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    minibatches: int = 2,
    adam_beta2: float = 0.98,
    eval_every: int = 20,
    eval_size: int = 500,
) -> PipelineGraph:
    problems = []
    if group_baseline and n < 2:
        problems.append(
            Problem(
                "pipeline.params.n",
                f"group_baseline needs n >= 2 samples per prompt (got n={n}): with one sample every reward minus "
                "its group mean is 0 and nothing is learnt; raise n or set group_baseline: false",
            )
        )
    if gamma != 1.0 and level != "token":
        problems.append(
            Problem("pipeline.params.gamma", f"gamma={gamma} discounts per token; set level: token or gamma: 1")
        )
    if problems:
        raise ConfigError(problems)
    p = Pipeline("reinforce_pp")
    prompts = p.add("prompts", "sample_prompts", batch_size=batch_size)
    rollouts = p.add("rollout", "rollout", prompts=prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens)
    rewards = p.add("verify", "verify", rollouts=rollouts)
    adv = p.add(
        "advantage", "reinforce_pp_advantage", rollouts=rollouts, rewards=rewards, group_baseline=group_baseline,
        level=level, gamma=gamma, std=std,
    )  # fmt: skip
    ref: dict[str, Any] = {"ref_logprobs": p.add("ref_logprob", "logprob", rollouts=rollouts)} if kl_coef > 0 else {}
    train = p.add(
        "train",
        "train",
        rollouts=rollouts,
        advantages=adv,
        **ref,
        objective="reinforce_pp",
        policy={"clip_eps": clip_eps},
        kl={"coef": kl_coef, "estimator": "k2"},
        optimiser={"lr": lr, "beta2": adam_beta2, "minibatches": minibatches},
    )
    p.add("evaluate", "evaluate", after=[train], every=eval_every, size=eval_size, max_new_tokens=max_new_tokens)
    return p.build()
