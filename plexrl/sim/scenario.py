"""A whole scenario (`plexrl simulate` of a `kind: scenario` file): each deployment run by its model, the
planner's simulation (`deploy.py`) or the engine-level one (`engine.py`), and the comparisons the report
makes (`ScenarioResult`). Above both models, so that neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plexrl.sim.config import Accelerator, Deployment, Scenario
from plexrl.sim.deploy import BASELINES, DeploymentResult, StepTable, run_deployment, tune_deployment
from plexrl.sim.engine import run_engine_deployment


def run_one(
    sc: Scenario, dep: Deployment, acc: Accelerator | None = None, tables: dict[Any, StepTable] | None = None
) -> DeploymentResult:
    """A deployment as `plexrl simulate` runs it: tuned if it says `tune: true`; `plexrl-engine` by the
    engine-level model (`plexrl.sim.engine`)."""
    if dep.kind == "plexrl-engine":
        return run_engine_deployment(sc, dep, acc)
    return tune_deployment(sc, dep, acc, tables) if dep.tune else run_deployment(sc, dep, acc, tables)


@dataclass(slots=True)
class ScenarioResult:
    scenario: Scenario
    results: list[DeploymentResult]
    sweep: dict[str, list[DeploymentResult]] = field(default_factory=dict)  # accelerator -> results

    def baseline(self, results: list[DeploymentResult] | None = None) -> DeploymentResult:
        return next(r for r in results or self.results if r.name == self.scenario.baseline)

    def strongest(self, results: list[DeploymentResult] | None = None) -> DeploymentResult:
        """The cheapest baseline (colocated, split-sync, split-async; GPU-hours per step): what PlexRL must beat."""
        return min((r for r in results or self.results if r.kind in BASELINES), key=lambda r: r.gpu_hours_per_step)

    def headline(
        self, results: list[DeploymentResult] | None = None, off_policy: bool = False
    ) -> DeploymentResult | None:
        """The cheapest PlexRL layout (on- or off-policy) whose step is at most `matched_step` x the strongest
        baseline's, or None."""
        base = self.strongest(results)
        ok = [
            r for r in results or self.results
            if r.kind.startswith("plexrl") and r.off_policy == off_policy
            and r.step_seconds <= self.scenario.matched_step * base.step_seconds
        ]  # fmt: skip
        return min(ok, key=lambda r: r.gpu_hours_per_step, default=None)

    def saving(self, r: DeploymentResult, against: DeploymentResult) -> float:
        return 1 - r.gpu_hours_per_step / against.gpu_hours_per_step

    def slowdowns(self, r: DeploymentResult, results: list[DeploymentResult] | None = None) -> list[float]:
        """Each job's completion time / the same job's under the strongest baseline."""
        base = self.strongest(results)
        return [r.jct[j] / base.jct[j] for j in sorted(r.jct)]


def run_scenario(sc: Scenario, accelerators: dict[str, Accelerator] | None = None) -> ScenarioResult:
    """Every deployment of the scenario, then (for `sweep_accelerators`, resolved in `accelerators`) again on
    each other accelerator."""
    tables: dict[Any, StepTable] = {}
    out = ScenarioResult(sc, [run_one(sc, d, tables=tables) for d in sc.deployments])
    for name in sc.sweep_accelerators:
        acc = (accelerators or {})[name]
        tables = {}
        out.sweep[name] = [run_one(sc, d, acc, tables) for d in sc.deployments]
    return out


__all__ = ["ScenarioResult", "run_one", "run_scenario"]
