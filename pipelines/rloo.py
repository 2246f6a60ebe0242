"""RLOO (Ahmadian et al., 2024, "Back to Basics"): REINFORCE with a leave-one-out baseline per prompt.

Departure: the update uses the clipped surrogate; with one minibatch (the `rloo` preset's) the ratio is 1
and the update is exactly REINFORCE with the RLOO baseline.

Zero-advantage rows (all-equal groups) are skipped for compute only: the loss keeps the whole batch's
normaliser (`skip_norm: full`), as published.

prompts -> rollout -> verify -> advantage (leave-one-out) -> train (seq_mean) -> evaluate
"""

from __future__ import annotations

from typing import Any

from plexrl.graph import PipelineGraph
from plexrl.pipelines.skeleton import Knobs, advantage_by, build
from plexrl.roles import pipeline_builder


@pipeline_builder
def rloo(**params: Any) -> PipelineGraph:
    """RLOO's pipeline; `params`: `Knobs`."""
    return build("rloo", Knobs(**params), objective="rloo", advantage=advantage_by("rloo_advantage"))
