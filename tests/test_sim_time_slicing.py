"""The simulator's `time-slicing` deployment (the llm-d / OpenRL design: a FIFO lock per pool held for a phase,
whole-state switches at the host link plus `switch_fixed_s` each way) beside PlexRL, on the real planner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from plexrl.sim.config import Scenario, Trace, parse_sim
from plexrl.sim.deploy import run_deployment
from plexrl.sim.report import against_slicing, scenario_rows
from plexrl.sim.scenario import ScenarioResult
from plexrl.sim.trace import run_policy

SIM = Path(__file__).resolve().parents[1] / "configs" / "sim"


def small(name: str = "qwen25_7b", **changes: Any) -> Scenario:
    raw = yaml.safe_load((SIM / f"{name}.yaml").read_text())
    raw["workload"].update(prompts=64, samples=8, steps=4)
    raw.update({"jobs": 4, "rollout_samples": 4, "sweep_accelerators": [], **changes})
    sc = parse_sim(raw, "test")
    assert isinstance(sc, Scenario)
    return sc


def deployment(sc: Scenario, name: str) -> Any:
    return next(d for d in sc.deployments if d.name == name)


def test_one_job_per_pool_is_colocated_and_two_pay_a_whole_state_switch_at_each_hand_over() -> None:
    sc = small()
    ts = deployment(sc, "time-slicing").model_copy(update={"tune": False, "rollout_tp": 1})
    colo = deployment(sc, "colocated").model_copy(update={"tune": False, "rollout_tp": 1})
    alone = run_deployment(sc, ts.model_copy(update={"jobs_per_pool": 1}))
    assert alone.gpu_hours_per_step == pytest.approx(run_deployment(sc, colo).gpu_hours_per_step)
    assert alone.swap_seconds == 0.0  # nobody else takes the lock: nothing moves
    two = run_deployment(sc, ts)
    assert two.services == alone.services // 2 and two.swap_seconds > 0
    dear = sc.model_copy(update={"efficiency": sc.efficiency.model_copy(update={"switch_fixed_s": 3.0})})
    slower = run_deployment(dear, ts)
    moves = (slower.swap_seconds - two.swap_seconds) / 2.0  # each move pays 2 s more
    assert moves == pytest.approx(round(moves)) and moves >= 2 * 4  # out and in, at least once a step per pair
    shared = run_deployment(sc, deployment(sc, "plexrl-shared").model_copy(update={"rollout_tp": 1}))
    assert shared.swap_seconds < two.swap_seconds  # PlexRL's planner keeps or prefetches states


def test_the_report_says_where_plexrl_stands_against_time_slicing_at_matched_step() -> None:
    sc = small()
    keep = [d for d in sc.deployments if d.name in ("colocated", "plexrl-shared", "time-slicing")]
    sc = sc.model_copy(update={"deployments": [d.model_copy(update={"tune": False}) for d in keep]})
    res = ScenarioResult(sc, [run_deployment(sc, d) for d in sc.deployments])
    assert res.strongest().name == "colocated"  # time-slicing is not one of the baselines
    line = against_slicing(sc, scenario_rows(res, res.results))
    assert line is not None and line.startswith("against time-slicing (the llm-d / OpenRL design")
    assert "plexrl-shared saves" in line or "no on-policy PlexRL row" in line


def test_a_trace_replays_under_time_slicing() -> None:
    raw = yaml.safe_load((SIM / "trace_3months.yaml").read_text())
    for c in raw["classes"]:
        c["steps_median"] = 30
        c["workload"].update(prompts=32, samples=4)
    raw.update({"jobs": 12, "days": 0.05, "burst": 0.0, "rollout_samples": 4, "steps_per_node": 5,
                "cluster_accelerators": 640, "rollout_fleet": 512, "service_accelerators": 64})  # fmt: skip
    tr = parse_sim(raw, "test")
    assert isinstance(tr, Trace) and "time-slicing" in tr.placements
    sliced, planned = run_policy(tr, "time-slicing"), run_policy(tr, "spread+backfill")
    assert min(sliced.slowdown.values()) >= 1.0 - 1e-9
    assert sorted(sliced.slowdown) == sorted(planned.slowdown)
