"""Advantage estimators (pure tensor functions on the CPU pool).

Conventions shared by every estimator here (see docs/algorithms.md, "Numerical conventions"):

- statistics are computed in float64 and the result is returned as float32;
- a group (or batch) whose rewards spread by at most `EQUAL_TOL` x max(1, max |r|) is *all-equal*: its
  advantages are exactly 0, never `rounding error / (tiny std + eps)`, so that `train`'s
  `skip_zero_advantage` recognises it;
- `std="biased"` divides by G (numpy's default, the one used so far here); `"unbiased"` divides by G - 1
  (torch's default, used by the reference implementations of GRPO and of whitening).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from plexrl.batch import Advantages, Rewards, Rollouts
from plexrl.operator import operator

if TYPE_CHECKING:
    from torch import Tensor

Std = Literal["biased", "unbiased"]
EQUAL_TOL = 1e-6  # relative spread under which rewards count as all equal (float32 rewards carry ~6e-8)


def all_equal(r: Tensor, dim: int = -1, mask: Tensor | None = None) -> Tensor:
    """True where the values of `r` along `dim` (only where `mask` > 0, if given) spread by at most
    EQUAL_TOL x max(1, max |r|). Returns the reduced tensor with `dim` kept (size 1)."""
    import torch

    if mask is not None:
        big = torch.finfo(r.dtype).max
        hi = torch.where(mask > 0, r, torch.full_like(r, -big)).amax(dim, keepdim=True)
        lo = torch.where(mask > 0, r, torch.full_like(r, big)).amin(dim, keepdim=True)
        hi, lo = torch.maximum(hi, lo), torch.minimum(hi, lo)  # no masked value at all: spread 0
        top = torch.where(mask > 0, r.abs(), torch.zeros_like(r)).amax(dim, keepdim=True)
    else:
        hi, lo = r.amax(dim, keepdim=True), r.amin(dim, keepdim=True)
        top = r.abs().amax(dim, keepdim=True)
    return (hi - lo) <= EQUAL_TOL * top.clamp(min=1.0)


def _std(x: Tensor, kind: str, dim: int | None = None) -> Tensor:
    """Standard deviation along `dim` (all elements when None); `kind` "biased" (/n) or "unbiased" (/(n-1))."""
    if kind not in ("biased", "unbiased"):
        raise ValueError(f"std must be 'biased' or 'unbiased', got {kind!r}")
    if dim is None:
        return x.std(correction=int(kind == "unbiased"))
    return x.std(dim, keepdim=True, correction=int(kind == "unbiased"))


def group_advantages(
    rewards: Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-6, std: Std = "biased"
) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's `std` plus `eps` when
    `scale`. rewards [N] with N = P*G, rows of a group contiguous -> [N] float32. All-equal groups (see the
    module docstring), and groups of one, get exactly 0; an empty batch gives an empty result.

    >>> import torch
    >>> [round(x, 4) for x in group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 2).tolist()]
    [1.0, -1.0, 0.0, 0.0]
    >>> group_advantages(torch.tensor([0.3] * 3), 3).tolist()  # no +-0.26 from a rounded mean
    [0.0, 0.0, 0.0]
    """
    import torch

    if rewards.numel() == 0:
        return rewards.float()
    r = rewards.double().view(-1, group_size)
    flat = all_equal(r, 1)
    adv = r - r.mean(1, keepdim=True)
    if scale and group_size > 1:
        adv = adv / (_std(r, std, 1) + eps)
    return torch.where(flat, torch.zeros_like(adv), adv).float().view(-1)


@operator(runs_on="cpu")
def grpo_advantage(
    rollouts: Rollouts,
    rewards: Rewards,
    *,
    scale: bool = True,
    eps: Annotated[float, Field(ge=0)] = 1e-6,
    std: Std = "biased",
) -> Advantages:
    """Group-normalised advantages over the `group_size` samples of each prompt (see `group_advantages`);
    `std` picks the divisor of the group's standard deviation (biased: G, the default; unbiased: G - 1)."""
    return Advantages(values=group_advantages(rewards.values, rollouts.group_size, scale=scale, eps=eps, std=std))


