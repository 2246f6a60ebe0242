"""The simulator's jobs and where their time comes from: `SimJob` (a simulated job's frozen spec), `SimCosts` (the
ground truth a `SimExecutor` imposes, `runtime/sim.py`) with `SeededCosts` (seeded draws around each job's
means), and a synthetic GRPO-like workload (`grpo_nodes`, `grpo_like_jobs`). Pure: no clock, no I/O."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from plexrl.planner.events import JobPlan, NodePlan

GB = 1_000_000_000


@dataclass(frozen=True, slots=True)
class SimJob:
    """A simulated job's frozen spec: what the runner needs (`RunnableSpec`) and what a cost model reads
    (`means`: mean seconds per node; `tails`: nodes whose durations are heavy-tailed). Its state is
    `state_bytes`, exactly (no growth)."""

    job_id: str
    nodes: Mapping[str, NodePlan]
    iterations: int
    means: Mapping[str, float]
    order: tuple[str, ...] = ()
    baseline: tuple[str, ...] = ()
    state_bytes: int = 0
    tails: frozenset[str] = frozenset()
    # service node -> seconds of one slice (decode-step preemption): the node's drawn time runs as slices of at
    # most this, each but the last reported paused (a slice of K decode steps, as a time)
    slice_s: Mapping[str, float] = field(default_factory=dict)
    model_dir: Path | None = None
    # nodes run on the job's own accelerators, not on a planner service nor on the CPU pool (see the module)
    dedicated: frozenset[str] = frozenset()
    # node -> durations to draw from (seconds), for cost models that sample (`SampledCosts`)
    samples: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    # a job resumed after iteration first_iteration - 1 (a server's checkpoint): it runs the iterations left,
    # under their real numbers, with no baseline pass
    first_iteration: int = 0
    user: str = ""  # who submitted it (fair-share ordering)
    checkpoint_every: int = 0  # checkpoint it on its service after every k-th iteration (a server's; 0: never)
    attempt: int = 1  # its placement count with this one (a server's)
    attempts: int = 1  # placements in all (a job of a lost service is placed again while attempt < attempts)

    def plan(self) -> JobPlan:
        """Its plan, built as every spec's is (`JobPlan.of`)."""
        return JobPlan.of(
            self.nodes, self.iterations, order=self.order, baseline=self.baseline, state_bytes=self.state_bytes,
            user=self.user, first_iteration=self.first_iteration, checkpoint_every=self.checkpoint_every,
            attempt=self.attempt, attempts=self.attempts,
        )  # fmt: skip

    def inputs(self, node: str) -> dict[str, str]:
        """Input port -> producing node: one port per dependency, named after it."""
        return {dep: dep for dep in self.nodes[node].deps}


class SimCosts(Protocol):
    """Where the simulated time comes from. Named apart from `plexrl.planner.costs.CostModel`, which is
    what the planner LEARNS online; this is the ground truth the simulator imposes."""

    def duration(self, job: SimJob, iteration: int, node: str) -> float:
        """Run time of one node (seconds, swaps excluded)."""
        ...

    def swap_seconds(self, nbytes: int) -> float:
        """Time to move one job's state of `nbytes` between two tiers."""
        ...

    def load_seconds(self, job: SimJob, nbytes: int) -> float:
        """Time to create the job's engine and state on its service."""
        ...


@dataclass(frozen=True, slots=True)
class SeededCosts:
    """Durations drawn around each job's `means`, a pure function of (seed, job, iteration, node): the same
    for every policy. Uniform within +-`jitter` of the mean; nodes in the job's `tails` are Pareto(`tail_alpha`)
    scaled to the same mean (rare draws are 10-100x). Moves at `swap_bandwidth`, loads at `load_bandwidth`
    bytes/s (None: loads are instant)."""

    seed: int = 0
    jitter: float = 0.3
    tail_alpha: float = 1.5
    swap_bandwidth: float = 20 * GB
    load_bandwidth: float | None = 2 * GB

    def duration(self, job: SimJob, iteration: int, node: str) -> float:
        mean = job.means[node]
        tail = node in job.tails
        if not tail and self.jitter == 0:
            return mean
        rng = random.Random(f"{self.seed}/{job.job_id}/{iteration}/{node}")
        if tail:
            a = self.tail_alpha
            return mean * rng.paretovariate(a) * (a - 1) / a  # the mean of Pareto(a) is a / (a - 1)
        return mean * rng.uniform(1 - self.jitter, 1 + self.jitter)

    def swap_seconds(self, nbytes: int) -> float:
        return nbytes / self.swap_bandwidth

    def load_seconds(self, job: SimJob, nbytes: int) -> float:
        return 0.0 if self.load_bandwidth is None else nbytes / self.load_bandwidth


# -- a synthetic workload -----------------------------------------------------------------------------------
GRPO_ORDER = ("prompts", "rollout", "verify", "advantage", "train", "evaluate")


def grpo_nodes(every: int = 10) -> dict[str, NodePlan]:
    """A GRPO-like iteration: prompts[cpu] -> rollout[service] -> verify[cpu] -> advantage[cpu] ->
    train[service], and evaluate[service] every `every` iterations."""
    return {
        "prompts": NodePlan("cpu"),
        "rollout": NodePlan("service", ("prompts",)),
        "verify": NodePlan("cpu", ("rollout",)),
        "advantage": NodePlan("cpu", ("rollout", "verify")),
        "train": NodePlan("service", ("advantage", "rollout")),
        "evaluate": NodePlan("service", ("train",), every=every),
    }


def grpo_like_jobs(n: int, iterations: tuple[int, int], seed: int) -> list[SimJob]:
    """`n` seeded GRPO-like jobs: iterations uniform in `iterations`, states of 3 or 4 GB, 30% with a
    baseline evaluate, 20% with a heavy-tailed verify (a slow reward model or sandbox)."""
    rng = random.Random(seed)
    nodes = grpo_nodes(every=10)
    jobs = []
    for i in range(n):
        its = rng.randint(*iterations)
        baseline = ("evaluate",) if rng.random() < 0.3 else ()
        state = rng.choice((3 * GB, 4 * GB))
        means = {
            "prompts": rng.uniform(0.005, 0.02),
            "rollout": rng.uniform(0.1, 0.5),
            "verify": rng.uniform(0.02, 0.2),
            "advantage": rng.uniform(0.002, 0.01),
            "train": rng.uniform(0.1, 0.4),
            "evaluate": rng.uniform(0.1, 0.3),
        }
        tails = frozenset({"verify"}) if rng.random() < 0.2 else frozenset()
        jobs.append(SimJob(f"job{i:03d}", nodes, its, means, GRPO_ORDER, baseline, state, tails))
    return jobs


__all__ = ["GB", "GRPO_ORDER", "SeededCosts", "SimCosts", "SimJob", "grpo_like_jobs", "grpo_nodes"]
