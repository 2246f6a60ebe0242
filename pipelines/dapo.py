"""DAPO (Yu et al., 2025): GRPO with clip-higher (a wider upper clip), token-level loss averaging, a soft
overlong penalty on the reward, and dynamic sampling.

The overlong penalty starts `overlong_buffer` tokens before the generation budget; on short-answer tasks
keep the buffer small, or it penalises correct answers (on 3-digit addition with a 6-token budget, 200
iterations reached 77% held-out accuracy with a buffer of 1 and 33% with a buffer of 2).

Dynamic sampling. Groups whose advantages are all 0 leave the batch, KL term included, and the loss is
normalised over the tokens left (the `dapo` preset's `skip_norm: kept`), as published. With `max_refills` > 0 the
batch is refilled as in the paper: after the first rollout, up to `max_refills` more attempts sample new
prompts until `batch_size` groups whose verifier rewards are not all equal are held (see
`operators/sampling.py`; each attempt is its own rollout node, one that finds the batch full costs
nothing); the pool's `groups`, `attempts` and `sampled` are logged under `keep<k>/`. The default, 0, is
dynamic sampling without refill (the batch shrinks by the all-equal groups).

prompts -> rollout -> verify -> overlong -> advantage -> train (clip 0.2 / 0.28, token_mean) -> evaluate
with refill:
prompts -> rollout -> verify -> keep0 -> refill1 -> rollout1 -> verify1 -> keep1 ... -> keepR
        keepR -> pool_rollouts, pool_rewards -> overlong -> advantage -> train -> evaluate
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from plexrl.graph import NodeRef, Pipeline, PipelineGraph
from plexrl.pipelines.skeleton import Knobs, build, sampling, verify
from plexrl.roles import pipeline_builder


class DapoKnobs(Knobs):
    overlong_buffer: int = Field(1, ge=0, description="Tokens before the budget where the overlong penalty starts.")
    max_refills: int = Field(
        0, ge=0, le=16, description="Extra rollout attempts to refill the batch with informative groups."
    )


@pipeline_builder
def dapo(**params: Any) -> PipelineGraph:
    """DAPO's pipeline; `params`: `DapoKnobs` (clip-higher, token_mean, kept-rows normaliser: the `dapo` preset;
    an entropy bonus: `entropy: {coef: ...}`)."""
    knobs = DapoKnobs(**params)

    def sample(p: Pipeline, prompts: NodeRef) -> tuple[NodeRef, NodeRef]:
        rollouts = p.add("rollout", "rollout", prompts=prompts, **sampling(knobs))
        rewards = verify(p, knobs, rollouts)
        if knobs.max_refills == 0:
            return rollouts, rewards
        groups = knobs.batch_size
        pool = p.add("keep0", "keep_informative", rollouts=rollouts, rewards=rewards, groups=groups)
        for k in range(1, knobs.max_refills + 1):
            more = p.add(f"refill{k}", "refill_prompts", pool=pool, max_prompts=groups)
            extra = p.add(f"rollout{k}", "rollout", prompts=more, **sampling(knobs))
            scored = verify(p, knobs, extra, f"verify{k}")
            pool = p.add(f"keep{k}", "keep_informative", rollouts=extra, rewards=scored, pool=pool, groups=groups)
        return p.add("batch", "pool_rollouts", pool=pool), p.add("rewards", "pool_rewards", pool=pool)

    def overlong(p: Pipeline, rollouts: NodeRef, rewards: NodeRef) -> NodeRef:
        return p.add("overlong", "overlong_penalty", rollouts=rollouts, rewards=rewards,
                     max_length=knobs.max_new_tokens, buffer=knobs.overlong_buffer)  # fmt: skip

    return build("dapo", knobs, objective="dapo", sample=sample, shape=overlong)
