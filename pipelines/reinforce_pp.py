"""REINFORCE++ (Hu, 2025): advantages normalised over the whole batch instead of per group, with the PPO
clipped surrogate; `group_baseline=True` gives "REINFORCE++-baseline" (group mean subtracted first).

Departure: REINFORCE++ puts a k1 KL penalty into the per-token reward; here KL (off by default) is a loss
term with the k2 estimator.

prompts -> rollout -> verify -> advantage (batch-normalised) -> [ref_logprob] -> train -> evaluate
"""

from __future__ import annotations

from plexrl.graph import Pipeline, PipelineGraph


def reinforce_pp(
    *,
    batch_size: int = 64,
    n: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 6,
    group_baseline: bool = True,
    lr: float = 3e-4,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    minibatches: int = 2,
    adam_beta2: float = 0.98,
    eval_every: int = 20,
    eval_size: int = 500,
) -> PipelineGraph:
    p = Pipeline("reinforce_pp")
    prompts = p.add("prompts", "sample_prompts", batch_size=batch_size)
    rollouts = p.add("rollout", "rollout", prompts=prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens)
    rewards = p.add("verify", "verify", rollouts=rollouts)
    adv = p.add(
        "advantage", "reinforce_pp_advantage", rollouts=rollouts, rewards=rewards, group_baseline=group_baseline
    )
    ref = {"ref_logprobs": p.add("ref_logprob", "logprob", rollouts=rollouts)} if kl_coef > 0 else {}
    train = p.add(
        "train", "train", rollouts=rollouts, advantages=adv, **ref, lr=lr, clip_eps=clip_eps, kl_coef=kl_coef,
        kl_estimator="k2", minibatches=minibatches, adam_beta2=adam_beta2, skip_zero_advantage=False,
    )  # fmt: skip
    p.add("evaluate", "evaluate", after=[train], every=eval_every, size=eval_size, max_new_tokens=max_new_tokens)
    return p.build()
