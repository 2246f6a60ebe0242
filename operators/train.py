"""The policy update, run on the service: a clipped surrogate (PPO/GRPO, DAPO clip-higher, dual-clip,
GSPO sequence ratios) with token-mean, sequence-mean or sequence-sum aggregation and an optional KL term."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from plexrl.batch import Advantages, LogProbs, Rollouts, TrainStats
from plexrl.operator import OpContext, operator
from plexrl.operators.objective import (
    Agg,
    EntropyBonus,
    KlEstimator,
    KlTerm,
    Normaliser,
    Optimiser,
    PolicyLoss,
    PresetName,
    resolve,
)

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


@operator(placement="service")
def train(
    rollouts: Rollouts,
    advantages: Advantages,
    ctx: OpContext,
    ref_logprobs: LogProbs | None = None,
    *,
    objective: PresetName = "default",
    policy: PolicyLoss | None = None,
    normaliser: Normaliser | None = None,
    kl: KlTerm | None = None,
    entropy: EntropyBonus | None = None,
    optimiser: Optimiser | None = None,
    lr: Annotated[float, Field(gt=0, lt=1)] | None = None,
    clip_eps: Annotated[float, Field(gt=0, lt=1)] | None = None,
    kl_coef: Annotated[float, Field(ge=0)] | None = None,
    max_grad_norm: Annotated[float, Field(gt=0)] | None = None,
    weight_decay: Annotated[float, Field(ge=0)] | None = None,
    minibatches: Annotated[int, Field(ge=1)] | None = None,
    epochs: Annotated[int, Field(ge=1)] | None = None,
    clip_eps_high: Annotated[float, Field(gt=0, lt=10)] | None = None,
    dual_clip: Annotated[float, Field(gt=1)] | None = None,
    ratio_level: Literal["token", "sequence"] | None = None,
    kl_estimator: KlEstimator | None = None,
    loss_agg: Agg | None = None,
    norm_length: Annotated[float, Field(gt=0)] | None = None,
    adam_beta1: Annotated[float, Field(ge=0, lt=1)] | None = None,
    adam_beta2: Annotated[float, Field(ge=0, lt=1)] | None = None,
    skip_zero_advantage: bool | None = None,
    skip_norm: Literal["full", "kept"] | None = None,
    entropy_coef: Annotated[float, Field(ge=0)] | None = None,
    on_policy: bool = True,
) -> TrainStats:
    """One policy update from a rollout: `epochs` x `minibatches` AdamW steps on `policy_loss` (see there
    for clip_eps_high, dual_clip, ratio_level, kl_estimator, loss_agg, norm_length), gradient clipping at
    `max_grad_norm`; KL to the reference when `ref_logprobs` is given and `kl_coef` > 0; an entropy bonus
    (loss -= entropy_coef * entropy, aggregated like the policy loss) when `entropy_coef` > 0.

    The update is an `Objective` of parts (`operators/objective.py`), resolved in three layers: the preset
    `objective` names (`default`: the defaults of every part), then the parts given whole (`policy`,
    `normaliser`, `kl`, `entropy`, `optimiser`: each replaces the preset's), then the flat flags (`lr`,
    `clip_eps`, ...; None: not set), each of which overrides one field of a part (`objective.FLAGS`). A
    flat flag cannot set a field back to None (e.g. `clip_eps_high`); give the part instead.

    `skip_zero_advantage` leaves rows whose advantage is exactly 0 out of the forward and backward passes;
    `skip_norm` says what the loss is then divided by:

    - `full` (the published GRPO, Dr. GRPO, GSPO, RLOO, PPO): the count (tokens for `token_mean`, rows
      otherwise) of the WHOLE batch, / `minibatches` per step, and rows that carry a KL term are not
      skipped: skipping only saves compute, and the step size does not depend on how many groups happened
      to be all-equal. With one minibatch the gradient equals the one without skipping; with several, each
      step divides by the whole batch's count / `minibatches` (the kept rows are split anew). A step whose
      rows were all skipped is not taken (AdamW would have moved the weights by its momentum).
    - `kept` (DAPO's dynamic sampling): groups (of `rollouts.group_size` rows) whose advantages are all 0
      leave the batch, KL term included, and each step divides by the count of its own rows.

    Reports loss, pg_loss, kl, clip_frac, entropy, grad_norm, `rows` trained on and `rows_skipped`. With
    `on_policy` (every built-in pipeline), the rollouts must have been sampled by the current weights: a
    stale rollout (e.g. a missed weight sync to the generation engine) is an error, not a silent
    off-policy update."""
    import torch

    obj = resolve(
        objective,
        {"policy": policy, "normaliser": normaliser, "kl": kl, "entropy": entropy, "optimiser": optimiser},
        {
            "lr": lr, "clip_eps": clip_eps, "kl_coef": kl_coef, "max_grad_norm": max_grad_norm,
            "weight_decay": weight_decay, "minibatches": minibatches, "epochs": epochs, "clip_eps_high": clip_eps_high,
            "dual_clip": dual_clip, "ratio_level": ratio_level, "kl_estimator": kl_estimator, "loss_agg": loss_agg,
            "norm_length": norm_length, "adam_beta1": adam_beta1, "adam_beta2": adam_beta2,
            "skip_zero_advantage": skip_zero_advantage, "skip_norm": skip_norm, "entropy_coef": entropy_coef,
        },
    )  # fmt: skip
    norm, opt = obj.normaliser, obj.optimiser
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
    with_kl = ref_logprobs is not None and obj.kl.coef > 0
    if with_kl:
        assert ref_logprobs is not None
        batch["ref_logp"] = ref_logprobs.values
    total = int(batch["adv"].shape[0])
    denominator: float | None = None
    norm_length = norm.norm_length
    if norm.skip_zero_advantage:
        keep = zero_advantage_keep(advantages.values, rollouts.group_size if norm.skip_norm == "kept" else 1)
        if norm.skip_norm == "full":
            count = batch["mask"].sum() if norm.agg == "token_mean" else torch.tensor(float(total))
            denominator = float(count.clamp(min=1)) / opt.minibatches
            if norm_length is None and norm.agg == "seq_sum_token_mean":
                norm_length = float(batch["mask"].sum(1).max().clamp(min=1))  # the whole batch's longest
            if with_kl:
                keep = torch.ones_like(keep)  # their KL term has a gradient: nothing to skip
        batch = {k: v[keep] for k, v in batch.items()}
    rows = int(batch["adv"].shape[0])
    if rows == 0:
        return TrainStats(
            stats={"rows": 0.0, "rows_skipped": float(total), "steps": 0.0}, weight_version=ctx.engine.weight_version
        )

    def loss_fn(mb: dict[str, Tensor], logp: Tensor, entropy: Tensor) -> tuple[Tensor, dict[str, float]]:
        loss, stats = obj.loss(
            logp,
            mb["old_logp"],
            mb["adv"],
            mb["mask"],
            entropy,
            ref_logp=mb.get("ref_logp"),
            norm_length=norm_length,
            denominator=denominator,
        )
        with torch.no_grad():
            stats["entropy"] = float(masked_mean(entropy, mb["mask"]))
        return loss, stats

    stats = ctx.engine.train_step(
        batch,
        loss_fn,
        temperature=rollouts.temperature,
        lr=opt.lr,
        weight_decay=opt.weight_decay,
        max_grad_norm=opt.max_grad_norm,
        minibatches=opt.minibatches,
        epochs=opt.epochs,
        betas=(opt.beta1, opt.beta2),
    )
    return TrainStats(
        stats={**stats, "rows": float(rows), "rows_skipped": float(total - rows)},
        weight_version=ctx.engine.weight_version,
    )


def zero_advantage_keep(advantages: Tensor, group_size: int = 1) -> Tensor:
    """Rows worth training on: [N] bool, False for rows whose advantage is exactly 0 (every token of it,
    for per-token advantages [N, L]); with `group_size` > 1, False only for whole groups of such rows.

    >>> import torch
    >>> zero_advantage_keep(torch.tensor([1.0, 0.0, 0.0, 0.0])).tolist()
    [True, False, False, False]
    >>> zero_advantage_keep(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=2).tolist()
    [True, True, False, False]
    """
    keep = advantages != 0
    if keep.dim() == 2:  # per-token advantages (GAE): keep rows with any non-zero token
        keep = keep.any(1)
    if group_size > 1 and keep.numel() % group_size == 0:
        keep = keep.view(-1, group_size).any(1, keepdim=True).expand(-1, group_size).reshape(-1)
    return keep
