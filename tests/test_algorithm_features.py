"""Each built-in algorithm's distinguishing feature, checked through its real pipeline graph: the graph's
cpu nodes (shaping, advantage) and its `train` node run on a hand-made rollout with a fake engine whose
policy is one log-prob shift per token id, and the loss, gradient and advantages are compared with values
computed by hand. Every test fails if the feature were ignored (a parameter dropped by the builder or not
read by the operator): the "feature off" value is checked to differ.

Also `train`'s skip_zero_advantage normalisation."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from plexrl.batch import Advantages, Batch, LogProbs, Rewards, Rollouts, TrainStats, Values
from plexrl.graph import PipelineGraph
from plexrl.operator import OpContext
from plexrl.pipelines.dapo import dapo
from plexrl.pipelines.dr_grpo import dr_grpo
from plexrl.pipelines.grpo import grpo
from plexrl.pipelines.gspo import gspo
from plexrl.pipelines.ppo import ppo
from plexrl.pipelines.reinforce_pp import reinforce_pp
from plexrl.pipelines.rloo import rloo

PROMPT = 2  # prompt columns; responses start at column PROMPT


def make_rollouts(
    lengths: list[int], group_size: int, width: int = 4, tokens: list[list[int]] | None = None
) -> Rollouts:
    """N = len(lengths) rows: PROMPT prompt tokens (id 0), then `lengths[i]` response tokens (ids 1, 2, ...
    or `tokens[i]`), right-padded to PROMPT + width; behaviour log-probs -1 on response tokens."""
    n, cols = len(lengths), PROMPT + width
    ids = torch.zeros(n, cols, dtype=torch.long)
    attn = torch.zeros(n, cols, dtype=torch.long)
    resp = torch.zeros(n, cols)
    attn[:, :PROMPT] = 1
    for i, k in enumerate(lengths):
        row = tokens[i] if tokens else list(range(1, k + 1))
        ids[i, PROMPT : PROMPT + k] = torch.tensor(row)
        attn[i, PROMPT : PROMPT + k] = 1
        resp[i, PROMPT : PROMPT + k] = 1
    return Rollouts(
        input_ids=ids, attention_mask=attn, response_mask=resp, behaviour_logprobs=-resp, prompt_len=PROMPT,
        response_lengths=torch.tensor(lengths), finish_reasons=["stop"] * n, completions=["x"] * n,
        answers=["x"] * n, group_size=group_size, temperature=1.0,
    )  # fmt: skip


@dataclass
class FakeEngine:
    """A policy with one parameter per token id: logp = behaviour logp + theta[id] on response tokens.
    `train_step` splits rows into minibatches as TorchEngine does and records each step's loss, stats and
    d loss / d theta, without updating theta (so the steps of one call are comparable)."""

    shifts: dict[int, float] = field(default_factory=dict)
    weight_version: int = 0
    steps: list[tuple[float, dict[str, float], torch.Tensor]] = field(default_factory=list)

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: Any, *, minibatches: int, epochs: int = 1,
                   **_: Any) -> dict[str, float]:  # fmt: skip
        theta = torch.zeros(16)
        for k, v in self.shifts.items():
            theta[k] = v
        theta.requires_grad_()
        bounds = torch.linspace(0, batch["input_ids"].shape[0], minibatches + 1).long().tolist()
        for _, (a, b) in itertools.product(range(epochs), itertools.pairwise(bounds)):
            if b <= a:
                continue
            mb = {k: v[a:b] for k, v in batch.items()}
            logp = mb["old_logp"] + theta[mb["input_ids"]] * mb["mask"]
            loss, stats = loss_fn(mb, logp, torch.zeros_like(logp))
            (grad,) = torch.autograd.grad(loss, theta)
            self.steps.append((float(loss.detach()), stats, grad))
        self.weight_version += 1
        return {"steps": float(len(self.steps))}

    @property
    def grad(self) -> torch.Tensor:
        return torch.stack([g for _, _, g in self.steps]).sum(0)


def run_update(
    graph: PipelineGraph,
    rollouts: Rollouts,
    rewards: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    shifts: dict[int, float] | None = None,
    override: dict[str, dict[str, Any]] | None = None,
) -> tuple[dict[str, Batch], FakeEngine]:
    """Run `graph`'s nodes in order: service nodes that sample or score are replaced by the given batches
    (rollout, verify, value_estimate, logprob), evaluation and the critic update are left out, every other
    node runs its real operator with its params (`override[node]` replaces some of them)."""
    engine = FakeEngine(shifts or {})
    given: dict[str, Batch | None] = {
        "rollout": rollouts,
        "verify": Rewards(values=rewards),
        "value_estimate": Values(values=values) if values is not None else None,
        "logprob": LogProbs(values=ref_logp) if ref_logp is not None else None,
    }
    out: dict[str, Batch] = {}
    for node in graph.nodes:
        op = node.operator
        if op.name in ("sample_prompts", "evaluate", "train_critic"):
            continue
        if op.name in given:
            batch = given[op.name]
            assert batch is not None, f"node {node.name} needs a {op.name} batch"
            out[node.name] = batch
            continue
        params = node.params
        if override and node.name in override:
            merged = params.model_dump(exclude_unset=True)  # a part keeps only the fields it was given
            for key, value in override[node.name].items():
                both = isinstance(value, dict) and isinstance(merged.get(key), dict)
                merged[key] = {**merged[key], **value} if both else value
            params = op.params_model(**merged)
        ctx = OpContext(job_id="t", iteration=0, node=node.name, job_seed=0, engine=engine)
        out[node.name] = op.run(ctx, {port: out[src] for port, src in node.inputs.items()}, params)
    return out, engine


def adv_of(out: dict[str, Batch], name: str = "advantage") -> list[float]:
    batch = out[name]
    assert isinstance(batch, Advantages)
    return [float(x) for x in batch.values.tolist()]


def rows(out: dict[str, Batch]) -> float:
    stats = out["train"]
    assert isinstance(stats, TrainStats)
    return stats.stats["rows"]


# -- GRPO: the group std -------------------------------------------------------------------------------
def test_grpo_divides_by_the_group_std() -> None:
    ro = make_rollouts([2] * 4, group_size=4)
    out, _ = run_update(grpo(n=4, optimiser={"minibatches": 1}), ro, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    s = math.sqrt(0.1875)  # biased std of (1, 0, 0, 0)
    assert adv_of(out) == pytest.approx([0.75 / s] + [-0.25 / s] * 3, abs=1e-4)  # std off: 0.75, -0.25
    out, _ = run_update(grpo(n=4, std="unbiased"), ro, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert adv_of(out) == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-4)  # unbiased std 0.5


# -- Dr. GRPO: no std, constant length normaliser ------------------------------------------------------
def test_dr_grpo_no_std_and_sum_over_the_generation_budget() -> None:
    ro = make_rollouts([1, 3], group_size=2)  # lengths differ: a per-length mean would weigh them apart
    out, eng = run_update(dr_grpo(n=2, optimiser={"minibatches": 1}, max_new_tokens=4), ro, torch.tensor([1.0, 0.0]))
    assert adv_of(out) == pytest.approx([0.5, -0.5], abs=1e-4)  # r - mean, not divided by the std (0.5) -> +-1
    # ratio 1: loss = mean over rows of -A * len / 4 = (-0.5 * 1/4 + 0.5 * 3/4) / 2
    assert math.isclose(eng.steps[0][0], (-0.5 / 4 + 0.5 * 3 / 4) / 2, rel_tol=1e-6)  # token_mean: 0.25


# -- DAPO: overlong penalty, clip-higher, dynamic sampling ---------------------------------------------
def test_dapo_overlong_penalty_shapes_the_reward() -> None:
    # all four answers correct; two reach the 4-token budget (buffer 1): penalty -1 -> a learning signal
    ro = make_rollouts([2, 2, 3, 4], group_size=4)
    out, _ = run_update(dapo(n=4, max_new_tokens=4, overlong_buffer=1), ro, torch.ones(4))
    shaped = out["overlong"]
    assert isinstance(shaped, Rewards) and shaped.values.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert adv_of(out) == pytest.approx([0.25 / math.sqrt(0.1875)] * 3 + [-0.75 / math.sqrt(0.1875)], abs=1e-4)


def test_dapo_clip_higher() -> None:
    # ratio 1.25 with A > 0: clip 0.2 would cap it at 1.2; DAPO's eps_high 0.28 leaves it
    ro = make_rollouts([1, 1], group_size=2, tokens=[[1], [2]])
    shifts = {1: math.log(1.25), 2: math.log(1.25)}
    out, eng = run_update(
        dapo(n=2, max_new_tokens=4, optimiser={"minibatches": 1}), ro, torch.tensor([1.0, 0.0]), shifts=shifts
    )
    a = adv_of(out)[0]
    # row 0 (A = a > 0): unclipped, -1.25 a; row 1 (A = -a): -min(-1.25 a, -1.2 a) = 1.25 a
    assert a > 0 and math.isclose(eng.steps[0][0], 0.0, abs_tol=1e-6)
    assert eng.steps[0][1]["clip_frac"] == 0.0  # with eps_high 0.2 token 0 would be clipped: 0.5
    assert eng.grad[1] < 0  # row 0's token still pushed up (clipped: no gradient)
    _, off = run_update(
        dapo(n=2, max_new_tokens=4, optimiser={"minibatches": 1}, policy={"clip_eps_high": 0.2}),
        ro,
        torch.tensor([1.0, 0.0]),
        shifts=shifts,
    )
    assert off.steps[0][1]["clip_frac"] == 0.5 and off.grad[1] == 0


def test_dapo_drops_all_equal_groups_from_the_normaliser() -> None:
    # group 0 informative (lengths 1, 1), group 1 all correct and short: no signal, dropped with its tokens
    ro = make_rollouts([1, 1, 3, 3], group_size=2)
    out, eng = run_update(
        dapo(n=2, max_new_tokens=4, optimiser={"minibatches": 1}), ro, torch.tensor([1.0, 0.0, 1.0, 1.0])
    )
    a = adv_of(out)
    assert a[2:] == [0.0, 0.0] and rows(out) == 2.0
    # the normaliser, through the gradient of a shift that only row 0's token sees
    ro = make_rollouts([1, 1, 3, 3], group_size=2, tokens=[[5], [6], [1, 2, 3], [1, 2, 3]])
    out, eng = run_update(
        dapo(n=2, max_new_tokens=4, optimiser={"minibatches": 1}), ro, torch.tensor([1.0, 0.0, 1.0, 1.0])
    )
    kept = float(eng.grad[5])
    assert math.isclose(kept, -a[0] / 2, rel_tol=1e-5)  # divided by the 2 kept tokens
    _, full = run_update(
        dapo(n=2, max_new_tokens=4, optimiser={"minibatches": 1}),
        ro,
        torch.tensor([1.0, 0.0, 1.0, 1.0]),
        override={"train": {"normaliser": {"skip_norm": "full"}}},
    )
    assert math.isclose(float(full.grad[5]), -a[0] / 8, rel_tol=1e-5)  # by all 8 tokens: GRPO's convention


# -- RLOO: leave-one-out baseline, sequence mean -------------------------------------------------------
def test_rloo_leave_one_out_and_sequence_mean() -> None:
    ro = make_rollouts([1, 3, 2], group_size=3, tokens=[[7], [1, 2, 3], [4, 5]])
    out, eng = run_update(rloo(n=3), ro, torch.tensor([1.0, 0.0, 0.0]))
    assert adv_of(out) == pytest.approx([1.0, -0.5, -0.5], abs=1e-4)  # group mean baseline would give 0.6667, -0.3333
    # seq_mean, ratio 1: d loss / d theta[7] = -A_0 / 1 token / 3 rows; token_mean would give -1/6
    assert math.isclose(float(eng.grad[7]), -1 / 3, rel_tol=1e-5)


# -- REINFORCE++: batch statistics ---------------------------------------------------------------------
def test_reinforce_pp_normalises_over_the_batch() -> None:
    ro = make_rollouts([2] * 4, group_size=2)
    out, _ = run_update(reinforce_pp(n=2, optimiser={"minibatches": 1}), ro, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    s = math.sqrt(0.125)  # baseline (0.5, -0.5, 0, 0): batch std; per group it would be (1, -1, 0, 0)
    assert adv_of(out) == pytest.approx([0.5 / s, -0.5 / s, 0.0, 0.0], abs=1e-4)
    out, _ = run_update(reinforce_pp(n=2, group_baseline=False), ro, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert adv_of(out) == pytest.approx([0.5774, -1.7321, 0.5774, 0.5774], abs=1e-4)


def test_reinforce_pp_token_level_with_discount() -> None:
    ro = make_rollouts([1, 2], group_size=1)
    out, _ = run_update(reinforce_pp(n=1, group_baseline=False, level="token", gamma=0.5), ro, torch.tensor([1.0, 1.0]))
    adv = out["advantage"]
    assert isinstance(adv, Advantages) and adv.values.shape == (2, PROMPT + 4)
    # returns on response tokens: row 0 (1), row 1 (0.5, 1): mean 5/6, biased std sqrt(1/18)
    mean, s = 5 / 6, math.sqrt(1 / 18)
    expected = [(1 - mean) / s, (0.5 - mean) / s, (1 - mean) / s]
    assert torch.allclose(adv.values[ro.response_mask > 0], torch.tensor(expected), atol=1e-4)
    assert (adv.values[ro.response_mask == 0] == 0).all()


# -- GSPO: one ratio per sequence ----------------------------------------------------------------------
def test_gspo_sequence_ratio() -> None:
    # token log-ratios +0.01 and -0.01: the sequence ratio is exactly 1 (inside 1 -+ 3e-4 / 4e-4); a token
    # ratio would clip the first token (1.01 > 1.0004) and change the loss
    ro = make_rollouts([2, 2], group_size=2, tokens=[[1, 2], [1, 2]])
    out, eng = run_update(
        gspo(n=2, optimiser={"minibatches": 1}), ro, torch.tensor([1.0, 0.0]), shifts={1: 0.01, 2: -0.01}
    )
    a = adv_of(out)
    assert a == pytest.approx([1.0, -1.0], abs=1e-4)
    assert eng.steps[0][1]["clip_frac"] == 0.0
    # d loss / d theta: each row's ratio exp(mean) has d/d theta[k] = 1/2 at ratio 1; rows cancel: A sums to 0
    assert torch.allclose(eng.grad, torch.zeros(16), atol=1e-6)
    _, tok = run_update(
        gspo(n=2, optimiser={"minibatches": 1}),
        ro,
        torch.tensor([1.0, 0.0]),
        shifts={1: 0.01, 2: -0.01},
        override={"train": {"policy": {"ratio_level": "token"}}},
    )
    assert tok.steps[0][1]["clip_frac"] > 0 and not torch.allclose(tok.grad, torch.zeros(16), atol=1e-6)


# -- PPO: per-token advantages from the critic ---------------------------------------------------------
def test_ppo_gae_uses_the_critic_values() -> None:
    from plexrl.operators.critic import gae, whiten_tokens

    ro = make_rollouts([2, 1], group_size=2)
    values = torch.zeros(2, PROMPT + 4)
    values[0, PROMPT : PROMPT + 2] = torch.tensor([0.5, 0.8])
    values[1, PROMPT] = 0.3
    rewards = torch.tensor([1.0, 0.0])
    out, eng = run_update(ppo(n=2, optimiser={"minibatches": 1}, lam=0.9), ro, rewards, values=values)
    adv = out["gae"]
    assert isinstance(adv, Advantages) and adv.returns is not None
    raw, ret = gae(rewards, values, ro.response_mask, gamma=1.0, lam=0.9)
    assert torch.allclose(adv.values, whiten_tokens(raw, ro.response_mask)) and torch.allclose(adv.returns, ret)
    # row 0: delta_1 = 1 - 0.8 = 0.2, delta_0 = 0.8 - 0.5 = 0.3 -> A_0 = 0.3 + 0.9 * 0.2 = 0.48
    assert torch.allclose(raw[0, PROMPT : PROMPT + 2], torch.tensor([0.48, 0.2]))
    out0, _ = run_update(ppo(n=2, optimiser={"minibatches": 1}, lam=0.9), ro, rewards, values=torch.zeros_like(values))
    assert not torch.allclose(out0["gae"].values, adv.values)  # type: ignore[attr-defined]
    assert eng.steps  # the train node took the per-token advantages


# -- train: skip_zero_advantage keeps the published normaliser -------------------------------------------
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "seq_sum_token_mean"])
def test_skipping_zero_advantage_rows_does_not_change_the_gradient(agg: str) -> None:
    # group 0 informative, group 1 all-equal (0.3 is not exact in float32); lengths differ
    ro = make_rollouts([1, 2, 3, 4], group_size=2, tokens=[[1], [2, 3], [4, 5, 6], [7, 8, 9, 10]])
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.3])
    shifts = {k: 0.05 * k for k in range(1, 11)}
    runs, outs = {}, {}
    for skip in (True, False):
        params = {"optimiser": {"minibatches": 1}, "normaliser": {"agg": agg, "skip_zero_advantage": skip}}
        outs[skip], runs[skip] = run_update(grpo(n=2), ro, rewards, shifts=shifts, override={"train": params})
    assert rows(outs[True]) == 2.0 and rows(outs[False]) == 4.0
    assert torch.allclose(runs[True].grad, runs[False].grad, atol=1e-7)
    assert math.isclose(runs[True].steps[0][0], runs[False].steps[0][0], rel_tol=1e-6)
    # "kept" rescales by T_all / T_kept: the step size would depend on how many groups were all-equal
    _, kept = run_update(
        grpo(n=2, optimiser={"minibatches": 1}, normaliser={"skip_norm": "kept"}),
        ro,
        rewards,
        shifts=shifts,
        override={"train": {"normaliser": {"agg": agg}}},
    )
    assert not torch.allclose(kept.grad, runs[False].grad, atol=1e-4)


def test_skip_with_minibatches_divides_each_step_by_the_whole_batch_share() -> None:
    ro = make_rollouts([1, 1, 1, 1, 2, 2], group_size=2, tokens=[[1], [2], [3], [3], [4, 4], [4, 4]])
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.5, 0.5])  # 2 of 3 groups all-equal; 8 tokens in all
    _, eng = run_update(grpo(n=2, optimiser={"minibatches": 2}), ro, rewards, shifts={1: 0.0})
    assert len(eng.steps) == 2  # rows 0 and 1 kept, one per step
    # step 1: -A_0 * ratio / (8 tokens / 2 steps): A_0 = 1 (std 0.5)
    assert math.isclose(float(eng.steps[0][2][1]), -1 / 4, rel_tol=1e-5)


def test_rows_with_a_kl_term_are_not_skipped() -> None:
    ro = make_rollouts([1, 1, 1, 1], group_size=2, tokens=[[1], [2], [3], [4]])
    ref = -torch.ones(4, PROMPT + 4) * ro.response_mask - 0.5 * ro.response_mask  # ref logp -1.5
    out, eng = run_update(
        grpo(n=2, kl={"coef": 0.1}, optimiser={"minibatches": 1}), ro, torch.tensor([1.0, 0.0, 1.0, 1.0]), ref_logp=ref
    )
    assert rows(out) == 4.0  # the all-equal group's KL gradient is kept
    assert eng.grad[3] != 0 and eng.grad[4] != 0
