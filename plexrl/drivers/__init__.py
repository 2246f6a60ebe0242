"""Drivers carry out planner instructions and feed results back as events: `LocalDriver` (in-process,
synchronous) and `DaskDriver` (a Dask cluster: services resident in worker processes, a CPU pool)."""

from plexrl.drivers.base import Budgets
from plexrl.drivers.dask import DaskDriver
from plexrl.drivers.local import LocalDriver

__all__ = ["Budgets", "DaskDriver", "LocalDriver"]
