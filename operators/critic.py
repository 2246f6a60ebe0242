"""PPO's critic: value estimates (service), GAE advantages (cpu) and the value-model update (service)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from plexrl.batch import Advantages, Rewards, Rollouts, TrainStats, Values
from plexrl.operator import OpContext, operator
from plexrl.operators.advantage import Std, all_equal

if TYPE_CHECKING:
    from torch import Tensor


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens.

    rewards [N] (a sequence-level reward, given at the last response token), values [N, L] and mask [N, L]
    (response tokens) -> (advantages [N, L], returns [N, L]), 0 where masked. With the value after the
    last token 0: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, R_t = A_t + V_t.

    >>> import torch
    >>> adv, ret = gae(torch.tensor([1.0]), torch.tensor([[0.0, 0.5, 0.25]]), torch.tensor([[0.0, 1.0, 1.0]]),
    ...                gamma=1.0, lam=1.0)
    >>> adv.tolist(), ret.tolist()
    ([[0.0, 0.5, 0.75]], [[0.0, 1.0, 1.0]])
    """
    import torch

    n, length = mask.shape
    last = (mask * torch.arange(length)).argmax(1)  # index of the last response token
    token_rewards = torch.zeros(n, length)
    token_rewards[torch.arange(n), last] = rewards.float()
    adv = torch.zeros(n, length)
    next_value = torch.zeros(n)
    running = torch.zeros(n)
    for t in range(length - 1, -1, -1):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(m > 0, delta + gamma * lam * running, running)
        adv[:, t] = running * m
        next_value = torch.where(m > 0, values[:, t], next_value)
    return adv, (adv + values) * mask


@operator(runs_on="service")
def value_estimate(rollouts: Rollouts, ctx: OpContext) -> Values:
    """The critic's V for every response token of the rollout ([N, L], 0 elsewhere)."""
    values = ctx.engine.values(rollouts.input_ids, rollouts.attention_mask)
    return Values(values=values * rollouts.response_mask)


@operator(runs_on="cpu")
def gae_advantage(
    rollouts: Rollouts,
    rewards: Rewards,
    values: Values,
    *,
    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0,
    lam: Annotated[float, Field(ge=0, le=1)] = 0.95,
    whiten: bool = True,
    std: Std = "biased",
) -> Advantages:
    """Per-token GAE advantages and returns (see `gae`); `whiten` normalises the advantages over the
    batch's response tokens (mean 0, `std` 1; see `whiten_tokens`). Returns are never whitened."""
    mask = rollouts.response_mask
    adv, returns = gae(rewards.values, values.values, mask, gamma=gamma, lam=lam)
    if whiten:
        adv = whiten_tokens(adv, mask, std=std)
    return Advantages(values=adv, returns=returns)


def whiten_tokens(x: Tensor, mask: Tensor, *, std: Std = "biased", eps: float = 1e-6) -> Tensor:
    """(x - mean) / (std + eps) over the tokens where mask > 0 (each token counts once), in float64;
    x, mask [N, L] -> [N, L] float32, 0 where masked. Tokens that are all equal (see
    `operators.advantage.all_equal`) give exactly 0 instead of rounding error / eps.

    >>> import torch
    >>> whiten_tokens(torch.tensor([[1.0, 3.0, 9.0]]), torch.tensor([[1.0, 1.0, 0.0]]), eps=0.0).tolist()
    [[-1.0, 1.0, 0.0]]
    """
    import torch

    m = mask > 0
    tokens = x.double()[m]
    if tokens.numel() == 0 or bool(all_equal(tokens, 0)):
        return torch.zeros_like(x, dtype=torch.float32)
    out = (x.double() - tokens.mean()) / (tokens.std(correction=int(std == "unbiased")) + eps)
    return torch.where(m, out, torch.zeros_like(out)).float()


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float) -> Tensor:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, +-c),
    averaged over masked tokens."""
    import torch

    clipped = old_values + (values - old_values).clamp(-clip, clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


@operator(runs_on="service")
def train_critic(
    rollouts: Rollouts,
    advantages: Advantages,
    values: Values,
    ctx: OpContext,
    *,
    lr: Annotated[float, Field(gt=0, lt=1)] = 1e-3,
    clip: Annotated[float, Field(gt=0)] = 0.2,
    max_grad_norm: Annotated[float, Field(gt=0)] = 1.0,
    minibatches: Annotated[int, Field(ge=1)] = 2,
) -> TrainStats:
    """Regress the critic on the GAE returns with the clipped value loss."""
    if advantages.returns is None:
        raise ValueError("train_critic needs advantages with returns; feed it from gae_advantage")
    batch = {
        "input_ids": rollouts.input_ids,
        "attention_mask": rollouts.attention_mask,
        "mask": rollouts.response_mask,
        "old_values": values.values,
        "returns": advantages.returns,
    }

    def loss_fn(mb: dict[str, Tensor], v: Tensor) -> tuple[Tensor, dict[str, float]]:
        loss = value_loss(v, mb["old_values"], mb["returns"], mb["mask"], clip=clip)
        return loss, {"value_loss": float(loss.detach())}

    stats = ctx.engine.train_critic_step(batch, loss_fn, lr=lr, max_grad_norm=max_grad_norm, minibatches=minibatches)
    return TrainStats(stats=stats, weight_version=ctx.engine.weight_version)
