"""GRPO (Shao et al., 2024): the skeleton itself (`pipelines/skeleton.py`), with the `grpo` objective preset.

Zero-advantage rows (all-equal groups) are skipped for compute only: the loss keeps the whole batch's
normaliser (`train`'s `normaliser: {skip_norm: full}`), as published; `skip_norm: kept` divides by the rows
kept instead (DAPO's convention, and what this pipeline did before 2026-11-30: the figures measured before
then in docs/benchmarks.md used it). `std` picks the group std's divisor (biased, G: the default here;
unbiased, G - 1: the reference implementations').

prompts -> rollout -> verify -> advantage -> train -> evaluate (every k)
              \\-> ref_logprob (only with a KL coef) --/
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from plexrl.graph import PipelineGraph
from plexrl.pipelines.skeleton import Knobs, advantage_by, build
from plexrl.roles import pipeline_builder


class GrpoKnobs(Knobs):
    std: Literal["biased", "unbiased"] = Field("biased", description="The group std's divisor: G, or G - 1.")


@pipeline_builder
def grpo(**params: Any) -> PipelineGraph:
    """GRPO's pipeline; `params`: `GrpoKnobs`."""
    knobs = GrpoKnobs(**params)
    return build("grpo", knobs, objective="grpo", advantage=advantage_by("grpo_advantage", std=knobs.std))
