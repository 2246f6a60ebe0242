"""Drivers carry out planner instructions and feed results back as events."""

from plexrl.drivers.local import LocalDriver

__all__ = ["LocalDriver"]
