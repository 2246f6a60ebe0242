"""DAPO dynamic sampling with refill (operators/sampling.py): groups pooled across rollout attempts with
different layouts stay row-aligned with their rewards, the pool stops at the wanted size, refills sample
only what is missing, and the dapo pipeline with refills runs end to end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from plexrl.batch import EvalStats, LogProbs, Prompts, Rewards, Rollouts
from plexrl.job.load import load_job
from plexrl.operator import OpContext, operator
from plexrl.operators.sampling import RolloutPool, keep_informative, pool_rewards, pool_rollouts, refill_prompts
from plexrl.runtime.jobs import run_jobs

PAD = 99


def attempt(prompt_len: int, responses: list[list[int]], tag: str, group_size: int = 2) -> Rollouts:
    """Rows with prompt tokens [10 + i] * prompt_len (left-padded to prompt_len + 1), responses right-padded;
    behaviour log-prob of a response token = -token / 100; completion and answer name the row."""
    n, width = len(responses), max(map(len, responses))
    cols = prompt_len + 1 + width
    ids = torch.full((n, cols), PAD)
    attn = torch.zeros(n, cols, dtype=torch.long)
    resp = torch.zeros(n, cols)
    logp = torch.zeros(n, cols)
    for i, r in enumerate(responses):
        ids[i, 1 : prompt_len + 1] = 10 + i
        attn[i, 1 : prompt_len + 1] = 1
        start = prompt_len + 1
        ids[i, start : start + len(r)] = torch.tensor(r)
        attn[i, start : start + len(r)] = 1
        resp[i, start : start + len(r)] = 1
        logp[i, start : start + len(r)] = -torch.tensor(r, dtype=torch.float) / 100
    names = [f"{tag}{i}" for i in range(n)]
    return Rollouts(
        input_ids=ids, attention_mask=attn, response_mask=resp, behaviour_logprobs=logp, prompt_len=prompt_len + 1,
        response_lengths=torch.tensor([len(r) for r in responses]), finish_reasons=["stop"] * n, completions=names,
        answers=names, group_size=group_size, temperature=1.0, weight_version=3,
    )  # fmt: skip


def scores(values: list[float]) -> Rewards:
    v = torch.tensor(values)
    return Rewards(values=v, correct=v == 1.0)


@dataclass
class Tok:
    pad_token_id: int = PAD

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


@dataclass
class Problem:
    prompt: str
    answer: str


@dataclass
class Task:
    train: list[Problem]


def ctx(node: str) -> OpContext:
    task = Task([Problem(f"{i}+1=", str(i + 1)) for i in range(50)])
    return OpContext(job_id="t", iteration=0, node=node, job_seed=0, task=task, tokenizer=Tok())


def keep(ro: Rollouts, rw: Rewards, pool: RolloutPool | None, groups: int, node: str) -> RolloutPool:
    out = keep_informative.fn(ro, rw, ctx(node), pool, groups=groups)
    assert isinstance(out, RolloutPool)
    return out


def test_pool_keeps_rows_aligned_across_attempts_with_different_layouts() -> None:
    # attempt 1: prompt 2 tokens, groups (a0,a1) informative, (a2,a3) all 0.3, (a4,a5) informative
    a = attempt(2, [[1, 2], [3], [4], [5], [6, 7, 8], [9]], "a")
    pool = keep(a, scores([1.0, 0.0, 0.3, 0.3, 0.0, 1.0]), None, groups=4, node="keep0")
    assert pool.groups == 2 and pool.sampled == 3 and pool.attempts == 1
    # attempt 2: prompt 4 tokens, wider responses; (b0,b1) all 1, (b2,b3) and (b4,b5) informative: one fits
    b = attempt(4, [[1], [2], [3, 4, 5, 6], [7], [8], [9]], "b")
    pool = keep(b, scores([1.0, 1.0, 0.0, 1.0, 1.0, 0.0]), pool, groups=3, node="keep1")
    assert pool.metrics() == {"groups": 3.0, "attempts": 2.0, "sampled": 6.0, "kept_frac": 0.5, "short": 0.0}
    ro, rw = pool_rollouts.fn(pool), pool_rewards.fn(pool)
    assert ro.completions == ro.answers == ["a0", "a1", "a4", "a5", "b2", "b3"]
    assert rw.values.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert rw.correct is not None and rw.correct.tolist() == [True, False, False, True, False, True]
    assert ro.prompt_len == 5 and ro.input_ids.shape == (6, 5 + 4)
    # every row: its own prompt and response tokens, in place, with masks and log-probs that follow them
    expected = {"a0": (2, 10, [1, 2]), "a1": (2, 11, [3]), "a4": (2, 14, [6, 7, 8]), "a5": (2, 15, [9]),
                "b2": (4, 12, [3, 4, 5, 6]), "b3": (4, 13, [7])}  # fmt: skip
    for i, name in enumerate(ro.completions):
        plen, ptok, resp = expected[name]
        prompt = ro.input_ids[i, : ro.prompt_len][ro.attention_mask[i, : ro.prompt_len] > 0]
        assert prompt.tolist() == [ptok] * plen
        response = ro.input_ids[i][ro.response_mask[i] > 0]
        assert response.tolist() == resp and int(ro.response_lengths[i]) == len(resp)
        assert torch.allclose(ro.behaviour_logprobs[i][ro.response_mask[i] > 0], -torch.tensor(resp) / 100)
        assert (ro.input_ids[i][ro.attention_mask[i] == 0] == PAD).all()
        assert (ro.response_mask[i, : ro.prompt_len] == 0).all()


def test_refill_samples_only_what_is_missing() -> None:
    a = attempt(2, [[1], [2], [3], [3], [4], [4], [5], [5]], "a")
    pool = keep(a, scores([1.0, 0.0, 0.5, 0.5, 1.0, 1.0, 0.0, 0.0]), None, groups=3, node="keep0")
    assert pool.groups == 1  # 1 informative group of 4 sampled: rate 1/4, 2 missing -> 8 prompts
    prompts = refill_prompts.fn(pool, ctx("refill1"), max_prompts=16)
    assert isinstance(prompts, Prompts) and len(prompts) == 8
    assert prompts.token_ids[0] == [ord(c) for c in prompts.texts[0]]
    assert len(refill_prompts.fn(pool, ctx("refill1"), max_prompts=5)) == 5  # capped
    again = refill_prompts.fn(pool, ctx("refill1"), max_prompts=16)
    assert again.texts == prompts.texts  # seeded by job, iteration and node
    assert refill_prompts.fn(pool, ctx("refill2"), max_prompts=16).texts != prompts.texts
    full = keep(a, scores([1.0, 0.0] * 4), None, groups=3, node="keep0")
    assert full.groups == 3 and len(refill_prompts.fn(full, ctx("refill1"), max_prompts=16)) == 0
    none = keep(a, scores([1.0] * 8), None, groups=3, node="keep0")
    assert len(refill_prompts.fn(none, ctx("refill1"), max_prompts=16)) == 16  # no informative group yet


def test_dapo_with_refill_runs_and_logs_the_pool(tiny_config: dict[str, Any]) -> None:
    tiny_config["tracking"]["mlflow"] = False
    params = {"batch_size": 4, "n": 4, "max_new_tokens": 4, "eval_every": 2, "eval_size": 16, "max_refills": 2}
    tiny_config["pipeline"] = {"name": "dapo", "params": params}
    (job,) = run_jobs([load_job(tiny_config)], progress=False)
    assert job.status == "done", job.error
    for row in job.history[1:]:  # row 0: the baseline evaluation
        groups = row["keep2/groups"]
        assert groups <= 4 and row["keep2/short"] == 4 - groups
        assert row["keep0/sampled"] == 4 and row["keep2/sampled"] > 4  # the refills sampled more prompts
        assert row["train/rows"] + row["train/rows_skipped"] == groups * 4


@operator(runs_on="cpu")
def logprob_gap(rollouts: Rollouts, logprobs: LogProbs) -> EvalStats:
    """Largest |log-prob under the current policy - behaviour log-prob| over the response tokens."""
    gap = ((logprobs.values - rollouts.behaviour_logprobs) * rollouts.response_mask).abs().max()
    return EvalStats(accuracy=float(gap), size=len(rollouts))


def test_pooled_rows_score_as_sampled_on_the_real_engine(tiny_config: dict[str, Any]) -> None:
    """Rows pooled from three attempts (re-padded) and scored again by the engine give the log-probs they were
    sampled with, and train on all of them: prompts, responses, masks and positions survived the pooling.
    A length penalty makes every group informative, so the pool fills from real rollouts."""
    tiny_config["tracking"]["mlflow"] = False
    sample = {"n": 4}
    nodes: list[dict[str, Any]] = [{"name": "prompts", "op": "sample_prompts", "params": {"batch_size": 2}}]
    pool = None
    for k in range(3):
        source = "prompts" if k == 0 else f"refill{k}"
        if k:
            nodes.append(
                {"name": source, "op": "refill_prompts", "inputs": {"pool": pool}, "params": {"max_prompts": 2}}
            )
        nodes += [
            {"name": f"rollout{k}", "op": "rollout", "inputs": {"prompts": source},
             "params": {**sample, "max_new_tokens": 2 + 2 * k}},  # three response widths to re-pad
            {"name": f"verify{k}", "op": "verify", "inputs": {"rollouts": f"rollout{k}"}},
            {"name": f"shaped{k}", "op": "user_ops:length_penalty", "params": {"per_token": 0.1},
             "inputs": {"rollouts": f"rollout{k}", "rewards": f"verify{k}"}},
            {"name": f"keep{k}", "op": "keep_informative", "params": {"groups": 6},
             "inputs": {"rollouts": f"rollout{k}", "rewards": f"shaped{k}", **({"pool": pool} if pool else {})}},
        ]  # fmt: skip
        pool = f"keep{k}"
    nodes += [
        {"name": "batch", "op": "pool_rollouts", "inputs": {"pool": pool}},
        {"name": "rewards", "op": "pool_rewards", "inputs": {"pool": pool}},
        {"name": "policy", "op": "logprob", "inputs": {"rollouts": "batch"}, "params": {"which": "policy"}},
        {"name": "gap", "op": "test_dynamic_sampling:logprob_gap",
         "inputs": {"rollouts": "batch", "logprobs": "policy"}},
        {"name": "advantage", "op": "grpo_advantage", "inputs": {"rollouts": "batch", "rewards": "rewards"}},
        {"name": "train", "op": "train", "inputs": {"rollouts": "batch", "advantages": "advantage"}, "after": ["gap"]},
    ]  # fmt: skip
    tiny_config["pipeline"] = {"nodes": nodes}
    (job,) = run_jobs([load_job(tiny_config)], progress=False)
    assert job.status == "done", job.error
    for row in job.history:
        if "keep2/groups" not in row:
            continue
        assert row["keep2/sampled"] > row["keep0/sampled"]  # refilled
        assert row["train/rows"] + row["train/rows_skipped"] == row["keep2/groups"] * 4 > 0
        assert row["gap/accuracy"] < 1e-4


def test_verifiers_score_an_empty_refill_attempt() -> None:
    """A refill attempt whose pool is already full rolls out 0 rows; verification must give 0 rewards, not fail
    (torch.tensor([]) is float, and torch.where needs a bool condition)."""
    from plexrl.operators.external import remote_verify
    from plexrl.operators.verify import verify

    class Checker:
        def verify(self, completions: list[str], answers: list[str]) -> list[float]:
            return [1.0 if c == a else 0.0 for c, a in zip(completions, answers, strict=True)]

    empty = torch.zeros(0, 0, dtype=torch.long)
    ro = Rollouts(
        input_ids=empty, attention_mask=empty, response_mask=empty.float(), behaviour_logprobs=empty.float(),
        prompt_len=0, response_lengths=torch.zeros(0, dtype=torch.long), finish_reasons=[], completions=[],
        answers=[], group_size=4, temperature=1.0, weight_version=0,
    )  # fmt: skip
    c = OpContext(job_id="t", iteration=0, node="verify2", job_seed=0, task=Checker())
    for out in (verify.fn(ro, c), remote_verify.fn(ro, c, latency_s=0.0)):
        assert out.values.shape == (0,) and out.correct.dtype == torch.bool
