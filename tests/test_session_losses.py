"""The built-in losses of a session (`plexrl/sessions/losses.py`) against plain-torch references written from
Tinker's documented definitions: the same value and the same gradient on the logits, for every loss; and the
config checks (clip thresholds, dro's required beta)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from plexrl.sessions import losses

N, V = 7, 11


def reference(
    loss: str, lp: torch.Tensor, sampled: torch.Tensor, adv: torch.Tensor, cfg: dict[str, float]
) -> torch.Tensor:
    """The documented definition, written out (summed over tokens, never averaged)."""
    ratio = torch.exp(lp - sampled)
    low, high = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    if loss == "importance_sampling":
        return -(ratio * adv).sum()
    if loss == "ppo":
        return -torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv).sum()
    if loss == "cispo":
        return -(torch.clamp(ratio, low, high).detach() * lp * adv).sum()
    if loss == "dro":
        return -(lp * adv - 0.5 * cfg["beta"] * (lp - sampled) ** 2).sum()
    raise AssertionError(loss)


def case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    lp = F.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    sampled = lp + torch.randn(N, generator=g) * 0.6  # ratios well outside [0.8, 1.2] on some tokens
    adv = torch.randn(N, generator=g)
    return logits, targets, sampled, adv


@pytest.mark.parametrize(
    ("loss", "cfg"),
    [
        ("importance_sampling", {}),
        ("ppo", {}),
        ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}),
        ("cispo", {}),
        ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
        ("dro", {"beta": 0.05}),
        ("dro", {"beta": 2.0}),
    ],
)
def test_a_loss_has_the_documented_value_and_gradient(loss: str, cfg: dict[str, float]) -> None:
    for seed in range(3):
        logits, targets, sampled, adv = case(seed)
        assert losses.check_config(loss, cfg) is None
        mine_logits = logits.clone().requires_grad_(True)
        lp = F.log_softmax(mine_logits, -1).gather(-1, targets[:, None])[:, 0]
        mine = losses.elementwise(loss, lp, {"logprobs": sampled, "advantages": adv}, cfg).sum()
        mine.backward()
        ref_logits = logits.clone().requires_grad_(True)
        ref_lp = F.log_softmax(ref_logits, -1).gather(-1, targets[:, None])[:, 0]
        ref = reference(loss, ref_lp, sampled, adv, cfg)
        ref.backward()
        torch.testing.assert_close(mine, ref)
        torch.testing.assert_close(mine_logits.grad, ref_logits.grad)


def test_cispo_keeps_the_gradient_where_ppo_clips_it_away() -> None:
    """The difference that makes cispo a loss of its own: beyond the clip range ppo's gradient is zero on that
    token, cispo's is the clipped ratio times the advantage times d(logprob)."""
    lp = torch.tensor([0.0, 0.0], requires_grad=True)
    sampled = torch.tensor([-1.0, 0.0])  # ratio e on token 0 (clipped to 1.2), 1 on token 1
    adv = torch.tensor([1.0, 1.0])
    for loss, want in (("ppo", [0.0, -1.0]), ("cispo", [-1.2, -1.0]), ("importance_sampling", [-np.e, -1.0])):
        lp.grad = None
        losses.elementwise(loss, lp, {"logprobs": sampled, "advantages": adv}, {}).sum().backward()
        assert lp.grad is not None
        assert lp.grad.tolist() == pytest.approx(want), loss


def test_configs_are_checked_with_a_sentence_that_names_the_fix() -> None:
    assert "needs loss_fn_config beta" in str(losses.check_config("dro", {}))
    assert losses.check_config("dro", {"beta": -1.0}) == "dro needs beta >= 0"
    assert "takes the config keys beta; remove clip_low_threshold" in str(
        losses.check_config("dro", {"beta": 1.0, "clip_low_threshold": 0.5})
    )
    assert losses.check_config("cispo", {"clip_low_threshold": 1.1}) == (
        "cispo needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold"
    )
    assert "takes the config keys none; remove beta" in str(losses.check_config("importance_sampling", {"beta": 1}))
    inputs = {"target_tokens": np.zeros(3, np.int64), "logprobs": np.zeros(3, "f4")}
    assert losses.check("dro", inputs, 3, V) == "loss 'dro' needs the input(s) advantages"
    assert losses.check("cispo", {**inputs, "advantages": np.zeros(3, "f4")}, 3, V) is None
    served = "cross_entropy, importance_sampling, ppo, cispo, dro"
    assert losses.check("gspo", inputs, 3, V) == f"unknown loss 'gspo'; PlexRL serves {served}"
