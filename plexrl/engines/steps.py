"""The small pure pieces of a decode step the engines share: the name of a model's KV-cache keyword
(`cache_kw`), position ids of left-padded rows (`positions`), nucleus filtering (`nucleus`) and a row's
vLLM seed (`row_seed`). A leaf of `plexrl/engines/` (the torch engine and its resumable decoding, the vLLM
engine and its partial rollouts all import it; it imports none of them)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


def cache_kw(model: Any) -> str:
    """transformers >= 5.2x names the KV cache `cache`; older releases `past_key_values`. A peft wrapper (a
    LoRA job's shared base) forwards its keywords to the model it wraps: that model's name counts."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def positions(mask: Tensor) -> Tensor:
    """Position ids of left-padded rows: 0 at the first real token (padding clamped to 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def nucleus(logp: Tensor, top_p: float) -> Tensor:
    """Renormalised log-probs [N, V] of the smallest set of tokens whose probability reaches `top_p` (the
    most likely token always stays); -inf elsewhere."""
    import torch
    import torch.nn.functional as F

    sorted_lp, order = logp.sort(-1, descending=True)
    before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # mass of the tokens ranked above each one
    drop = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, before >= top_p)
    return F.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)


def top_k_only(logp: Tensor, k: int) -> Tensor:
    """Renormalised log-probs [N, V] of each row's `k` likeliest tokens (ties at the k-th value all stay, as in
    vLLM); -inf elsewhere."""
    import torch.nn.functional as F

    kth = logp.topk(k, dim=-1).values[:, -1:]
    return F.log_softmax(logp.masked_fill(logp < kth, float("-inf")), dim=-1)


def row_seed(seed: int, row: int) -> int:
    """The vLLM seed of row `row` of a generate call seeded with `seed` (rows of one prompt are consecutive)."""
    return (seed * 1_000_003) % (2**31 - 2**20) + row


__all__ = ["cache_kw", "nucleus", "positions", "row_seed", "top_k_only"]
