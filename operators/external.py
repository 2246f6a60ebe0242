"""Verification by an external service: the kind of step that leaves a job's accelerator idle.

RLVR jobs often verify through something outside the trainer: an LLM judge behind an API, a remote
sandbox farm running unit tests, a theorem prover on another cluster. The job waits for the round trip,
and its service has nothing to do meanwhile; this is one of the gaps PlexRL fills with other jobs' work.

`remote_verify` stands in for such a verifier: it scores with the task's own pure verifier (so rewards are
exactly those of `verify`) and waits `latency_s` per call, the round-trip time of the remote service it
models (the wait is the modelled part; it holds no CPU). Use `verify` when the verifier is local.
"""

from __future__ import annotations

import time
from typing import Annotated

from pydantic import Field

from plexrl.batch import Rewards, Rollouts
from plexrl.operator import OpContext, operator


@operator(runs_on="cpu")
def remote_verify(
    rollouts: Rollouts,
    ctx: OpContext,
    *,
    latency_s: Annotated[float, Field(ge=0, description="round trip of the remote verifier, seconds")] = 0.5,
    correct_reward: float = 1.0,
    wrong_reward: float = 0.0,
) -> Rewards:
    """Rewards as `verify` gives them, returned after the remote verifier's round trip `latency_s` (>= 0)."""
    import torch

    deadline = time.monotonic() + latency_s
    scores = ctx.task.verify(rollouts.completions, rollouts.answers)
    correct = torch.tensor([s == 1.0 for s in scores], dtype=torch.bool)  # bool even for 0 rows
    values = torch.where(correct, correct_reward, wrong_reward).float()
    rest = deadline - time.monotonic()
    if rest > 0:
        time.sleep(rest)  # waiting on the network: the CPU is free, the job's service is idle
    return Rewards(values=values, correct=correct)
