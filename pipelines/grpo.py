"""GRPO (Shao et al., 2024) as one iteration's DAG.

Zero-advantage rows (all-equal groups) are skipped for compute only: the loss keeps the whole batch's
normaliser (`train`'s `skip_norm="full"`), as published; `skip_norm="kept"` divides by the rows kept
instead (DAPO's convention, and what this pipeline did before 2026-11-30: the figures measured before then
in docs/benchmarks.md used it). `std` picks the group std's divisor (biased, G: the default here;
unbiased, G - 1: the reference implementations').

prompts -> rollout -> verify -> advantage -> train -> evaluate (every k)
              \\-> ref_logprob (only with KL) --/
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from plexrl.graph import Pipeline, PipelineGraph
from plexrl.roles import pipeline_builder


@pipeline_builder
def grpo(
    *,
    batch_size: int = 64,
    n: Annotated[int, Field(ge=2, description="samples per prompt; group advantages need at least 2")] = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 6,
    lr: float = 3e-4,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    minibatches: int = 2,
    epochs: int = 1,
    max_grad_norm: float = 1.0,
    loss_agg: str = "token_mean",
    adam_beta2: float = 0.98,
    skip_zero_advantage: bool = True,
    skip_norm: Literal["full", "kept"] = "full",
    std: Literal["biased", "unbiased"] = "biased",
    eval_every: int = 20,
    eval_size: int = 500,
    verifier_latency_s: Annotated[
        float, Field(ge=0, description="> 0: verify through a remote verifier with this round trip (remote_verify)")
    ] = 0.0,
) -> PipelineGraph:
    p = Pipeline("grpo")
    prompts = p.add("prompts", "sample_prompts", batch_size=batch_size)
    rollouts = p.add("rollout", "rollout", prompts=prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens)
    remote = {"latency_s": verifier_latency_s} if verifier_latency_s > 0 else {}
    rewards = p.add("verify", "remote_verify" if remote else "verify", rollouts=rollouts, **remote)
    adv = p.add("advantage", "grpo_advantage", rollouts=rollouts, rewards=rewards, std=std)
    ref = {"ref_logprobs": p.add("ref_logprob", "logprob", rollouts=rollouts, which="reference")} if kl_coef > 0 else {}
    train = p.add(
        "train",
        "train",
        rollouts=rollouts,
        advantages=adv,
        **ref,
        objective="grpo",
        policy={"clip_eps": clip_eps},
        normaliser={"agg": loss_agg, "skip_zero_advantage": skip_zero_advantage, "skip_norm": skip_norm},
        kl={"coef": kl_coef},
        optimiser={
            "lr": lr, "beta2": adam_beta2, "max_grad_norm": max_grad_norm, "minibatches": minibatches, "epochs": epochs
        },
    )  # fmt: skip
    p.add("evaluate", "evaluate", after=[train], every=eval_every, size=eval_size, max_new_tokens=max_new_tokens)
    return p.build()
