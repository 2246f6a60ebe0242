"""Held-out evaluation on the service (greedy decoding, scored by the task's verifier)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from plexrl.batch import EvalStats
from plexrl.operator import OpContext, operator


@operator(runs_on="service")
def evaluate(
    ctx: OpContext,
    *,
    size: Annotated[int, Field(ge=1)] = 400,
    max_new_tokens: Annotated[int, Field(ge=1)] = 8,
) -> EvalStats:
    """Greedy accuracy of the current policy on the first `size` held-out problems."""
    from functools import partial

    from plexrl.job.models import greedy_accuracy
    from plexrl.job.tasks.dataset import DatasetTask

    problems = ctx.task.held_out[:size]
    verify = ctx.task.verify
    if isinstance(ctx.task, DatasetTask):  # a user reward sees each held-out row's prompt and extra fields
        verify = partial(ctx.task.verify, problems=problems)
    acc, length = greedy_accuracy(ctx.engine, ctx.tokenizer, problems, max_new_tokens, verify)
    return EvalStats(accuracy=acc, size=len(problems), response_length=length)
