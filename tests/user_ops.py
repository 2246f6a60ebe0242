"""A user's own operators, outside the project (used from YAML by dotted path in the tests)."""

from __future__ import annotations

import os

from plexrl import operator
from plexrl.batch import EvalStats, Rewards, Rollouts
from plexrl.operator import OpContext


@operator(runs_on="cpu")
def length_penalty(rollouts: Rollouts, rewards: Rewards, *, per_token: float = 0.01) -> Rewards:
    """Subtract `per_token` per response token from each reward."""
    return Rewards(values=rewards.values - per_token * rollouts.response_lengths.float(), correct=rewards.correct)


def not_an_operator() -> None:
    """A plain function: naming it as an operator must be refused."""


@operator(runs_on="service")
def kill_own_worker(ctx: OpContext, *, at_iteration: int = 1) -> EvalStats:
    """Simulate a lost machine: the process that hosts this job's service dies mid-node."""
    if ctx.iteration >= at_iteration:
        os._exit(17)
    return EvalStats(accuracy=0.0, response_length=0.0, size=0)


@operator(runs_on="service")
def kill_own_worker_once(ctx: OpContext, *, at_iteration: int = 1, marker: str = "") -> EvalStats:
    """`kill_own_worker` the first time only: the process dies at `at_iteration` unless `marker` exists (it
    creates it first), so that the job resumed elsewhere from its checkpoint runs through."""
    if ctx.iteration >= at_iteration and not os.path.exists(marker):
        with open(marker, "w"):
            pass
        os._exit(17)
    return EvalStats(accuracy=0.0, response_length=0.0, size=0)


RUNS: dict[tuple[str, int], int] = {}  # (job, iteration) -> runs of `flaky_length_penalty` (in-process only)


@operator(runs_on="cpu")
def flaky_length_penalty(
    ctx: OpContext, rollouts: Rollouts, rewards: Rewards, *, per_token: float = 0.25, fail_runs: int = 2
) -> Rewards:
    """`length_penalty` with a transient fault: its first `fail_runs` runs of each iteration raise."""
    key = (ctx.job_id, ctx.iteration)
    RUNS[key] = RUNS.get(key, 0) + 1
    if RUNS[key] <= fail_runs:
        raise ConnectionError(f"transient fault, run {RUNS[key]} of iteration {ctx.iteration}")
    return Rewards(values=rewards.values - per_token * rollouts.response_lengths.float(), correct=rewards.correct)


@operator(runs_on="cpu")
def first_token_parity(rollouts: Rollouts, rewards: Rewards) -> Rewards:
    """1 where the response's first token id is even: a learnable signal for a random model with a large
    vocabulary (which never samples eos, so lengths never vary)."""
    first = rollouts.input_ids[:, rollouts.prompt_len]
    return Rewards(values=(first % 2 == 0).float(), correct=rewards.correct)
