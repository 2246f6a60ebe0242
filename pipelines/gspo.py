"""GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization"): GRPO's group advantages with a
sequence-level importance ratio (the geometric mean of the token ratios), clipped per sequence with a
very narrow range (3e-4 / 4e-4), and a sequence-mean loss: all of it the `gspo` preset.

Zero-advantage rows (all-equal groups) are skipped for compute only: the loss keeps the whole batch's
normaliser (`skip_norm: full`), as published.

prompts -> rollout -> verify -> advantage -> train (ratio_level=sequence, clip 3e-4 / 4e-4) -> evaluate
"""

from __future__ import annotations

from typing import Any

from plexrl.graph import PipelineGraph
from plexrl.pipelines.skeleton import Knobs, build
from plexrl.roles import pipeline_builder


@pipeline_builder
def gspo(**params: Any) -> PipelineGraph:
    """GSPO's pipeline; `params`: `Knobs`."""
    return build("gspo", Knobs(**params), objective="gspo")
