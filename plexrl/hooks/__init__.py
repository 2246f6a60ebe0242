"""Lifecycle hooks: tracking, timing and progress live here, never in operators or the planner."""

from plexrl.hooks.base import Hook, HookList

__all__ = ["Hook", "HookList"]
