"""The policy update, run on the service: `train`, an `Objective` composed of parts (`objective.py`: the
clipped surrogate with PPO/GRPO, DAPO clip-higher, dual-clip and GSPO sequence ratios, token-mean,
sequence-mean or sequence-sum aggregation, an optional KL term and entropy bonus, AdamW), whose losses are
`losses.py`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plexrl.batch import Advantages, LogProbs, Rollouts, TrainStats
from plexrl.operator import OpContext, operator
from plexrl.operators.losses import masked_mean
from plexrl.operators.objective import (
    MOVED,
    EntropyBonus,
    KlTerm,
    Normaliser,
    Optimiser,
    PolicyLoss,
    PresetName,
    moved,
    resolve,
)

if TYPE_CHECKING:
    from torch import Tensor


@operator(runs_on="service", moved={name: moved(name) for name in MOVED})
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
    on_policy: bool = True,
) -> TrainStats:
    """One policy update from a rollout: `epochs` x `minibatches` AdamW steps on `losses.policy_loss`,
    gradient clipping at `max_grad_norm`; KL to the reference when `ref_logprobs` is given and the `kl` part's
    coef > 0; an entropy bonus (loss -= coef * entropy, aggregated like the policy loss) when the `entropy`
    part's coef > 0.

    The update is an `Objective` composed of parts only (`operators/objective.py`): the preset `objective`
    names (`default`: the defaults of every part), then each part given (`policy`, `normaliser`, `kl`,
    `entropy`, `optimiser`), whose fields given override the preset's, field by field. The former flat flags
    (`lr`, `clip_eps`, ...) are refused naming the part field that replaces each (`objective.MOVED`).

    The normaliser's `skip_zero_advantage` leaves rows whose advantage is exactly 0 out of the forward and
    backward passes; its `skip_norm` says what the loss is then divided by:

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

    obj = resolve(objective, {"policy": policy, "normaliser": normaliser, "kl": kl, "entropy": entropy,
                              "optimiser": optimiser})  # fmt: skip
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
