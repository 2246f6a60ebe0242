"""PlexRL: RLVR jobs declared as operator DAGs, interleaved by one global planner on shared LLM services.

Light imports only: torch, transformers and mlflow load when a job runs, not when a pipeline is validated. The
graph's names (and networkx under them) load on first use, so a process that needs one small submodule (a reward
worker) does not pay for them. `operator` is bound here at import: the submodule of the same name would
otherwise shadow the decorator once imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plexrl.batch import Advantages, Batch, EvalStats, LogProbs, Prompts, Rewards, Rollouts, TrainStats, Values
from plexrl.operator import OpContext, Operator, operator
from plexrl.roles import pipeline_builder

if TYPE_CHECKING:
    from plexrl.graph import NodeRef, Pipeline, PipelineGraph

__version__ = "0.1.0"

_LAZY = ("NodeRef", "Pipeline", "PipelineGraph")  # from plexrl.graph


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'plexrl' has no attribute {name!r}")
    from plexrl import graph

    value = getattr(graph, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "Advantages",
    "Batch",
    "EvalStats",
    "LogProbs",
    "NodeRef",
    "OpContext",
    "Operator",
    "Pipeline",
    "PipelineGraph",
    "Prompts",
    "Rewards",
    "Rollouts",
    "TrainStats",
    "Values",
    "operator",
    "pipeline_builder",
]
