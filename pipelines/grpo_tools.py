"""GRPO on multi-turn tool-calling episodes: the rollout <-> tool loop unrolled over `max_turns` turns,
each step a node the planner schedules (another job's work can fill the service while tools run):

prompts -> episodes -> turn0[service] -> tools0[cpu] -> turn1[service] -> ... -> turn{T-1}
        -> finish -> verify -> advantage -> train -> evaluate (every k)

Tool output is masked out of the policy loss (see `plexrl.episodes` for the tag format).
Zero-advantage rows (all-equal groups) are skipped for compute only: the loss keeps the whole batch's
normaliser (`train`'s `skip_norm="full"`), as published.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from plexrl.graph import Pipeline, PipelineGraph
from plexrl.roles import pipeline_builder


@pipeline_builder
def grpo_tools(
    *,
    batch_size: int = 32,
    n: Annotated[int, Field(ge=2, description="episodes per prompt; group advantages need at least 2")] = 8,
    temperature: float = 1.0,
    max_turns: Annotated[int, Field(ge=1, le=16, description="model turns per episode (tool nodes between)")] = 2,
    max_new_tokens: Annotated[int, Field(ge=1, description="tokens per model turn")] = 12,
    token_budget: Annotated[int, Field(ge=1, description="tokens per episode after the prompt")] = 40,
    tool: Annotated[str | None, Field(description="tool name or 'pkg.module:Factory'; None: the task's")] = None,
    max_output_tokens: int = 16,
    lr: float = 3e-4,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    minibatches: int = 2,
    epochs: int = 1,
    max_grad_norm: float = 1.0,
    loss_agg: str = "token_mean",
    adam_beta2: float = 0.98,
    skip_zero_advantage: bool = True,
    eval_every: int = 10,
    eval_size: int = 200,
) -> PipelineGraph:
    p = Pipeline("grpo_tools")
    prompts = p.add("prompts", "sample_prompts", batch_size=batch_size)
    episodes = p.add(
        "episodes", "start_episodes", prompts=prompts, n=n, temperature=temperature, token_budget=token_budget
    )
    tools = {"tool": tool, "max_output_tokens": max_output_tokens}
    for turn in range(max_turns):
        episodes = p.add(f"turn{turn}", "agent_turn", episodes=episodes, max_new_tokens=max_new_tokens)
        if turn < max_turns - 1:
            episodes = p.add(f"tools{turn}", "call_tools", episodes=episodes, **tools)
    rollouts = p.add("finish", "finish_episodes", episodes=episodes)
    rewards = p.add("verify", "verify", rollouts=rollouts)
    adv = p.add("advantage", "grpo_advantage", rollouts=rollouts, rewards=rewards)
    ref = {"ref_logprobs": p.add("ref_logprob", "logprob", rollouts=rollouts, which="reference")} if kl_coef > 0 else {}
    train = p.add(
        "train",
        "train",
        rollouts=rollouts,
        advantages=adv,
        **ref,
        objective="grpo",
        policy={"clip_eps": clip_eps},
        normaliser={"agg": loss_agg, "skip_zero_advantage": skip_zero_advantage},
        kl={"coef": kl_coef},
        optimiser={
            "lr": lr, "beta2": adam_beta2, "max_grad_norm": max_grad_norm, "minibatches": minibatches, "epochs": epochs
        },
    )  # fmt: skip
    limits = {"max_turns": max_turns, "max_new_tokens": max_new_tokens, "token_budget": token_budget}
    p.add("evaluate", "evaluate_agent", after=[train], every=eval_every, size=eval_size, **limits, **tools)
    return p.build()
