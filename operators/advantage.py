"""Advantage estimators (pure tensor functions on the CPU pool)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from plexrl.batch import Advantages, Rewards, Rollouts
from plexrl.operator import operator

if TYPE_CHECKING:
    from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std (unbiased=False)
    plus `eps` when `scale`. rewards [N] with N = P*G, rows of a group contiguous -> [N].

    >>> import torch
    >>> [round(x, 4) for x in group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 2).tolist()]
    [1.0, -1.0, 0.0, 0.0]
    """
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if scale:
        adv = adv / (r.std(1, keepdim=True, unbiased=False) + eps)
    return adv.view(-1)


@operator(placement="cpu")
def grpo_advantage(
    rollouts: Rollouts,
    rewards: Rewards,
    *,
    scale: bool = True,
    eps: Annotated[float, Field(ge=0)] = 1e-6,
) -> Advantages:
    """Group-normalised advantages over the `group_size` samples of each prompt (see `group_advantages`)."""
    return Advantages(values=group_advantages(rewards.values, rollouts.group_size, scale=scale, eps=eps))
