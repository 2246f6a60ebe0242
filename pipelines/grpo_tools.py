"""GRPO on multi-turn tool-calling episodes: the rollout <-> tool loop unrolled over `max_turns` turns,
each step a node the planner schedules (another job's work can fill the service while tools run):

prompts -> episodes -> turn0[service] -> tools0[cpu] -> turn1[service] -> ... -> turn{T-1}
        -> finish -> verify -> advantage -> train -> evaluate (every k)

Tool output is masked out of the policy loss (see `plexrl.episodes` for the tag format).
Zero-advantage rows (all-equal groups) are skipped for compute only: the loss keeps the whole batch's
normaliser (`train`'s `skip_norm="full"`), as published.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from plexrl.graph import NodeRef, Pipeline, PipelineGraph
from plexrl.pipelines.skeleton import Knobs, build, verify
from plexrl.roles import pipeline_builder


class ToolKnobs(Knobs):
    batch_size: int = Field(32, ge=1, description="Prompts per iteration.")
    max_new_tokens: int = Field(12, ge=1, description="Tokens per model turn.")
    eval_every: int = Field(10, ge=1, description="Iterations between two held-out evaluations.")
    eval_size: int = Field(200, ge=1, description="Held-out problems per evaluation.")
    max_turns: int = Field(2, ge=1, le=16, description="Model turns per episode (tool nodes between).")
    token_budget: int = Field(40, ge=1, description="Tokens per episode after the prompt.")
    tool: str | None = Field(None, description="Tool name or 'pkg.module:Factory'; None: the task's.")
    max_output_tokens: int = Field(16, ge=1, description="Tokens of a tool's output kept in the episode.")


@pipeline_builder
def grpo_tools(**params: Any) -> PipelineGraph:
    """GRPO on tool episodes; `params`: `ToolKnobs`."""
    knobs = ToolKnobs(**params)
    tools = {"tool": knobs.tool, "max_output_tokens": knobs.max_output_tokens}

    def episodes(p: Pipeline, prompts: NodeRef) -> tuple[NodeRef, NodeRef]:
        ep = p.add("episodes", "start_episodes", prompts=prompts, n=knobs.n, temperature=knobs.temperature,
                   token_budget=knobs.token_budget)  # fmt: skip
        for turn in range(knobs.max_turns):
            ep = p.add(f"turn{turn}", "agent_turn", episodes=ep, max_new_tokens=knobs.max_new_tokens)
            if turn < knobs.max_turns - 1:
                ep = p.add(f"tools{turn}", "call_tools", episodes=ep, **tools)
        rollouts = p.add("finish", "finish_episodes", episodes=ep)
        return rollouts, verify(p, knobs, rollouts)

    def evaluate(p: Pipeline, after: Any) -> NodeRef:
        limits = {
            "max_turns": knobs.max_turns,
            "max_new_tokens": knobs.max_new_tokens,
            "token_budget": knobs.token_budget,
        }
        return p.add("evaluate", "evaluate_agent", after=after, every=knobs.eval_every, size=knobs.eval_size,
                     **limits, **tools)  # fmt: skip

    return build("grpo_tools", knobs, objective="grpo", sample=episodes, evaluate=evaluate)
