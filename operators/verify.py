"""Reward verification on the CPU pool."""

from __future__ import annotations

from plexrl.batch import Rewards, Rollouts
from plexrl.operator import OpContext, operator


@operator(runs_on="cpu")
def verify(rollouts: Rollouts, ctx: OpContext, *, correct_reward: float = 1.0, wrong_reward: float = 0.0) -> Rewards:
    """Score each completion with the task's pure verifier: `correct_reward` if exactly right, else
    `wrong_reward` (malformed output included; it never raises). Rows without a reference answer get
    `wrong_reward` too.

    A task with a reward of its own (a job on data files: `data.rewards`, plexrl/rewards.py) is scored by it
    instead: the weighted sum of its terms, times `correct_reward` (`wrong_reward` is added where its first
    term did not score 1), with each term's mean and the failed calls in the metrics. A user reward gets each
    row's rendered prompt and extra fields (found by the rollout's `positions` in the train split)."""
    import torch

    if hasattr(ctx.task, "score"):
        rows = rollouts.positions if len(rollouts.positions) == len(rollouts) else None
        result = ctx.task.score(rollouts.completions, rollouts.answers, rows=rows)
        correct = torch.tensor(result.correct, dtype=torch.bool)
        total = torch.tensor(result.total, dtype=torch.float32) * correct_reward
        values = torch.where(correct, total, total + wrong_reward).float()
        return Rewards(values=values, correct=correct, components=result.metrics())
    scores = ctx.task.verify(rollouts.completions, rollouts.answers)
    correct = torch.tensor([s == 1.0 for s in scores], dtype=torch.bool)  # bool even for 0 rows
    values = torch.where(correct, correct_reward, wrong_reward).float()
    return Rewards(values=values, correct=correct)
