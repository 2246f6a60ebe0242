"""Data operators."""

from __future__ import annotations

import functools
import random
from typing import Annotated

from pydantic import Field

from plexrl.batch import Prompts
from plexrl.data.prompts import prompts_of
from plexrl.operator import OpContext, operator


@functools.lru_cache(maxsize=8)
def epoch_order(seed: int, epoch: int, size: int) -> tuple[int, ...]:
    """The permutation of `size` train rows used in `epoch` by a job with `seed` (cached: a shuffle of
    200k rows costs ~0.1 s, more than a whole tiny-model iteration)."""
    order = list(range(size))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return tuple(order)


@operator(runs_on="cpu")
def sample_prompts(ctx: OpContext, *, batch_size: Annotated[int, Field(ge=1, le=65536)] = 64) -> Prompts:
    """Take the next `batch_size` prompts of the train split.

    Stateless: iteration i reads rows [i*B, (i+1)*B) of an epoch-wise permutation seeded by the job seed,
    so a resumed or multiplexed job sees exactly the data it would have seen alone.
    """
    train = ctx.task.train
    out = []
    for k in range(ctx.iteration * batch_size, (ctx.iteration + 1) * batch_size):
        epoch, idx = divmod(k, len(train))
        out.append(train[epoch_order(ctx.job_seed, epoch, len(train))[idx]])
    return prompts_of(out, ctx.tokenizer)
