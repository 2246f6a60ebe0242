"""The policy update, run on the service: a clipped surrogate (PPO/GRPO, DAPO clip-higher, dual-clip,
GSPO sequence ratios) with token-mean, sequence-mean or sequence-sum aggregation and an optional KL term."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from plexrl.batch import Advantages, LogProbs, Rollouts, TrainStats
from plexrl.operator import OpContext, operator

if TYPE_CHECKING:
    from torch import Tensor


Agg = Literal["token_mean", "seq_mean", "seq_sum_token_mean"]
KlEstimator = Literal["k1", "k2", "k3"]


def masked_mean(x: Tensor, mask: Tensor, agg: str = "token_mean", norm_length: float | None = None) -> Tensor:
    """Aggregate x [N, L] over mask [N, L]:

    - `token_mean`: mean over all unmasked tokens of the batch (DAPO);
    - `seq_mean`: mean over each sequence's tokens, then over sequences (GRPO paper);
    - `seq_sum_token_mean`: sum over each sequence's tokens divided by a constant `norm_length` (default:
      the longest sequence in the batch), then mean over sequences (Dr. GRPO: no length bias).

    >>> import torch
    >>> x, m = torch.tensor([[1.0, 3.0], [2.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    >>> [float(masked_mean(x, m, a)) for a in ("token_mean", "seq_mean", "seq_sum_token_mean")]
    [2.0, 2.0, 1.5]
    """
    if agg == "token_mean":
        return (x * mask).sum() / mask.sum().clamp(min=1)
    if agg == "seq_mean":
        return ((x * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    if agg == "seq_sum_token_mean":
        norm = norm_length if norm_length is not None else float(mask.sum(1).max().clamp(min=1))
        return ((x * mask).sum(1) / norm).mean()
    raise ValueError(f"unknown loss aggregation {agg!r}")


def kl_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy, [N, L], 0 where masked.

    k1 = logp - ref (unbiased, can be negative); k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1
    (unbiased, non-negative). Masked columns are zeroed before exp(), which could overflow there.
    """
    import torch

    d = torch.where(mask.bool(), ref_logp - logp, torch.zeros_like(logp))
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(d) - d - 1
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
) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss; all [N, L] except advantages [N]:

        ratio = exp(logp - old_logp)   (`ratio_level="sequence"`: exp of the per-sequence mean, GSPO)
        pg    = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)       (eps_high: DAPO clip-higher)
        pg    = min(pg, -dual_clip * A) where A < 0                           (dual-clip, c > 1)
        loss  = agg(pg) + kl_coef * agg(kl_estimator(logp, ref))

    advantages may also be per token, [N, L] (GAE). Returns (loss, {pg_loss, kl, clip_frac}); clip_frac is
    the share of tokens where a clipped term is used.

    >>> import torch
    >>> one = torch.ones(1, 1)
    >>> loss, s = policy_loss(torch.log(1.5 * one), 0 * one, torch.ones(1), one, clip_eps=0.2)
    >>> round(float(loss), 4), s["clip_frac"]
    (-1.2, 1.0)
    """
    import torch

    high = clip_eps if clip_eps_high is None else clip_eps_high
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    log_ratio = logp - old_logp
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
    pg_loss = masked_mean(pg, mask, agg, norm_length)
    clip_frac = masked_mean(clipped_now.float(), mask, "token_mean")
    kl = torch.zeros(())
    loss = pg_loss
    if ref_logp is not None:
        kl = masked_mean(kl_penalty(logp, ref_logp, mask, kl_estimator), mask, agg, norm_length)
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
    clip_eps_high: Annotated[float, Field(gt=0, lt=10)] | None = None,
    dual_clip: Annotated[float, Field(gt=1)] | None = None,
    ratio_level: Literal["token", "sequence"] = "token",
    kl_estimator: KlEstimator = "k3",
    loss_agg: Agg = "token_mean",
    norm_length: Annotated[float, Field(gt=0)] | None = None,
    adam_beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9,
    adam_beta2: Annotated[float, Field(ge=0, lt=1)] = 0.999,
    skip_zero_advantage: bool = True,
    on_policy: bool = True,
) -> TrainStats:
    """One policy update from a rollout: `epochs` x `minibatches` AdamW steps on `policy_loss` (see there
    for clip_eps_high, dual_clip, ratio_level, kl_estimator, loss_agg, norm_length), gradient clipping at
    `max_grad_norm`; KL to the reference when `ref_logprobs` is given
    and `kl_coef` > 0. With `skip_zero_advantage`, rows whose advantage is exactly 0 (groups where every
    sample got the same reward) are left out: they add no policy gradient, only compute. Reports loss,
    pg_loss, kl, clip_frac, entropy, grad_norm, and `rows` trained on. With `on_policy` (every built-in
    pipeline), the rollouts must have been sampled by the current weights: a stale rollout (e.g. a missed
    weight sync to the generation engine) is an error, not a silent off-policy update."""
    import torch

    if on_policy and rollouts.weight_version != ctx.engine.weight_version:
        raise RuntimeError(
            f"on-policy update on rollouts sampled by weight version {rollouts.weight_version}, but the policy "
            f"is at version {ctx.engine.weight_version}: the generation engine missed a weight sync; an "
            "off-policy pipeline must set on_policy=false on its train node"
        )

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
        if keep.dim() == 2:  # per-token advantages (GAE): keep rows with any non-zero token
            keep = keep.any(1)
        batch = {k: v[keep] for k, v in batch.items()}
    rows = int(batch["adv"].shape[0])
    if rows == 0:
        return TrainStats(stats={"rows": 0.0, "steps": 0.0}, weight_version=ctx.engine.weight_version)

    def loss_fn(mb: dict[str, Tensor], logp: Tensor, entropy: Tensor) -> tuple[Tensor, dict[str, float]]:
        loss, stats = policy_loss(
            logp,
            mb["old_logp"],
            mb["adv"],
            mb["mask"],
            clip_eps=clip_eps,
            clip_eps_high=clip_eps_high,
            dual_clip=dual_clip,
            ratio_level=ratio_level,
            ref_logp=mb.get("ref_logp"),
            kl_coef=kl_coef,
            kl_estimator=kl_estimator,
            agg=loss_agg,
            norm_length=norm_length,
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
