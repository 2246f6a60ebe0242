"""Reward verification on the CPU pool."""

from __future__ import annotations

from plexrl.batch import Rewards, Rollouts
from plexrl.operator import OpContext, operator


@operator(placement="cpu")
def verify(rollouts: Rollouts, ctx: OpContext, *, correct_reward: float = 1.0, wrong_reward: float = 0.0) -> Rewards:
    """Score each completion with the task's pure verifier: `correct_reward` if exactly right, else
    `wrong_reward` (malformed output included; it never raises). Rows without a reference answer get
    `wrong_reward` too."""
    import torch

    scores = ctx.task.verify(rollouts.completions, rollouts.answers)
    correct = torch.tensor([s == 1.0 for s in scores], dtype=torch.bool)  # bool even for 0 rows
    values = torch.where(correct, correct_reward, wrong_reward).float()
    return Rewards(values=values, correct=correct)
