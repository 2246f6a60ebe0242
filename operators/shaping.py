"""Reward shaping on the CPU pool."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from plexrl.batch import Rewards, Rollouts
from plexrl.operator import operator

if TYPE_CHECKING:
    from torch import Tensor


def overlong_penalties(lengths: Tensor, max_length: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment per response: 0 up to `max_length - buffer` tokens, then falling
    linearly to -1 at `max_length`, and -1 beyond. lengths [N] -> [N].

    >>> import torch
    >>> overlong_penalties(torch.tensor([2, 4, 5, 6, 9]), max_length=6, buffer=2).tolist()
    [0.0, 0.0, -0.5, -1.0, -1.0]
    """
    import torch

    start = max_length - buffer
    over = (lengths.float() - start).clamp(min=0)
    return torch.clamp(over / max(buffer, 1), max=1.0).neg() + 0.0  # + 0.0 turns -0.0 into 0.0


@operator(runs_on="cpu")
def overlong_penalty(
    rollouts: Rollouts,
    rewards: Rewards,
    *,
    max_length: Annotated[int, Field(ge=1)] = 6,
    buffer: Annotated[int, Field(ge=1)] = 2,
    scale: Annotated[float, Field(ge=0)] = 1.0,
) -> Rewards:
    """Add `scale` x the soft overlong penalty of each response's length (DAPO) to its reward."""
    penalty = scale * overlong_penalties(rollouts.response_lengths, max_length, buffer)
    return Rewards(values=rewards.values + penalty, correct=rewards.correct)
