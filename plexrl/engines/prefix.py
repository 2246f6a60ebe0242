"""The training forward of rows that share a prompt: the prompt is computed once per group, not once per row.

A GRPO-style batch holds n samples of every prompt (n = 8 in the shipped configs), and each row is laid out as
the left-padded prompt then its response. A plain forward computes the prompt's columns n times over, the
same numbers every time: for SmolLM2 on two-digit addition (a 66-token prompt, an 18-token answer) that is
~75% of the step's FLOPs. `shared_prefix_logits` instead runs the forward in two parts:

1. the distinct prompts (rows whose columns before the first scored one are equal, tokens and padding: a
   group) through the model once each, keeping their KV cache and the logits of their last column;
2. every row's remaining columns (the response) with its group's cache (`batch_select_indices`: each row
   gets its group's keys and values; in the backward, autograd adds the rows' gradients into the group's).

Both parts are causal, so every logit is the one the plain forward computes (equal up to float rounding: a
test compares log-probs and gradients), and the gradient reaching the shared prompt is the sum over its rows,
as in the plain forward. Rows are grouped by content, so any layout works (a batch with no repeated prompt
falls back to the plain forward).

Not used with gradient checkpointing (transformers drops the cache under it in training) or where rows
share nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def prefix_groups(ids: Tensor, mask: Tensor, start: int) -> tuple[Tensor, Tensor] | None:
    """Rows grouped by their first `start` columns (tokens and mask): (the first row of each group [G], each
    row's group [N]), or None when no two rows share them (nothing to save)."""
    n = ids.shape[0]
    if start < 1 or n < 2:
        return None
    head = torch.cat([ids[:, :start], mask[:, :start].to(ids.dtype)], 1)
    uniq, inverse = torch.unique(head, dim=0, return_inverse=True)
    groups = uniq.shape[0]
    if groups == n:
        return None
    rows = torch.arange(n, device=ids.device)
    first = torch.full((groups,), n, dtype=torch.long, device=ids.device).scatter_reduce(
        0, inverse, rows, reduce="amin"
    )
    return first, inverse


def shared_prefix_logits(
    model: Any, ids: Tensor, mask: Tensor, position_ids: Tensor, start: int, cache_kw: str
) -> Tensor | None:
    """The logits of columns `start - 1` .. L-1 of a forward on `ids` [N, L] (what `logits_to_keep=L-start+1`
    returns), with each distinct prompt (columns < `start`) computed once. None when no rows share a prompt
    (the caller runs the plain forward). `cache_kw`: the model's name for the KV cache argument."""
    grouped = prefix_groups(ids, mask, start)
    if grouped is None:
        return None
    first, inverse = grouped
    head = model(
        input_ids=ids[first, :start],
        attention_mask=mask[first, :start],
        position_ids=position_ids[first, :start],
        use_cache=True,
        logits_to_keep=1,
    )
    cache = getattr(head, cache_kw)
    cache.batch_select_indices(inverse)  # row i gets its group's keys and values; gradients add back
    tail = model(
        input_ids=ids[:, start:],
        attention_mask=mask,
        position_ids=position_ids[:, start:],
        use_cache=True,
        **{cache_kw: cache},
    )
    return torch.cat([head.logits[inverse], tail.logits], 1)
