"""A user's own operators, outside the project (used from YAML by dotted path in the tests)."""

from __future__ import annotations

from plexrl import operator
from plexrl.batch import Rewards, Rollouts


@operator(placement="cpu")
def length_penalty(rollouts: Rollouts, rewards: Rewards, *, per_token: float = 0.01) -> Rewards:
    """Subtract `per_token` per response token from each reward."""
    return Rewards(values=rewards.values - per_token * rollouts.response_lengths.float(), correct=rewards.correct)


def not_an_operator() -> None:
    """A plain function: naming it as an operator must be refused."""
