"""The log-prob of each token of a sequence under a causal LM, and its entropy (`token_logprobs`), and the same
from a forward that runs the output head only where a loss reads it (`scored_logprobs`). Shared by the torch,
LoRA and FSDP engines; it imports none of them."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from plexrl.engines.prefix import shared_prefix_logits
from plexrl.engines.steps import cache_kw, positions


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Log-prob and entropy of each token given the logits of the previous position.

    logits [N, L, V] (from a forward on input_ids [N, L]) -> (logprobs [N, L], entropy [N, L]), column 0 is 0
    (the first token has no prediction).
    """
    logp_all = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    lp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zero = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1)


def scored_logprobs(
    model: Any, ids: Tensor, mask: Tensor, temperature: float, scored: Tensor | None = None, **kw: Any
) -> tuple[Tensor, Tensor]:
    """`token_logprobs` of a forward on `ids`, with the output head run only where a loss reads it: from the
    column before the first one `scored` (a response mask [N, L]) marks. Rows are laid out as a left-padded
    prompt then the response, so every scored token sits at or after that column: the prompt's logits
    ([N, P, vocab], most of the memory of a step over a short answer) are never made. The columns before are
    0, like column 0. Without `scored` (or with nothing scored) every column is computed. Rows that share
    their prompt (a group's n samples) share its forward (`plexrl.engines.prefix`)."""
    n, length = ids.shape
    start = 1
    if scored is not None and bool(scored.any()):
        start = max(int(scored.any(0).float().argmax()), 1)
    logits = None
    if start > 1 and not getattr(model, "is_gradient_checkpointing", False):  # the n samples share a prompt
        logits = shared_prefix_logits(model, ids, mask, positions(mask), start, cache_kw(model))
    if logits is None:
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=positions(mask), logits_to_keep=length - start + 1, **kw
        ).logits
    lp, ent = token_logprobs(logits, ids[:, start - 1 :], temperature)
    pad = lp.new_zeros(n, start - 1)
    return torch.cat([pad, lp], 1), torch.cat([pad, ent], 1)


__all__ = ["scored_logprobs", "token_logprobs"]
