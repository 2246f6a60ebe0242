"""The built-in losses of a session's `forward_backward`, as the Tinker API defines them: token-level, summed
(never averaged: the caller scales with `weights` or advantages), over `target_logprobs`, the log-probs under
the current weights (temperature 1) of each position's target token.

- `cross_entropy`: inputs `target_tokens` [N] (or [N, K], K candidates per position), `weights` (same shape;
  default 1); loss = sum(-target_logprobs * weights).
- `importance_sampling`: inputs `target_tokens`, `logprobs` (the sampler's, [N]), `advantages` [N];
  ratio = exp(target_logprobs - logprobs); loss = sum(-ratio * advantages).
- `ppo`: the same inputs; loss = sum(-min(ratio * A, clip(ratio, low, high) * A)) with `low`, `high` from the
  call's config `clip_low_threshold` (default 0.8) and `clip_high_threshold` (1.2).
- `cispo`: the same inputs and clip config; the clipped ratio weighs the log-prob as a constant (no gradient
  flows through it): loss = sum(-stop_gradient(clip(ratio, low, high)) * target_logprobs * A).
- `dro`: the same inputs; a quadratic penalty on the log-ratio instead of clipping, weighted by the config's
  `beta` (>= 0, required: Tinker's docs give no default): loss = sum(-(target_logprobs * A
  - beta / 2 * (target_logprobs - logprobs)^2)).

Every loss returns the per-position loss of one datum; the caller sums them (`engine.SessionEngine`). `check`
says what is wrong with a datum's inputs for a loss (the server calls it before accepting a call, the service
again before running it)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

RL_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": RL_INPUTS,
    "ppo": RL_INPUTS,
    "cispo": RL_INPUTS,
    "dro": RL_INPUTS,
}
OPTIONAL: dict[str, tuple[str, ...]] = {"cross_entropy": ("weights",)}
CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
CONFIG: dict[str, dict[str, float | None]] = {  # a loss's config keys and their defaults (None: required)
    "ppo": dict(CLIP),
    "cispo": dict(CLIP),
    "dro": {"beta": None},
}
INT_INPUTS = ("target_tokens",)  # int64; every other input is float32


def check(loss: str, inputs: Mapping[str, np.ndarray], length: int, vocab: int) -> str | None:
    """What is wrong with one datum's loss inputs for `loss` (a sentence naming the input and the fix), or
    None. `length`: the datum's model input length; `vocab`: the model's vocabulary size."""
    if loss not in REQUIRED:
        return f"unknown loss {loss!r}; PlexRL serves {', '.join(REQUIRED)}"
    known = REQUIRED[loss] + OPTIONAL.get(loss, ())
    extra = sorted(set(inputs) - set(known))
    if extra:
        return f"loss {loss!r} takes the inputs {', '.join(known)}; remove {', '.join(extra)}"
    missing = [k for k in REQUIRED[loss] if k not in inputs]
    if missing:
        return f"loss {loss!r} needs the input(s) {', '.join(missing)}"
    target = inputs["target_tokens"]
    top_k = loss == "cross_entropy" and target.ndim == 2 and target.shape[0] == length and target.shape[1] >= 1
    shape = target.shape if top_k else (length,)
    for name, arr in inputs.items():
        want = "int64" if name in INT_INPUTS else "float32"
        if arr.dtype != np.dtype(want):
            return f"input {name!r} is {arr.dtype}, it must be {want}"
        if arr.shape != shape:
            allowed = f"[{length}] or [{length}, K] (all inputs alike)" if loss == "cross_entropy" else f"[{length}]"
            return f"input {name!r} has shape {list(arr.shape)}; it must be {allowed}, a row per model input token"
        if name not in INT_INPUTS and not np.isfinite(arr).all():
            return f"input {name!r} holds NaN or infinite values"
    if target.size and (int(target.min()) < 0 or int(target.max()) >= vocab):
        return f"target_tokens must be token ids in [0, {vocab}); got {int(target.min())}..{int(target.max())}"
    return None


def check_config(loss: str, config: Mapping[str, float]) -> str | None:
    """What is wrong with a call's loss config, or None."""
    known = CONFIG.get(loss, {})
    extra = sorted(set(config) - set(known))
    if extra:
        allowed = ", ".join(known) or "none"
        return f"loss {loss!r} takes the config keys {allowed}; remove {', '.join(extra)}"
    bad = [k for k, v in config.items() if not np.isfinite(v)]
    if bad:
        return f"loss config {', '.join(bad)} must be finite numbers"
    missing = [k for k, v in known.items() if v is None and k not in config]
    if missing:
        return f"loss {loss!r} needs loss_fn_config {', '.join(missing)} (e.g. {{'beta': 0.05}}): it has no default"
    if "clip_low_threshold" in known:
        low, high = _clip(config)
        if not 0 <= low <= 1 <= high:
            return f"{loss} needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold"
    if loss == "dro" and config["beta"] < 0:
        return "dro needs beta >= 0"
    return None


def _clip(config: Mapping[str, float]) -> tuple[float, float]:
    return (config.get("clip_low_threshold", CLIP["clip_low_threshold"]),
            config.get("clip_high_threshold", CLIP["clip_high_threshold"]))  # fmt: skip


def elementwise(
    loss: str, target_logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> Tensor:
    """The per-position loss of one datum (same shape as `target_logprobs`); its sum is the datum's loss."""
    if loss == "cross_entropy":
        weights = inputs.get("weights")
        return -target_logprobs if weights is None else -target_logprobs * weights
    ratio = torch.exp(target_logprobs - inputs["logprobs"])
    advantages = inputs["advantages"]
    if loss == "importance_sampling":
        return -ratio * advantages
    if loss in ("ppo", "cispo"):
        clipped = ratio.clamp(*_clip(config))
        if loss == "ppo":
            return -torch.minimum(ratio * advantages, clipped * advantages)
        return -clipped.detach() * target_logprobs * advantages
    if loss == "dro":
        penalty = (target_logprobs - inputs["logprobs"]) ** 2
        return -(target_logprobs * advantages - 0.5 * config["beta"] * penalty)
    raise ValueError(f"unknown loss {loss!r}; PlexRL serves {', '.join(REQUIRED)}")


__all__ = ["CLIP", "CONFIG", "OPTIONAL", "REQUIRED", "RL_INPUTS", "check", "check_config", "elementwise"]
