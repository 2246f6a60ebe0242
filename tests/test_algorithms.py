"""Advantage estimators and policy-loss variants against hand-computed examples, property tests of their
invariants, and every built-in pipeline end to end for 2 iterations."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.job.load import BUILTIN_PIPELINES, load_job
from plexrl.operators.advantage import batch_normalized_advantages, group_advantages, leave_one_out_advantages
from plexrl.operators.losses import kl_penalty, masked_mean, policy_loss
from plexrl.operators.shaping import overlong_penalties
from plexrl.runtime.jobs import run_jobs


def test_rloo_hand_computed_and_edge_cases() -> None:
    # group of 3: rewards 1, 0, 0 -> 1 - 0, 0 - 0.5, 0 - 0.5
    adv = leave_one_out_advantages(torch.tensor([1.0, 0.0, 0.0]), 3)
    assert torch.allclose(adv, torch.tensor([1.0, -0.5, -0.5]))
    assert leave_one_out_advantages(torch.tensor([2.0, 2.0]), 2).tolist() == [0.0, 0.0]  # all equal
    with pytest.raises(ValueError, match="at least 2 samples"):
        leave_one_out_advantages(torch.tensor([1.0]), 1)  # a single-sample group has no baseline


def test_single_sample_group_grpo_gives_zero() -> None:
    assert group_advantages(torch.tensor([1.0, 0.0]), 1).tolist() == [0.0, 0.0]


def test_reinforce_pp_hand_computed() -> None:
    # with group baseline: groups (1, 0) and (1, 1) -> (0.5, -0.5, 0, 0); batch mean 0, std sqrt(0.125)
    adv = batch_normalized_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, group_baseline=True, eps=0.0)
    s = math.sqrt(0.125)
    assert torch.allclose(adv, torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0]))


def test_overlong_penalty_hand_computed() -> None:
    assert overlong_penalties(torch.tensor([1, 3, 4, 8]), max_length=4, buffer=2).tolist() == [0.0, -0.5, -1.0, -1.0]


def test_aggregations_with_padding() -> None:
    x = torch.tensor([[2.0, 4.0, 9.0], [6.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # the 9s are padding
    assert float(masked_mean(x, mask, "token_mean")) == 4.0  # (2 + 4 + 6) / 3
    assert float(masked_mean(x, mask, "seq_mean")) == 4.5  # (3 + 6) / 2
    assert float(masked_mean(x, mask, "seq_sum_token_mean", norm_length=4.0)) == 1.5  # (6/4 + 6/4) / 2


def test_clip_higher_dual_clip_and_sequence_ratio() -> None:
    mask = torch.ones(1, 2)
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.25, 1.25]]))
    # clip-higher: ratio 1.25 with A=1 is clipped at 1.2 by eps 0.2, but not by eps_high 0.28
    loss, _ = policy_loss(logp, old, torch.ones(1), mask, clip_eps=0.2)
    assert math.isclose(float(loss), -1.2, rel_tol=1e-6)
    loss, s = policy_loss(logp, old, torch.ones(1), mask, clip_eps=0.2, clip_eps_high=0.28)
    assert math.isclose(float(loss), -1.25, rel_tol=1e-6) and s["clip_frac"] == 0.0
    # dual-clip: A=-1, ratio 5 -> -min(-5, -1.2) = 5, capped at c * |A| = 3
    big = torch.log(torch.full((1, 2), 5.0))
    loss, s = policy_loss(big, old, -torch.ones(1), mask, clip_eps=0.2, dual_clip=3.0)
    assert math.isclose(float(loss), 3.0, rel_tol=1e-6) and s["clip_frac"] == 1.0
    # sequence ratio: token log-ratios 0.4 and 0.0 (padding 9 ignored) -> exp(0.2) for the whole sequence
    lp = torch.tensor([[0.4, 0.0, 9.0]])
    loss, _ = policy_loss(lp, torch.zeros(1, 3), torch.ones(1), torch.tensor([[1.0, 1.0, 0.0]]),
                          clip_eps=0.5, ratio_level="sequence", agg="seq_mean")  # fmt: skip
    assert math.isclose(float(loss), -math.exp(0.2), rel_tol=1e-6)


def test_kl_estimators_hand_computed() -> None:
    logp, ref, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -9.0]]), torch.tensor([[1.0, 0.0]])
    assert torch.allclose(kl_penalty(logp, ref, mask, "k1"), torch.tensor([[0.5, 0.0]]))
    assert torch.allclose(kl_penalty(logp, ref, mask, "k2"), torch.tensor([[0.125, 0.0]]))
    k3 = math.exp(-0.5) + 0.5 - 1
    assert torch.allclose(kl_penalty(logp, ref, mask, "k3"), torch.tensor([[k3, 0.0]]))


rewards_strategy = st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=2, max_size=8)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(groups=st.lists(rewards_strategy.filter(lambda r: len(r) == 4), min_size=1, max_size=4))
def test_group_estimators_sum_to_zero_per_group(groups: list[list[float]]) -> None:
    r = torch.tensor([x for g in groups for x in g])
    for adv in (group_advantages(r, 4), group_advantages(r, 4, scale=False), leave_one_out_advantages(r, 4)):
        assert torch.allclose(adv.view(-1, 4).sum(1), torch.zeros(len(groups)), atol=1e-5)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(
    log_ratio=st.lists(st.floats(-3, 3), min_size=4, max_size=4),
    adv=st.floats(-2, 2),
    eps_high=st.sampled_from([None, 0.28]),
    dual=st.sampled_from([None, 3.0]),
)
def test_clipped_loss_is_bounded_and_masked_tokens_get_no_gradient(
    log_ratio: list[float], adv: float, eps_high: float | None, dual: float | None
) -> None:
    logp = torch.tensor([log_ratio], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    loss, _ = policy_loss(logp, torch.zeros(1, 4), torch.tensor([adv]), mask, clip_eps=0.2, clip_eps_high=eps_high,
                          dual_clip=dual)  # fmt: skip
    loss.backward()
    assert logp.grad is not None and (logp.grad[0, 2:] == 0).all()
    if adv >= 0:  # a positive advantage gains at most (1 + eps_high) * A per token
        assert float(loss.detach()) >= -(1 + (eps_high or 0.2)) * adv - 1e-6
    elif dual is not None:  # dual-clip caps the penalty of a negative advantage
        assert float(loss.detach()) <= dual * -adv + 1e-6


@pytest.mark.parametrize("name", sorted(BUILTIN_PIPELINES))
def test_every_builtin_pipeline_runs_two_iterations(name: str, tiny_config: dict[str, Any]) -> None:
    tiny_config["tracking"]["mlflow"] = False
    tiny_config["pipeline"] = {
        "name": name,
        "params": {"batch_size": 4, "n": 4, "max_new_tokens": 4, "eval_every": 2, "eval_size": 16},
    }
    (job,) = run_jobs([load_job(tiny_config)], progress=False)
    assert job.status == "done", job.error
    assert job.iterations_done == 2 and "verify/reward_mean" in job.history[-1]
    assert job.series("evaluate/accuracy")  # baseline and final evaluation logged


def test_gae_hand_computed_with_padding() -> None:
    from plexrl.operators.critic import gae

    # row 0: prompt column, 2 response tokens, 1 pad; row 1: 1 response token. gamma 0.5, lambda 1.
    values = torch.tensor([[0.0, 0.4, 0.2, 9.0], [0.0, 0.3, 9.0, 9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    adv, ret = gae(torch.tensor([1.0, 0.0]), values, mask, gamma=0.5, lam=1.0)
    # row 0: t=2: delta = 1 - 0.2 = 0.8; t=1: delta = 0 + 0.5*0.2 - 0.4 = -0.3, A = -0.3 + 0.5*0.8 = 0.1
    assert torch.allclose(adv, torch.tensor([[0.0, 0.1, 0.8, 0.0], [0.0, -0.3, 0.0, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[0.0, 0.5, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def test_value_loss_clips_against_old_values() -> None:
    from plexrl.operators.critic import value_loss

    mask = torch.ones(1, 1)
    # V moved from 0 to 1, return 1: unclipped error 0, clipped V = 0.2 -> error 0.64; loss takes the max
    loss = value_loss(torch.ones(1, 1), torch.zeros(1, 1), torch.ones(1, 1), mask, clip=0.2)
    assert math.isclose(float(loss), 0.5 * 0.64, rel_tol=1e-6)


def test_ppo_does_not_depend_on_the_global_rng(tiny_config: dict[str, Any]) -> None:
    """The critic must not draw from torch's global RNG (e.g. dropout), or a job's results would depend on
    what other jobs ran before it in the same process."""
    tiny_config["tracking"]["mlflow"] = False
    tiny_config["pipeline"] = {"nodes": [  # ppo, with a length penalty so that the tiny model gets a signal
        {"name": "prompts", "op": "sample_prompts", "params": {"batch_size": 4}},
        {"name": "rollout", "op": "rollout", "inputs": {"prompts": "prompts"}, "params": {"n": 4, "max_new_tokens": 4}},
        {"name": "verify", "op": "verify", "inputs": {"rollouts": "rollout"}},
        {"name": "shaped", "op": "user_ops:length_penalty", "inputs": {"rollouts": "rollout", "rewards": "verify"}},
        {"name": "values", "op": "value_estimate", "inputs": {"rollouts": "rollout"}},
        {"name": "gae", "op": "gae_advantage",
         "inputs": {"rollouts": "rollout", "rewards": "shaped", "values": "values"}},
        {"name": "train", "op": "train", "inputs": {"rollouts": "rollout", "advantages": "gae"}},
        {"name": "critic", "op": "train_critic",
         "inputs": {"rollouts": "rollout", "advantages": "gae", "values": "values"}},
    ]}  # fmt: skip
    tiny_config["iterations"] = 3
    runs = []
    for seed in (1, 2):
        torch.manual_seed(seed)  # a different global RNG state before each run
        (job,) = run_jobs([load_job(tiny_config)], progress=False)
        runs.append(
            [{k: v for k, v in row.items() if not k.startswith("time/") and "per_s" not in k} for row in job.history]
        )
    assert runs[0][-1]["critic/value_loss"] > 0 and runs[0][-1]["values/mean"] != 0  # the critic is learning
    assert runs[0] == runs[1]


# -- numerical conventions ------------------------------------------------------------------------------
def constant_groups(group_size: int, count: int = 200) -> torch.Tensor:
    """`count` groups of identical rewards that float32 cannot represent exactly (0.3, 1/3, partial credit,
    overlong penalties with buffer 3), seeded."""
    g = torch.Generator().manual_seed(0)
    pool = torch.tensor([0.3, 1 / 3, 2 / 3, 0.7, 0.1, -1 / 3, 1.3, 0.45])
    values = pool[torch.randint(len(pool), (count,), generator=g)] + torch.rand(count, generator=g)
    return values.repeat_interleave(group_size)


@pytest.mark.parametrize("group_size", [3, 5, 7, 8])
def test_all_equal_groups_get_exactly_zero(group_size: int) -> None:
    r = constant_groups(group_size)
    # the old float32 computation gave +-0.1-0.26 on many of these groups
    old = r.view(-1, group_size)
    old_adv = (old - old.mean(1, keepdim=True)) / (old.std(1, keepdim=True, unbiased=False) + 1e-6)
    assert (old_adv != 0).any()
    for adv in (
        group_advantages(r, group_size),
        group_advantages(r, group_size, scale=False),
        group_advantages(r, group_size, std="unbiased"),
        leave_one_out_advantages(r, group_size),
        batch_normalized_advantages(r, group_size, group_baseline=True),
    ):
        assert (adv == 0).all()


def test_rewards_one_ulp_apart_count_as_equal() -> None:
    # 0.1 + 0.2 != 0.3 in float64: without the spread tolerance the group std is ~3e-17 and the advantages +-1
    r = torch.tensor([0.3, 0.1 + 0.2] * 4, dtype=torch.float64)
    assert group_advantages(r, 8).tolist() == [0.0] * 8
    assert leave_one_out_advantages(r, 8).tolist() == [0.0] * 8
    assert batch_normalized_advantages(r, 8, group_baseline=False).tolist() == [0.0] * 8
    from plexrl.operators.critic import whiten_tokens

    assert whiten_tokens(r.view(2, 4), torch.ones(2, 4)).tolist() == [[0.0] * 4] * 2
    # a genuine difference is kept
    assert group_advantages(torch.tensor([0.3, 0.31]), 2).tolist() == pytest.approx([-1.0, 1.0], abs=1e-3)


def test_std_conventions() -> None:
    from plexrl.operators.critic import whiten_tokens

    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert group_advantages(r, 4, eps=0).tolist() == pytest.approx([3 / math.sqrt(3)] + [-1 / math.sqrt(3)] * 3)
    assert group_advantages(r, 4, eps=0, std="unbiased").tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert batch_normalized_advantages(r, 1, group_baseline=False, eps=0, std="unbiased").tolist() == pytest.approx(
        [1.5, -0.5, -0.5, -0.5]
    )
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    x = torch.tensor([[1.0, 0.0, 7.0], [0.0, 0.0, 7.0]])  # tokens 1, 0, 0, 0: padding ignored
    assert whiten_tokens(x, mask, std="unbiased", eps=0)[mask > 0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert whiten_tokens(x, mask, eps=0)[0, 0] == pytest.approx(math.sqrt(3))
    with pytest.raises(ValueError, match="biased"):
        group_advantages(r, 4, std="population")  # type: ignore[arg-type]


def test_reinforce_pp_group_baseline_needs_two_samples() -> None:
    from plexrl.errors import ConfigError

    with pytest.raises(ValueError, match="n >= 2"):
        batch_normalized_advantages(torch.tensor([1.0, 0.0]), 1, group_baseline=True)
    with pytest.raises(ConfigError, match=r"pipeline\.params\.n: group_baseline needs n >= 2"):
        load_job({"pipeline": {"name": "reinforce_pp", "params": {"n": 1}}})
    with pytest.raises(ConfigError, match=r"pipeline\.params\.gamma"):
        load_job({"pipeline": {"name": "reinforce_pp", "params": {"gamma": 0.9}}})  # sequence level: no discount
    load_job({"pipeline": {"name": "reinforce_pp", "params": {"n": 1, "group_baseline": False}}})  # plain: fine


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_log_ratio_and_k3_are_clamped(sign: float) -> None:
    mask = torch.ones(1, 2)
    logp = torch.tensor([[25.0 * sign, 0.0]], requires_grad=True)  # log-ratio +-25 on token 0
    for adv in (1.0, -1.0):
        loss, stats = policy_loss(logp, torch.zeros(1, 2), torch.tensor([adv]), mask, clip_eps=0.2,
                                  ref_logp=torch.zeros(1, 2), kl_coef=0.1)  # fmt: skip
        (grad,) = torch.autograd.grad(loss, logp)
        assert math.isfinite(float(loss.detach())) and torch.isfinite(grad).all()
        assert stats["kl"] == pytest.approx(10.0 / 2)  # token 0's k3 capped at 10, token 1's is 0
        if adv < 0 and sign > 0:  # the unclipped side: ratio e^20 (clamped), not e^25
            assert float(loss.detach()) == pytest.approx((math.exp(20) + 1) / 2 + 0.5, rel=1e-5)
    k3 = kl_penalty(torch.tensor([[100.0, -100.0]]), torch.zeros(1, 2), mask, "k3")
    assert k3.tolist() == [[10.0, 10.0]]
    big = torch.tensor([[100.0, -100.0]], requires_grad=True)
    loss, _ = policy_loss(big, torch.zeros(1, 2), -torch.ones(1), mask, clip_eps=0.2, ref_logp=torch.zeros(1, 2),
                          kl_coef=1.0, ratio_level="sequence")  # fmt: skip
    (grad,) = torch.autograd.grad(loss, big)
    assert math.isfinite(float(loss.detach())) and torch.isfinite(grad).all()
