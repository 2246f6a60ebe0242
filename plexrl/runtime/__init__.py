"""The runtime: ONE loop (`Runner`) over an `Executor` interface with three implementations (inline, Dask,
simulated). See `runner.py` for the loop and `executor.py` for the interface."""

from plexrl.runtime.executor import Executor, Finished, Handle, LoadReport, NodeReport, NodeTask
from plexrl.runtime.inline import InlineExecutor
from plexrl.runtime.runner import Budgets, Runner

__all__ = [
    "Budgets",
    "Executor",
    "Finished",
    "Handle",
    "InlineExecutor",
    "LoadReport",
    "NodeReport",
    "NodeTask",
    "Runner",
]
