"""Real iteration numbers everywhere: a job's plan carries its first iteration (`JobPlan.first_iteration`, a job
resumed from the checkpoint after iteration k starts at k + 1), and the planner, the runner's hooks and the
journal's checkpoints count real iterations, with no offset added anywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plexrl.hooks.base import Hook
from plexrl.job.spec import JobRun
from plexrl.planner import (
    FailJob,
    IterationDone,
    JobDone,
    JobPlan,
    JobSubmitted,
    NodeFinished,
    NodePlan,
    Planner,
    RunNode,
    ServiceJoined,
)
from plexrl.runtime.runner import Runner
from plexrl.runtime.sim import GB, GRPO_ORDER, SeededCosts, SimExecutor, SimJob, grpo_nodes
from plexrl.server.controller import JournalHook

# a[service] -> b[cpu]; e[service] every 2 iterations (and at the last), with a baseline pass
NODES = {"a": NodePlan("service"), "b": NodePlan("cpu", ("a",)), "e": NodePlan("service", ("b",), every=2)}


def drive(plan: JobPlan) -> list[tuple[str, int, str]]:
    """Run one job through the planner alone, finishing every node at once; what it ran and closed, in order."""
    p = Planner(clock=lambda: 0.0, validate=True)
    p.handle(ServiceJoined("s0"))
    seen: list[tuple[str, int, str]] = []
    todo = list(p.handle(JobSubmitted("j", plan)))
    while todo:
        ins = todo.pop(0)
        if isinstance(ins, RunNode):
            seen.append(("run", ins.iteration, ins.node))
            todo += p.handle(NodeFinished("j", ins.iteration, ins.node, duration=1.0))
        elif isinstance(ins, IterationDone):
            seen.append(("done", ins.iteration, ""))
        elif isinstance(ins, JobDone | FailJob):
            seen.append((type(ins).__name__, -9, getattr(ins, "reason", "")))
    return seen


def test_the_planner_counts_from_the_plans_first_iteration() -> None:
    fresh = drive(JobPlan(NODES, iterations=5, order=("a", "b", "e"), baseline=("e",)))
    resumed = drive(JobPlan(NODES, iterations=5, order=("a", "b", "e"), first_iteration=3))
    assert fresh[:2] == [("run", -1, "e"), ("done", -1, "")]  # the baseline pass
    assert resumed == [
        ("run", 3, "a"), ("run", 3, "b"), ("run", 3, "e"), ("done", 3, ""),  # 3: (3 + 1) % 2 == 0
        ("run", 4, "a"), ("run", 4, "b"), ("run", 4, "e"), ("done", 4, ""),  # 4: the last
        ("JobDone", -9, ""),
    ]  # fmt: skip
    assert [s for s in fresh if s[1] >= 3] == resumed[:-1]  # the same iterations, the same nodes, in phase
    # a plan with no iteration left fails at once, with the reason
    (failed,) = [s for s in drive(JobPlan(NODES, iterations=3, first_iteration=3)) if s[0] == "FailJob"]
    assert "at least one iteration" in failed[2]


class Seen(Hook):
    def __init__(self) -> None:
        self.iterations: list[int] = []
        self.nodes: set[int] = set()

    def after_node(self, run: JobRun, iteration: int, node: str, lane: str, start: float, end: float,
                   metrics: dict[str, float]) -> None:  # fmt: skip
        self.nodes.add(iteration)

    def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        self.iterations.append(iteration)


def test_a_resumed_simulated_job_runs_its_real_iterations_and_checkpoints_under_them(tmp_path: Path) -> None:
    nodes = grpo_nodes(every=2)
    job = SimJob("j", nodes, 8, {n: 0.1 for n in nodes}, GRPO_ORDER, ("evaluate",), GB, first_iteration=5,
                 checkpoint_every=2)  # fmt: skip
    journal: Any = None  # (checkpoint_path reads neither the journal nor the runner)
    hook, seen = (
        JournalHook(journal, lambda j, r: None, lambda j: {}, checkpoint_every=2, checkpoint_dir=tmp_path),
        Seen(),
    )
    ex = SimExecutor(1, SeededCosts(seed=0))
    paths: list[Any] = []

    def checkpoint_at(run: JobRun, iteration: int) -> Path:
        paths.append(hook.checkpoint_path(run, iteration))
        return paths[-1]

    (run,) = Runner(ex, Planner(clock=ex.clock, validate=True), hooks=[seen], checkpoint_at=checkpoint_at).run([job])
    assert run.status == "done" and run.iterations_done == 3
    assert seen.iterations == [5, 6, 7] and seen.nodes == {5, 6, 7}  # no baseline pass, no renumbering
    # checkpoint after (real) iteration 5 (every 2); none after 7, the last
    assert paths == [tmp_path / "j" / "after-5.pt"]
