"""The policy update: GRPO's clipped surrogate with optional KL to a reference, run on the service."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from plexrl.batch import Advantages, LogProbs, Rollouts, TrainStats
from plexrl.operator import OpContext, operator

if TYPE_CHECKING:
    from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor, agg: str = "token_mean") -> Tensor:
    """Mean of x [N, L] over mask [N, L]: over all tokens (`token_mean`) or per sequence then over
    sequences (`seq_mean`)."""
    if agg == "token_mean":
        return (x * mask).sum() / mask.sum().clamp(min=1)
    per_seq = (x * mask).sum(1) / mask.sum(1).clamp(min=1)
    return per_seq.mean()


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    agg: str = "token_mean",
) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss, all [N, L] except advantages [N]:

        ratio = exp(logp - old_logp);  A broadcast over tokens
        loss  = mean_mask( -min(ratio * A, clip(ratio, 1-eps, 1+eps) * A) ) + kl_coef * mean_mask(k3)
        k3    = exp(ref - logp) - (ref - logp) - 1        (an unbiased, non-negative KL estimate)

    Returns (loss, {pg_loss, kl, clip_frac}).

    >>> import torch
    >>> one = torch.ones(1, 1)
    >>> loss, s = grpo_loss(torch.log(1.5 * one), 0 * one, torch.ones(1), one, clip_eps=0.2)
    >>> round(float(loss), 4), s["clip_frac"]
    (-1.2, 1.0)
    """
    import torch

    adv = advantages[:, None]
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    pg = -torch.minimum(unclipped, clipped)
    pg_loss = masked_mean(pg, mask, agg)
    # tokens where the clipped term is the one used (its gradient is zero)
    clipped_now = ((ratio > 1 + clip_eps) & (adv > 0)) | ((ratio < 1 - clip_eps) & (adv < 0))
    clip_frac = masked_mean(clipped_now.float(), mask, "token_mean")
    kl = torch.zeros(())
    loss = pg_loss
    if ref_logp is not None:
        d = torch.where(mask.bool(), ref_logp - logp, torch.zeros_like(logp))  # exp() of masked columns overflows
        kl = masked_mean(torch.exp(d) - d - 1, mask, agg)
        loss = loss + kl_coef * kl
    return loss, {"pg_loss": float(pg_loss.detach()), "kl": float(kl.detach()), "clip_frac": float(clip_frac)}


@operator(placement="service")
def train(
    rollouts: Rollouts,
    advantages: Advantages,
    ctx: OpContext,
    ref_logprobs: LogProbs | None = None,
    *,
    lr: Annotated[float, Field(gt=0, lt=1)] = 1e-3,
    clip_eps: Annotated[float, Field(gt=0, lt=1)] = 0.2,
    kl_coef: Annotated[float, Field(ge=0)] = 0.0,
    max_grad_norm: Annotated[float, Field(gt=0)] = 1.0,
    weight_decay: Annotated[float, Field(ge=0)] = 0.0,
    minibatches: Annotated[int, Field(ge=1)] = 1,
    epochs: Annotated[int, Field(ge=1)] = 1,
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean",
    adam_beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9,
    adam_beta2: Annotated[float, Field(ge=0, lt=1)] = 0.999,
    skip_zero_advantage: bool = True,
) -> TrainStats:
    """One policy update from a rollout: `epochs` x `minibatches` AdamW steps on the GRPO loss
    (`grpo_loss`), gradient clipping at `max_grad_norm`; KL to the reference when `ref_logprobs` is given
    and `kl_coef` > 0. With `skip_zero_advantage`, rows whose advantage is exactly 0 (groups where every
    sample got the same reward) are left out: they add no policy gradient, only compute. Reports loss,
    pg_loss, kl, clip_frac, entropy, grad_norm, and `rows` trained on."""
    import torch

    batch = {
        "input_ids": rollouts.input_ids,
        "attention_mask": rollouts.attention_mask,
        "mask": rollouts.response_mask,
        "old_logp": rollouts.behaviour_logprobs,
        "adv": advantages.values,
    }
    if ref_logprobs is not None and kl_coef > 0:
        batch["ref_logp"] = ref_logprobs.values
    if skip_zero_advantage:
        keep = advantages.values != 0
        batch = {k: v[keep] for k, v in batch.items()}
    rows = int(batch["adv"].shape[0])
    if rows == 0:
        return TrainStats(stats={"rows": 0.0, "steps": 0.0}, weight_version=ctx.engine.weight_version)

    def loss_fn(mb: dict[str, Tensor], logp: Tensor, entropy: Tensor) -> tuple[Tensor, dict[str, float]]:
        loss, stats = grpo_loss(
            logp,
            mb["old_logp"],
            mb["adv"],
            mb["mask"],
            clip_eps=clip_eps,
            ref_logp=mb.get("ref_logp"),
            kl_coef=kl_coef,
            agg=loss_agg,
        )
        with torch.no_grad():
            stats["entropy"] = float(masked_mean(entropy, mb["mask"]))
        return loss, stats

    stats = ctx.engine.train_step(
        batch,
        loss_fn,
        temperature=rollouts.temperature,
        lr=lr,
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        minibatches=minibatches,
        epochs=epochs,
        betas=(adam_beta1, adam_beta2),
    )
    return TrainStats(stats={**stats, "rows": float(rows)}, weight_version=ctx.engine.weight_version)
