"""PlexRL: RLVR jobs declared as operator DAGs, interleaved by one global planner on shared LLM services.

Light imports only: torch, transformers and mlflow load when a job runs, not when a pipeline is validated.
"""

from plexrl.batch import Advantages, Batch, EvalStats, LogProbs, Prompts, Rewards, Rollouts, TrainStats, Values
from plexrl.graph import NodeRef, Pipeline, PipelineGraph
from plexrl.operator import OpContext, Operator, operator
from plexrl.roles import pipeline_builder

__version__ = "0.1.0"

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
