"""Verifiable tasks: seeded problem generators with train and held-out splits, and pure verifiers."""

from plexrl.tasks.arithmetic import ArithmeticTask, Problem, make_task, verify_answers

__all__ = ["ArithmeticTask", "Problem", "make_task", "verify_answers"]