def leave_one_out_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: each reward minus the mean of the OTHER samples of its group, = G/(G-1) * (r - group mean).
    rewards [N] -> [N] float32; all-equal groups get exactly 0; needs G >= 2.

    >>> import torch
    >>> leave_one_out_advantages(torch.tensor([1.0, 0.0, 0.0, 2.0]), 2).tolist()
    [1.0, -1.0, -2.0, 2.0]
    """
    import torch

    if group_size < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt (n >= 2)")
    if rewards.numel() == 0:
        return rewards.float()
    r = rewards.double().view(-1, group_size)
    adv = (r - r.mean(1, keepdim=True)) * group_size / (group_size - 1)
    return torch.where(all_equal(r, 1), torch.zeros_like(adv), adv).float().view(-1)


def _baseline(rewards: Tensor, group_size: int, group_baseline: bool) -> Tensor:
    """float64 scores [N]: the rewards, minus their group's mean when `group_baseline` (all-equal groups
    exactly 0). Raises ValueError for a group baseline over groups of one (it would leave all zeros)."""
    import torch

    r = rewards.double()
    if not group_baseline:
        return r
    if group_size < 2:
        raise ValueError(
            "REINFORCE++ with group_baseline needs at least 2 samples per prompt (n >= 2): with n = 1 every "
            "reward minus its own mean is 0 and nothing would be learnt; raise n or set group_baseline=false"
        )
    g = r.view(-1, group_size)
    return torch.where(all_equal(g, 1), torch.zeros_like(g), g - g.mean(1, keepdim=True)).view(-1)


def batch_normalized_advantages(
    rewards: Tensor, group_size: int, *, group_baseline: bool, eps: float = 1e-6, std: Std = "biased"
) -> Tensor:
    """REINFORCE++, sequence level: rewards (minus their group mean when `group_baseline`) normalised by the
    mean and `std` of the WHOLE batch, one value per sequence. rewards [N] -> [N] float32; an all-equal
    batch gets exactly 0. Raises ValueError for `group_baseline` with groups of one.

    >>> import torch
    >>> [round(x, 3) for x in batch_normalized_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2,
    ...                                                    group_baseline=False).tolist()]
    [0.577, -1.732, 0.577, 0.577]
    """
    import torch

    r = _baseline(rewards, group_size, group_baseline)
    if r.numel() == 0 or bool(all_equal(r, 0)):
        return torch.zeros_like(r).float()
    return ((r - r.mean()) / (_std(r, std) + eps)).float()


def token_normalized_advantages(
    rewards: Tensor,
    mask: Tensor,
    group_size: int,
    *,
    group_baseline: bool,
    gamma: float = 1.0,
    eps: float = 1e-6,
    std: Std = "biased",
) -> Tensor:
    """REINFORCE++ in the reference form, token level: the sequence's score (reward, minus the group mean
    when `group_baseline`) is given at its last response token and discounted back, so a token with k
    response tokens after it gets gamma^k x score; these returns are whitened with the mean and `std` of
    all response tokens of the batch (each token counts once, so longer responses weigh more).
    rewards [N], mask [N, L] (response tokens) -> [N, L] float32, 0 where masked; an all-equal batch gets 0.

    >>> import torch
    >>> m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    >>> [[round(x, 3) for x in row] for row in token_normalized_advantages(
    ...     torch.tensor([1.0, 0.0]), m, 1, group_baseline=False, gamma=0.5).tolist()]
    [[0.0, 1.225, 0.0], [-1.225, 0.0, 0.0]]
    """
    import torch

    scores = _baseline(rewards, group_size, group_baseline)
    m = mask.double()
    after = m.flip(1).cumsum(1).flip(1) - m  # response tokens after each position
    returns = scores[:, None] * torch.pow(torch.full_like(m, gamma), after) * m
    tokens = returns[m > 0]
    if tokens.numel() == 0 or bool(all_equal(tokens, 0)):
        return torch.zeros_like(returns).float()
    adv = (returns - tokens.mean()) / (_std(tokens, std) + eps)
    return torch.where(m > 0, adv, torch.zeros_like(adv)).float()


@operator(runs_on="cpu")
def rloo_advantage(rollouts: Rollouts, rewards: Rewards) -> Advantages:
    """REINFORCE leave-one-out advantages (Ahmadian et al., 2024); see `leave_one_out_advantages`."""
    return Advantages(values=leave_one_out_advantages(rewards.values, rollouts.group_size))


@operator(runs_on="cpu")
def reinforce_pp_advantage(
    rollouts: Rollouts,
    rewards: Rewards,
    *,
    group_baseline: bool = False,
    eps: Annotated[float, Field(ge=0)] = 1e-6,
    std: Std = "biased",
    level: Literal["sequence", "token"] = "sequence",
    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0,
) -> Advantages:
    """REINFORCE++ advantages (Hu, 2025): global batch normalisation, optionally after a group-mean
    baseline ("REINFORCE++-baseline").

    `level="sequence"` (default): one advantage per sequence, statistics over sequences
    (`batch_normalized_advantages`). `level="token"`: the reference implementations' form, per-token
    returns discounted by `gamma` and statistics over response tokens (`token_normalized_advantages`);
    `gamma` < 1 needs `level="token"`. Raises ValueError for `group_baseline` with n = 1."""
    if level == "sequence":
        if gamma != 1.0:
            raise ValueError(f"gamma={gamma} discounts per token; set level='token' or leave gamma at 1")
        values = batch_normalized_advantages(
            rewards.values, rollouts.group_size, group_baseline=group_baseline, eps=eps, std=std
        )
    else:
        values = token_normalized_advantages(
            rewards.values, rollouts.response_mask, rollouts.group_size, group_baseline=group_baseline,
            gamma=gamma, eps=eps, std=std,
        )  # fmt: skip
    return Advantages(values=values)
