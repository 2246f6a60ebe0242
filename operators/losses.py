"""The loss functions of a policy update, pure tensor code (no engine, no config): `masked_mean` (the
aggregations), `kl_penalty` (the k1/k2/k3 KL estimates) and `policy_loss` (the clipped surrogate). An
`Objective` (`objective.py`) composes them from its parts; `train` (`train.py`) runs it on the service."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


LOG_RATIO_CLAMP = 20.0  # |log ratio| bound before exp(): ratios within e^+-20 (the reference implementations')
K3_CLAMP = 10.0  # upper bound of a token's k3 KL estimate


def masked_mean(
    x: Tensor,
    mask: Tensor,
    agg: str = "token_mean",
    norm_length: float | None = None,
    denominator: float | None = None,
) -> Tensor:
    """Aggregate x [N, L] over mask [N, L]:

    - `token_mean`: mean over all unmasked tokens of the batch (DAPO);
    - `seq_mean`: mean over each sequence's tokens, then over sequences (GRPO paper);
    - `seq_sum_token_mean`: sum over each sequence's tokens divided by a constant `norm_length` (default:
      the longest sequence in the batch), then mean over sequences (Dr. GRPO: no length bias).

    `denominator`, when given, replaces the batch's own count in the outer mean (its unmasked tokens for
    `token_mean`, its sequences for the other two): `train` passes the count of the batch BEFORE it skipped
    zero-advantage rows, so that skipping saves compute without rescaling the loss.

    >>> import torch
    >>> x, m = torch.tensor([[1.0, 3.0], [2.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    >>> [float(masked_mean(x, m, a)) for a in ("token_mean", "seq_mean", "seq_sum_token_mean")]
    [2.0, 2.0, 1.5]
    """
    if agg == "token_mean":
        return (x * mask).sum() / (mask.sum().clamp(min=1) if denominator is None else denominator)
    if agg == "seq_mean":
        per_seq = (x * mask).sum(1) / mask.sum(1).clamp(min=1)
    elif agg == "seq_sum_token_mean":
        norm = norm_length if norm_length is not None else float(mask.sum(1).max().clamp(min=1))
        per_seq = (x * mask).sum(1) / norm
    else:
        raise ValueError(f"unknown loss aggregation {agg!r}")
    return per_seq.mean() if denominator is None else per_seq.sum() / denominator


def kl_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy, [N, L], 0 where masked.

    k1 = logp - ref (unbiased, can be negative); k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1
    (unbiased, non-negative). Masked columns are zeroed before exp(), which could overflow there; for k3,
    ref - logp is clamped to +-LOG_RATIO_CLAMP and the estimate capped at K3_CLAMP (no gradient beyond
    either bound), as the reference implementations do, so that one extreme token cannot overflow float32.
    """
    import torch

    d = torch.where(mask.bool(), ref_logp - logp, torch.zeros_like(logp))
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(d) - d - 1).clamp(max=K3_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}")


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    agg: str = "token_mean",
    norm_length: float | None = None,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss; all [N, L] except advantages [N]:

        ratio = exp(clamp(logp - old_logp, +-20))   (`ratio_level="sequence"`: exp of the per-sequence mean, GSPO)
        pg    = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)       (eps_high: DAPO clip-higher)
        pg    = min(pg, -dual_clip * A) where A < 0                           (dual-clip, c > 1)
        loss  = agg(pg) + kl_coef * agg(kl_estimator(logp, ref))

    advantages may also be per token, [N, L] (GAE). `denominator`: see `masked_mean`. The log-ratio clamp
    (LOG_RATIO_CLAMP) keeps exp() finite in float32; a token beyond it gets no gradient through the ratio.
    Returns (loss, {pg_loss, kl, clip_frac}); clip_frac is the share of tokens where a clipped term is used.

    >>> import torch
    >>> one = torch.ones(1, 1)
    >>> loss, s = policy_loss(torch.log(1.5 * one), 0 * one, torch.ones(1), one, clip_eps=0.2)
    >>> round(float(loss), 4), s["clip_frac"]
    (-1.2, 1.0)
    """
    import torch

    high = clip_eps if clip_eps_high is None else clip_eps_high
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if ratio_level == "sequence":
        seq = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        log_ratio = seq.expand_as(logp)
    elif ratio_level != "token":
        raise ValueError(f"unknown ratio level {ratio_level!r}")
    ratio = torch.exp(log_ratio)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + high) * adv)
    clipped_now = ((ratio > 1 + high) & (adv > 0)) | ((ratio < 1 - clip_eps) & (adv < 0))
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound.expand_as(pg), pg)
        clipped_now = clipped_now | dual
    pg_loss = masked_mean(pg, mask, agg, norm_length, denominator)
    clip_frac = masked_mean(clipped_now.float(), mask, "token_mean")
    kl = torch.zeros(())
    loss = pg_loss
    if ref_logp is not None:
        kl = masked_mean(kl_penalty(logp, ref_logp, mask, kl_estimator), mask, agg, norm_length, denominator)
        loss = loss + kl_coef * kl
    return loss, {"pg_loss": float(pg_loss.detach()), "kl": float(kl.detach()), "clip_frac": float(clip_frac)}


__all__ = ["K3_CLAMP", "LOG_RATIO_CLAMP", "kl_penalty", "masked_mean", "policy_loss"]
