"""Data operators."""

from __future__ import annotations

import random
from typing import Annotated

from pydantic import Field

from plexrl.batch import Prompts
from plexrl.operator import OpContext, operator


@operator(placement="cpu")
def sample_prompts(ctx: OpContext, *, batch_size: Annotated[int, Field(ge=1, le=65536)] = 32) -> Prompts:
    """Take the next `batch_size` prompts of the train split.

    Stateless: iteration i reads rows [i*B, (i+1)*B) of an epoch-wise permutation seeded by the job seed,
    so a resumed or multiplexed job sees exactly the data it would have seen alone.
    """
    train = ctx.task.train
    orders: dict[int, list[int]] = {}
    out = []
    for k in range(ctx.iteration * batch_size, (ctx.iteration + 1) * batch_size):
        epoch, idx = divmod(k, len(train))
        if epoch not in orders:
            orders[epoch] = list(range(len(train)))
            random.Random(f"{ctx.job_seed}/{epoch}").shuffle(orders[epoch])
        out.append(train[orders[epoch][idx]])
    tok = ctx.tokenizer
    return Prompts(
        texts=[p.prompt for p in out],
        token_ids=[tok(p.prompt)["input_ids"] for p in out],
        answers=[p.answer for p in out],
    )
