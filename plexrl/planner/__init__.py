"""The pure global planner: events in, instructions out (see `core`)."""

from plexrl.planner.core import Planner
from plexrl.planner.costs import CostModel
from plexrl.planner.events import (
    FailJob,
    IterationDone,
    JobCancelled,
    JobDone,
    JobFailed,
    JobPlan,
    JobSubmitted,
    NodeFinished,
    NodePlan,
    PlaceJob,
    RunNode,
    ServiceJoined,
    ServiceLost,
    StateMeasured,
)
from plexrl.planner.policies import (
    ORDERINGS,
    PLACEMENTS,
    FairShare,
    Fifo,
    Hrrs,
    Isolated,
    Pack,
    Spread,
    SpreadBackfill,
    placement_policy,
)
from plexrl.planner.records import InvalidTransition, JobRecord
from plexrl.planner.state import Move, NoRoom, StateManager, Tier

__all__ = [
    "ORDERINGS",
    "PLACEMENTS",
    "CostModel",
    "FailJob",
    "FairShare",
    "Fifo",
    "Hrrs",
    "InvalidTransition",
    "Isolated",
    "IterationDone",
    "JobCancelled",
    "JobDone",
    "JobFailed",
    "JobPlan",
    "JobRecord",
    "JobSubmitted",
    "Move",
    "NoRoom",
    "NodeFinished",
    "NodePlan",
    "Pack",
    "PlaceJob",
    "Planner",
    "RunNode",
    "ServiceJoined",
    "ServiceLost",
    "Spread",
    "SpreadBackfill",
    "StateManager",
    "StateMeasured",
    "Tier",
    "placement_policy",
]
