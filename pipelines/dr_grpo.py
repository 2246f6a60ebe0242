"""Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): GRPO without its two biases:
advantages are not divided by the group's std, and the loss sums each response's tokens and divides by a
constant (the generation budget, `max_new_tokens`) instead of the response's own length (the `dr_grpo`
preset's `seq_sum_token_mean`).

Zero-advantage rows (all-equal groups) are skipped for compute only: the loss keeps the whole batch's
normaliser (`skip_norm: full`), as published.

prompts -> rollout -> verify -> advantage (r - group mean) -> train (seq_sum_token_mean) -> evaluate
"""

from __future__ import annotations

from typing import Any

from plexrl.graph import PipelineGraph
from plexrl.pipelines.skeleton import Knobs, advantage_by, build
from plexrl.roles import pipeline_builder


@pipeline_builder
def dr_grpo(**params: Any) -> PipelineGraph:
    """Dr. GRPO's pipeline; `params`: `Knobs`."""
    knobs = Knobs(**params)
    length = {"normaliser": {"norm_length": float(knobs.max_new_tokens)}}  # the budget, not each response's length
    return build("dr_grpo", knobs, objective="dr_grpo", defaults=length,
                 advantage=advantage_by("grpo_advantage", scale=False))  # fmt: skip
