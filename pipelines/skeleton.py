"""The one skeleton every built-in pipeline is built from, GRPO's:

    prompts -> rollout -> verify -> [shape] -> advantage -> train -> evaluate (every k)
                  \\-> ref_logprob (only when the objective's KL coef > 0) --/

`build` lays it out; a pipeline file says only what differs from GRPO: its objective preset (`train`'s
parts, `operators/objective.py`), its own knobs (a subclass of `Knobs`), and the stages it replaces
(`sample`: how rollouts and their rewards are made; `shape`: a reward shaping; `advantage`; `after_train`:
nodes beside the update, e.g. a critic's; `evaluate`). The knobs every pipeline shares are `Knobs`': the
batch, the sampling, the evaluation, the verifier's latency, and the update's parts (`policy`,
`normaliser`, `kl`, `entropy`, `optimiser`), whose fields given override the preset's field by field (the
defaults of an update live in its preset, nowhere else).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from plexrl.graph import NodeRef, Pipeline, PipelineGraph
from plexrl.operators.objective import (
    MOVED,
    EntropyBonus,
    KlTerm,
    Normaliser,
    Optimiser,
    PolicyLoss,
    given,
    resolve,
)

PARTS = ("policy", "normaliser", "kl", "entropy", "optimiser")
# the built-in pipelines' former flat knobs -> the part field that replaces each (`train`'s, and two of their own)
MOVED_KNOBS = {**MOVED, "clip_eps_low": "policy.clip_eps"}


class Knobs(BaseModel):
    """The parameters every built-in pipeline takes (`pipeline.params`); a pipeline's own knobs subclass it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int = Field(64, ge=1, description="Prompts per iteration.")
    n: int = Field(8, ge=2, description="Samples per prompt; group advantages need at least 2.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    max_new_tokens: int = Field(6, ge=1, description="Tokens generated per response (evaluation too).")
    eval_every: int = Field(20, ge=1, description="Iterations between two held-out evaluations.")
    eval_size: int = Field(500, ge=1, description="Held-out problems per evaluation.")
    verifier_latency_s: float = Field(
        0.0, ge=0, description="> 0: verify through a remote verifier with this round trip (`remote_verify`)."
    )
    policy: PolicyLoss | None = Field(None, description="The clipped surrogate's fields to change (train's part).")
    normaliser: Normaliser | None = Field(None, description="The loss aggregation's fields to change.")
    kl: KlTerm | None = Field(None, description="The KL term's fields to change (coef > 0 adds a reference).")
    entropy: EntropyBonus | None = Field(None, description="The entropy bonus's fields to change.")
    optimiser: Optimiser | None = Field(None, description="The optimiser's fields to change (lr, minibatches, ...).")

    @model_validator(mode="before")
    @classmethod
    def _former_knobs(cls, data: Any) -> Any:
        if isinstance(data, dict):
            old = sorted(k for k in data if k in MOVED_KNOBS and k not in cls.model_fields)
            if old:
                fixes = "; ".join(f"`{k}` -> `{MOVED_KNOBS[k].split('.')[0]}: {{{MOVED_KNOBS[k].split('.')[1]}: ...}}`"
                                  for k in old)  # fmt: skip
                raise ValueError(
                    f"{', '.join(old)}: the update is composed of train's parts now; set the part field instead "
                    f"({fixes}); a part's fields given override the algorithm's preset"
                )
        return data


Sample = Callable[[Pipeline, NodeRef], tuple[NodeRef, NodeRef]]  # (p, prompts) -> (rollouts, rewards)
Shape = Callable[[Pipeline, NodeRef, NodeRef], NodeRef]  # (p, rollouts, rewards) -> shaped rewards
Advantage = Callable[[Pipeline, NodeRef, NodeRef], NodeRef]  # (p, rollouts, rewards) -> advantages
AfterTrain = Callable[[Pipeline, NodeRef], Sequence[NodeRef]]  # (p, train) -> more nodes evaluation waits for
Evaluate = Callable[[Pipeline, Sequence[NodeRef]], NodeRef]  # (p, nodes it runs after) -> the evaluation


def verify(p: Pipeline, knobs: Knobs, rollouts: NodeRef, name: str = "verify") -> NodeRef:
    """The verifier node: local, or remote with the knobs' round trip."""
    if knobs.verifier_latency_s > 0:
        return p.add(name, "remote_verify", rollouts=rollouts, latency_s=knobs.verifier_latency_s)
    return p.add(name, "verify", rollouts=rollouts)


def sampling(knobs: Knobs) -> dict[str, Any]:
    """The rollout node's parameters from the knobs."""
    return {"n": knobs.n, "temperature": knobs.temperature, "max_new_tokens": knobs.max_new_tokens}


def advantage_by(op: str, **params: Any) -> Advantage:
    """An advantage stage: one node `advantage` of operator `op` on the rollouts and their rewards."""

    def stage(p: Pipeline, rollouts: NodeRef, rewards: NodeRef) -> NodeRef:
        return p.add("advantage", op, rollouts=rollouts, rewards=rewards, **params)

    return stage


def update(knobs: Knobs, defaults: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """`train`'s parts for this pipeline: its own defaults (`defaults`, beyond the preset's; e.g. Dr. GRPO's
    norm_length from the generation budget), then the fields the knobs give. Parts with nothing to change are
    left out: the preset's stand."""
    out = {}
    for name in PARTS:
        fields = {**(defaults or {}).get(name, {}), **given(getattr(knobs, name))}
        if fields:
            out[name] = fields
    return out


def build(
    name: str,
    knobs: Knobs,
    *,
    objective: str,
    defaults: dict[str, dict[str, Any]] | None = None,
    sample: Sample | None = None,
    shape: Shape | None = None,
    advantage: Advantage | None = None,
    after_train: AfterTrain | None = None,
    evaluate: Evaluate | None = None,
) -> PipelineGraph:
    """GRPO's skeleton with the stages given replaced (see the module docstring). `objective`: `train`'s preset;
    `defaults`: the pipeline's part fields beyond the preset's."""
    p = Pipeline(name)
    prompts = p.add("prompts", "sample_prompts", batch_size=knobs.batch_size)
    if sample is None:
        rollouts = p.add("rollout", "rollout", prompts=prompts, **sampling(knobs))
        rewards = verify(p, knobs, rollouts)
    else:
        rollouts, rewards = sample(p, prompts)
    if shape is not None:
        rewards = shape(p, rollouts, rewards)
    adv = (advantage or advantage_by("grpo_advantage"))(p, rollouts, rewards)
    parts = update(knobs, defaults)
    ref: dict[str, NodeRef] = {}
    if resolve(objective, parts).kl.coef > 0:
        ref["ref_logprobs"] = p.add("ref_logprob", "logprob", rollouts=rollouts, which="reference")
    train = p.add("train", "train", rollouts=rollouts, advantages=adv, **ref, objective=objective, **parts)
    waits = [train, *(after_train(p, train) if after_train is not None else [])]
    if evaluate is None:
        size, tokens = knobs.eval_size, knobs.max_new_tokens
        p.add("evaluate", "evaluate", after=waits, every=knobs.eval_every, size=size, max_new_tokens=tokens)
    else:
        evaluate(p, waits)
    return p.build()


__all__ = ["PARTS", "Knobs", "advantage_by", "build", "sampling", "update", "verify"]
