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


def leave_one_out_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: each reward minus the mean of the OTHER samples of its group, = G/(G-1) * (r - group mean).
    rewards [N] -> [N]; needs G >= 2.

    >>> import torch
    >>> leave_one_out_advantages(torch.tensor([1.0, 0.0, 0.0, 2.0]), 2).tolist()
    [1.0, -1.0, -2.0, 2.0]
    """
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt (n >= 2)")
    r = rewards.float().view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) * group_size / (group_size - 1)).view(-1)


def batch_normalized_advantages(rewards: Tensor, group_size: int, *, group_baseline: bool, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: rewards (minus their group mean when `group_baseline`) normalised by the mean and std
    of the WHOLE batch, not per group. rewards [N] -> [N].

    >>> import torch
    >>> [round(x, 3) for x in batch_normalized_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2,
    ...                                                    group_baseline=False).tolist()]
    [0.577, -1.732, 0.577, 0.577]
    """
    r = rewards.float()
    if group_baseline:
        g = r.view(-1, group_size)
        r = (g - g.mean(1, keepdim=True)).view(-1)
    return (r - r.mean()) / (r.std(unbiased=False) + eps)


@operator(placement="cpu")
def rloo_advantage(rollouts: Rollouts, rewards: Rewards) -> Advantages:
    """REINFORCE leave-one-out advantages (Ahmadian et al., 2024); see `leave_one_out_advantages`."""
    return Advantages(values=leave_one_out_advantages(rewards.values, rollouts.group_size))


@operator(placement="cpu")
def reinforce_pp_advantage(
    rollouts: Rollouts,
    rewards: Rewards,
    *,
    group_baseline: bool = False,
    eps: Annotated[float, Field(ge=0)] = 1e-6,
) -> Advantages:
    """REINFORCE++ advantages (Hu, 2025): global batch normalisation, optionally after a group-mean
    baseline ("REINFORCE++-baseline"); see `batch_normalized_advantages`."""
    values = batch_normalized_advantages(rewards.values, rollouts.group_size, group_baseline=group_baseline, eps=eps)
    return Advantages(values=values)
