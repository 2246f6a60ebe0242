"""Operator math against hand-computed examples, and the verifier on malformed output."""

from __future__ import annotations

import doctest
import math

import torch

import plexrl.job.tasks.arithmetic as arithmetic_mod
import plexrl.operators.advantage as advantage_mod
import plexrl.operators.critic as critic_mod
import plexrl.operators.losses as losses_mod
import plexrl.operators.objective as objective_mod
import plexrl.operators.shaping as shaping_mod
import plexrl.operators.train as train_mod
from plexrl.job.tasks.arithmetic import verify_answers
from plexrl.operators.advantage import group_advantages
from plexrl.operators.losses import policy_loss


def test_doctests() -> None:
    for mod in (advantage_mod, train_mod, losses_mod, objective_mod, arithmetic_mod, shaping_mod, critic_mod):
        result = doctest.testmod(mod)
        assert result.attempted > 0 and result.failed == 0, mod.__name__


def test_grpo_advantages_hand_computed() -> None:
    # group 1: rewards 1,0,0,1 -> mean .5, std .5 -> +1,-1,-1,+1; group 2: all equal -> 0
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]), 4, eps=0.0)
    assert adv[:4].tolist() == [1.0, -1.0, -1.0, 1.0]
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]), 4, eps=1e-6)
    assert adv[4:].tolist() == [0.0] * 4
    # rewards 3,1,2 -> mean 2, std sqrt(2/3)
    adv = group_advantages(torch.tensor([3.0, 1.0, 2.0]), 3, eps=0.0)
    s = math.sqrt(2 / 3)
    assert torch.allclose(adv, torch.tensor([1 / s, -1 / s, 0.0]))
    assert group_advantages(torch.tensor([3.0, 1.0, 2.0]), 3, scale=False).tolist() == [1.0, -1.0, 0.0]


def test_clipped_loss_sign_and_value() -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    old = torch.zeros(1, 3)
    # positive advantage, ratio 1.5 on token 1 (clipped to 1.2), 0.9 on token 2 (unclipped): -(1.2 + 0.9)/2
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.9]]))
    loss, stats = policy_loss(logp, old, torch.tensor([2.0]), mask, clip_eps=0.2)
    assert math.isclose(float(loss), -(1.2 * 2 + 0.9 * 2) / 2, rel_tol=1e-6)
    assert stats["clip_frac"] == 0.5
    # negative advantage: min picks the larger penalty; ratio 1.5 stays unclipped (pessimistic bound)
    loss, _ = policy_loss(logp, old, torch.tensor([-1.0]), mask, clip_eps=0.2)
    assert math.isclose(float(loss), (1.5 + 0.9) / 2, rel_tol=1e-6)
    # the gradient pushes up the log-prob of tokens with positive advantage (when not clipped)
    lp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = policy_loss(lp, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    loss.backward()
    assert lp.grad is not None and (lp.grad[0, 1:] < 0).all() and lp.grad[0, 0] == 0


def test_kl_term_is_zero_at_reference_and_positive_elsewhere() -> None:
    mask = torch.ones(2, 2)
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.9]]))
    _, stats = policy_loss(logp, logp, torch.zeros(2), mask, clip_eps=0.2, ref_logp=logp.clone(), kl_coef=0.1)
    assert stats["kl"] == 0.0
    loss, stats = policy_loss(logp, logp, torch.zeros(2), mask, clip_eps=0.2, ref_logp=logp - 0.3, kl_coef=0.1)
    k3 = math.exp(-0.3) + 0.3 - 1
    assert math.isclose(stats["kl"], k3, rel_tol=1e-5) and math.isclose(float(loss), 0.1 * k3, rel_tol=1e-5)


def test_verifier_on_malformed_output_never_raises() -> None:
    completions = ["579", "", "abc", "5 7 9", "579579", "-579", "\x00", "five hundred", "5.79e2", "579\n"]
    scores = verify_answers(completions, ["579"] * len(completions))
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert verify_answers([None], ["1"]) == [0.0]  # type: ignore[list-item]


def test_kl_ignores_masked_positions_with_extreme_logprobs() -> None:
    logp = torch.tensor([[0.0, -120.0, -1.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 0.0, 1.0]])
    loss, stats = policy_loss(
        logp, logp.detach(), torch.ones(1), mask, clip_eps=0.2, ref_logp=torch.zeros(1, 3), kl_coef=0.1
    )
    loss.backward()
    assert math.isfinite(float(loss.detach())) and math.isfinite(stats["kl"])
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
