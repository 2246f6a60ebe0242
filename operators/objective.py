"""The parts of a policy update, composed into an `Objective` (as torchtune composes a recipe from components):

- `PolicyLoss`: the clipped surrogate (clip_eps, clip_eps_high, dual_clip, ratio_level);
- `Normaliser`: how the per-token loss is aggregated (agg, norm_length) and what it divides by when
  zero-advantage rows are skipped (skip_zero_advantage, skip_norm);
- `KlTerm`: a KL(policy || reference) loss term (coef, estimator);
- `EntropyBonus`: loss -= coef * entropy, aggregated like the policy loss (default 0: off);
- `Optimiser`: AdamW (lr, beta1, beta2, weight_decay), gradient clipping, minibatches and epochs.

`PRESETS` names an objective per built-in algorithm. `train` composes its objective from parts only
(`resolve`): the preset named by `objective`, then each part given (`policy`, `normaliser`, `kl`, `entropy`,
`optimiser`), whose fields given override the preset's part field by field (`optimiser: {lr: 1e-4}` keeps the
preset's minibatches). `train`'s old flat flags (`lr`, `clip_eps`, ...) are refused with the part and field that
replace each (`MOVED`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if TYPE_CHECKING:
    from torch import Tensor

Agg = Literal["token_mean", "seq_mean", "seq_sum_token_mean"]
KlEstimator = Literal["k1", "k2", "k3"]
PresetName = Literal["default", "grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo"]


class Part(BaseModel):
    """A validated, immutable part of an objective; unknown fields are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        unknown = sorted(set(data) - set(cls.model_fields)) if isinstance(data, dict) else []
        if unknown:
            raise ValueError(
                f"unknown field(s) {', '.join(map(repr, unknown))} of {cls.__name__}; known fields: "
                f"{', '.join(cls.model_fields)}"
            )
        return data


class PolicyLoss(Part):
    """The clipped surrogate of `policy_loss`: ratio clipped to [1 - clip_eps, 1 + clip_eps_high]
    (None: clip_eps), optional dual-clip bound c > 1 for negative advantages, token or sequence (GSPO)
    ratios."""

    clip_eps: Annotated[float, Field(gt=0, lt=1)] = 0.2
    clip_eps_high: Annotated[float, Field(gt=0, lt=10)] | None = None
    dual_clip: Annotated[float, Field(gt=1)] | None = None
    ratio_level: Literal["token", "sequence"] = "token"


class Normaliser(Part):
    """Aggregation of the per-token terms (`masked_mean`) and, with `skip_zero_advantage`, what the loss
    divides by: `full` the whole batch's count, `kept` the rows left (see `train`)."""

    agg: Agg = "token_mean"
    norm_length: Annotated[float, Field(gt=0)] | None = None
    skip_zero_advantage: bool = True
    skip_norm: Literal["full", "kept"] = "full"


class KlTerm(Part):
    """coef * agg(KL estimate); only when `train` has `ref_logprobs` and coef > 0."""

    coef: Annotated[float, Field(ge=0)] = 0.0
    estimator: KlEstimator = "k3"


class EntropyBonus(Part):
    """An entropy bonus: loss -= coef * agg(entropy), with the normaliser's aggregation; 0 adds nothing."""

    coef: Annotated[float, Field(ge=0)] = 0.0


class Optimiser(Part):
    """AdamW with gradient clipping; `epochs` x `minibatches` steps per update."""

    lr: Annotated[float, Field(gt=0, lt=1)] = 1e-3
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.999
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    max_grad_norm: Annotated[float, Field(gt=0)] = 1.0
    minibatches: Annotated[int, Field(ge=1)] = 1
    epochs: Annotated[int, Field(ge=1)] = 1


