"""The pure global planner: events in, instructions out (see `core`)."""

from plexrl.planner.core import InvalidTransition, JobRecord, Planner
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
)
from plexrl.planner.policies import Fifo, Isolated, Pack

__all__ = [
    "FailJob",
    "Fifo",
    "InvalidTransition",
    "Isolated",
    "IterationDone",
    "JobCancelled",
    "JobDone",
    "JobFailed",
    "JobPlan",
    "JobRecord",
    "JobSubmitted",
    "NodeFinished",
    "NodePlan",
    "Pack",
    "PlaceJob",
    "Planner",
    "RunNode",
    "ServiceJoined",
    "ServiceLost",
]
