"""A Dask worker's services: the registry that keeps each `Service` (one per executor token and service id)
resident in its worker process between tasks, and `publish`, which sends a node's small report to the
client as a Dask event. The executor's tasks (`plexrl.runtime.dask_tasks`) and the worker groups' rank
tasks (`plexrl.services.group`) both use them; they live here, below both."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from plexrl.reports import NodeReport

if TYPE_CHECKING:
    from plexrl.services.service import Service

SERVICES: dict[str, Service] = {}
"""`<executor token>/<service id>` -> the service in this worker process (two runs never share one)."""


def publish(topic: str, handle: int, report: NodeReport) -> None:
    """Send the node's small report to the client as a Dask event (one message, no extra task)."""
    from distributed import get_worker

    get_worker().log_event(topic, {"handle": handle, "report": dataclasses.asdict(report)})


__all__ = ["SERVICES", "publish"]