class Objective(Part):
    """The whole update: one of each part."""

    policy: PolicyLoss = PolicyLoss()
    normaliser: Normaliser = Normaliser()
    kl: KlTerm = KlTerm()
    entropy: EntropyBonus = EntropyBonus()
    optimiser: Optimiser = Optimiser()

    def loss(
        self,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        entropy: Tensor,
        *,
        ref_logp: Tensor | None = None,
        norm_length: float | None = None,
        denominator: float | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """`policy_loss` with this objective's parts, minus the entropy bonus; `norm_length` (None: the
        normaliser's) and `denominator` as `train` computes them for the batch."""
        from plexrl.operators.losses import masked_mean, policy_loss

        norm = self.normaliser
        length = norm.norm_length if norm_length is None else norm_length
        loss, stats = policy_loss(
            logp,
            old_logp,
            advantages,
            mask,
            **self.policy.model_dump(),
            ref_logp=ref_logp,
            kl_coef=self.kl.coef,
            kl_estimator=self.kl.estimator,
            agg=norm.agg,
            norm_length=length,
            denominator=denominator,
        )
        if self.entropy.coef > 0:
            bonus = masked_mean(entropy, mask, norm.agg, length, denominator)
            loss = loss - self.entropy.coef * bonus
            stats["entropy_bonus"] = float(bonus.detach())
        return loss, stats


# train's former flat flags -> the part field that replaces each (an old config gets this in its error)
MOVED: dict[str, str] = {
    "lr": "optimiser.lr",
    "adam_beta1": "optimiser.beta1",
    "adam_beta2": "optimiser.beta2",
    "weight_decay": "optimiser.weight_decay",
    "max_grad_norm": "optimiser.max_grad_norm",
    "minibatches": "optimiser.minibatches",
    "epochs": "optimiser.epochs",
    "clip_eps": "policy.clip_eps",
    "clip_eps_high": "policy.clip_eps_high",
    "dual_clip": "policy.dual_clip",
    "ratio_level": "policy.ratio_level",
    "kl_coef": "kl.coef",
    "kl_estimator": "kl.estimator",
    "loss_agg": "normaliser.agg",
    "norm_length": "normaliser.norm_length",
    "skip_zero_advantage": "normaliser.skip_zero_advantage",
    "skip_norm": "normaliser.skip_norm",
    "entropy_coef": "entropy.coef",
}


def moved(name: str) -> str:
    """The sentence for a former flat flag `name` of `train` (`MOVED`): the part field that replaces it.

    >>> moved("lr")
    '`lr` is no longer a parameter of train: set `optimiser: {lr: ...}` (the part field optimiser.lr)'
    """
    part, field = MOVED[name].split(".")
    return f"`{name}` is no longer a parameter of train: set `{part}: {{{field}: ...}}` (the part field {MOVED[name]})"


_PIPELINE_OPT = Optimiser(lr=3e-4, beta2=0.98, minibatches=2)  # the built-in pipelines' optimiser
PRESETS: dict[str, Objective] = {
    "default": Objective(),
    "grpo": Objective(optimiser=_PIPELINE_OPT),
    "dr_grpo": Objective(normaliser=Normaliser(agg="seq_sum_token_mean"), optimiser=_PIPELINE_OPT),
    "dapo": Objective(
        policy=PolicyLoss(clip_eps=0.2, clip_eps_high=0.28),
        normaliser=Normaliser(skip_norm="kept"),
        optimiser=_PIPELINE_OPT,
    ),
    "gspo": Objective(
        policy=PolicyLoss(clip_eps=3e-4, clip_eps_high=4e-4, ratio_level="sequence"),
        normaliser=Normaliser(agg="seq_mean"),
        optimiser=_PIPELINE_OPT,
    ),
    "rloo": Objective(normaliser=Normaliser(agg="seq_mean"), optimiser=Optimiser(lr=3e-4, beta2=0.98)),
    "reinforce_pp": Objective(
        normaliser=Normaliser(skip_zero_advantage=False), kl=KlTerm(estimator="k2"), optimiser=_PIPELINE_OPT
    ),
    "ppo": Objective(optimiser=_PIPELINE_OPT),
}


def given(part: Part | dict[str, Any] | None) -> dict[str, Any]:
    """The fields a part was given with: a part's `model_fields_set` (a part built from YAML or a dict knows
    which fields it was given), or the dict itself."""
    if part is None:
        return {}
    if isinstance(part, Part):
        return part.model_dump(include=set(part.model_fields_set))
    return dict(part)


def resolve(preset: str, parts: dict[str, Any] | None = None) -> Objective:
    """The objective of `train`: preset `preset`, then each part of `parts` (a `Part` or a dict of its fields;
    None: the preset's) whose GIVEN fields override the preset's part field by field. Errors name the part and
    the fix.

    >>> obj = resolve("dapo", {"optimiser": {"lr": 1e-4}, "policy": {"clip_eps_high": 0.3}})
    >>> obj.policy.clip_eps_high, obj.optimiser.lr, obj.optimiser.minibatches, obj.normaliser.skip_norm
    (0.3, 0.0001, 2, 'kept')
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown objective preset {preset!r}; known presets: {', '.join(PRESETS)}")
    fields: dict[str, Any] = PRESETS[preset].model_dump()
    types = Objective.model_fields
    for name, part in (parts or {}).items():
        if name not in types:
            raise ValueError(f"unknown objective part {name!r}; known parts: {', '.join(types)}")
        fields[name] = {**fields[name], **given(part)}
    try:
        return Objective.model_validate(fields)
    except ValidationError as exc:
        raise ValueError(f"invalid objective (preset {preset!r} with the parts given): {exc}") from None


__all__ = [
    "MOVED",
    "PRESETS",
    "EntropyBonus",
    "KlTerm",
    "Normaliser",
    "Objective",
    "Optimiser",
    "Part",
    "PolicyLoss",
    "given",
    "moved",
    "resolve",
]
