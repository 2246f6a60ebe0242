"""Dynamic sampling with refill (DAPO): sample more prompts until the batch holds `groups` groups whose
rewards are not all equal, in a bounded number of rollout attempts, without ever putting rows out of step.

The pattern, unrolled in the graph (one node per attempt, so the planner can run another job's work
between two attempts; `pipelines/dapo.py` builds it):

    prompts -> rollout -> verify -> keep0
    keep0 -> refill1 -> rollout1 -> verify1 -> keep1(pool=keep0) -> ... -> keepR
    keepR -> pool_rollouts --> (overlong, advantage, train ...)
    keepR -> pool_rewards ---/

Rows stay aligned because they only ever move inside a `RolloutPool`, which holds a rollout and its
rewards together; `pool_rollouts` and `pool_rewards` are projections of the same pool, so every edge after
them sees the same rows in the same order. A refill attempt whose pool is already full samples no prompt
(its rollout returns an empty batch without touching the engine).

Limits: plain `Rollouts` only (not the multi-turn `EpisodeRollouts`); the filter looks at the verifier's
rewards, before any shaping.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from plexrl.batch import Batch, Prompts, Rewards, Rollouts
from plexrl.data.prompts import prompts_of
from plexrl.operator import OpContext, operator
from plexrl.operators.advantage import all_equal

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(slots=True)
class RolloutPool(Batch):
    """Groups kept so far: `rollouts` and `rewards` hold the same rows (whole groups, in the order kept);
    `want` groups are wanted; `attempts` rollout attempts sampled `sampled` prompts (groups) in all."""

    rollouts: Rollouts
    rewards: Rewards
    want: int
    attempts: int
    sampled: int

    @property
    def groups(self) -> int:
        return len(self.rollouts) // self.rollouts.group_size

    def metrics(self) -> dict[str, float]:
        return {
            "groups": float(self.groups),
            "attempts": float(self.attempts),
            "sampled": float(self.sampled),
            "kept_frac": self.groups / max(self.sampled, 1),
            "short": float(self.want - self.groups),
        }


def select_rows(ro: Rollouts, rows: Tensor) -> Rollouts:
    """The rows `rows` (an index tensor) of a rollout, same layout."""
    if type(ro) is not Rollouts:
        raise TypeError(f"dynamic sampling handles plain Rollouts, not {type(ro).__name__}")
    idx = rows.tolist()
    return Rollouts(
        input_ids=ro.input_ids[rows], attention_mask=ro.attention_mask[rows], response_mask=ro.response_mask[rows],
        behaviour_logprobs=ro.behaviour_logprobs[rows], prompt_len=ro.prompt_len,
        response_lengths=ro.response_lengths[rows], finish_reasons=[ro.finish_reasons[i] for i in idx],
        completions=[ro.completions[i] for i in idx], answers=[ro.answers[i] for i in idx],
        group_size=ro.group_size, temperature=ro.temperature, weight_version=ro.weight_version,
        positions=[ro.positions[i] for i in idx] if ro.positions else [],
    )  # fmt: skip


@operator(runs_on="cpu")
def keep_informative(
    rollouts: Rollouts,
    rewards: Rewards,
    ctx: OpContext,
    pool: RolloutPool | None = None,
    *,
    groups: Annotated[int, Field(ge=1, le=65536, description="groups wanted in the batch")],
) -> RolloutPool:
    """Add the groups of this attempt whose rewards are not all equal (see `advantage.all_equal`) to `pool`
    (a new one when unconnected), in row order, until it holds `groups` groups; the rest are dropped."""
    import torch

    g = rollouts.group_size
    have = pool.groups if pool is not None else 0
    if len(rollouts) % g or len(rewards.values) != len(rollouts):
        raise ValueError(f"{len(rollouts)} rollout rows, {len(rewards.values)} rewards, group size {g}: out of step")
    informative = ~all_equal(rewards.values.double().view(-1, g), 1).view(-1)
    chosen = informative.nonzero().view(-1)[: max(groups - have, 0)]
    rows = (chosen[:, None] * g + torch.arange(g)).view(-1)
    new_ro = select_rows(rollouts, rows)
    correct = rewards.correct[rows] if rewards.correct is not None else None
    new_rw = Rewards(values=rewards.values[rows], correct=correct)
    sampled = len(rollouts) // g
    if pool is None:
        return RolloutPool(new_ro, new_rw, want=groups, attempts=int(sampled > 0), sampled=sampled)
    pad_id = getattr(ctx.tokenizer, "pad_token_id", None) or 0
    old = pool.rewards
    if (old.correct is None) != (correct is None):
        raise ValueError("cannot pool rewards with and without `correct`")
    both = torch.cat([old.correct, correct]) if old.correct is not None and correct is not None else None
    return RolloutPool(
        Rollouts.concat([pool.rollouts, new_ro], pad_id),
        Rewards(values=torch.cat([old.values, new_rw.values]), correct=both),
        want=groups,
        attempts=pool.attempts + (sampled > 0),
        sampled=pool.sampled + sampled,
    )


@operator(runs_on="cpu")
def refill_prompts(
    pool: RolloutPool,
    ctx: OpContext,
    *,
    max_prompts: Annotated[int, Field(ge=1, le=65536, description="most prompts one refill samples")] = 64,
) -> Prompts:
    """Prompts for the next attempt: none when the pool is full, else enough to fill it at the share of
    informative groups seen so far (all `max_prompts` while none was), at most `max_prompts`. Drawn at
    random from the train split with a seed of the job, iteration and node (stateless, like
    `sample_prompts`, and independent of the main data order)."""
    need = pool.want - pool.groups
    if need <= 0:
        return Prompts(texts=[], token_ids=[], answers=[])
    rate = pool.groups / max(pool.sampled, 1)
    count = max_prompts if rate == 0 else min(max_prompts, math.ceil(need / rate))
    train = ctx.task.train
    rng = random.Random(ctx.seed("refill"))
    picked = [train[rng.randrange(len(train))] for _ in range(count)]
    return prompts_of(picked, ctx.tokenizer)


@operator(runs_on="cpu")
def pool_rollouts(pool: RolloutPool) -> Rollouts:
    """The pool's rollout rows (aligned with `pool_rewards` of the same pool)."""
    return pool.rollouts


@operator(runs_on="cpu")
def pool_rewards(pool: RolloutPool) -> Rewards:
    """The pool's rewards (aligned with `pool_rollouts` of the same pool)."""
    return pool.rewards
