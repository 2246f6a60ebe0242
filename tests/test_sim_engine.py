"""LoRA jobs in the simulator and the engine-level model of several jobs' rollouts in one engine
(`plexrl-engine`: multi-LoRA over one base, or two full models on one pool). Deterministic; no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from plexrl.errors import ConfigError
from plexrl.sim.config import Deployment, Scenario, parse_sim
from plexrl.sim.costs import (
    DoesNotFit,
    adapter_bytes,
    host_bytes,
    rank_params,
    sync_seconds,
    train_seconds,
    train_state_bytes,
)
from plexrl.sim.deploy import job_state, run_deployment
from plexrl.sim.engine import simulate_pool
from plexrl.sim.scenario import run_one

SIM = Path(__file__).resolve().parents[1] / "configs" / "sim"


def scenario(name: str, steps: int = 3, prompts: int = 64, **changes: Any) -> Scenario:
    raw = yaml.safe_load((SIM / f"{name}.yaml").read_text())
    raw["workload"].update(prompts=prompts, samples=8, steps=steps)
    raw.update({"jobs": 2, "rollout_samples": 2, "sweep_accelerators": [], **changes})
    sc = parse_sim(raw, "test")
    assert isinstance(sc, Scenario)
    return sc


def dep(**fields: Any) -> Deployment:
    return Deployment.model_validate({"name": "x", **fields})


def test_a_lora_job_trains_two_thirds_of_the_flops_and_moves_its_adapter_only() -> None:
    full, lora = scenario("qwen3_235b_a22b"), scenario("qwen3_235b_a22b_lora")
    assert lora.lora is not None and full.lora is None
    acc, model, eff, work, layout = lora.accelerator, lora.model, lora.efficiency, lora.workload, lora.train
    plain = layout.model_copy(update={"offload": False})
    # (4 + 2) / (6 + 2) of the FLOPs (no base-weight gradients); its optimizer is the adapter's: no offload
    ratio = train_seconds(acc, model, eff, work, layout, 10**7, lora.lora) / train_seconds(
        acc, model, eff, work, plain, 10**7
    )
    assert ratio == pytest.approx(6 / 8)
    assert train_seconds(acc, model, eff, work, layout, 10**7) > train_seconds(acc, model, eff, work, plain, 10**7)
    adapter = adapter_bytes(layout, lora.lora)
    assert adapter < 0.05 * train_state_bytes(model, plain)
    # the bf16 base shard and the adapter state, not weights + gradients + optimizer of the whole model
    assert train_state_bytes(model, layout, lora.lora) == int(2 * rank_params(model, layout)) + adapter
    assert job_state("plexrl-shared", model, layout, 8, lora=lora.lora) == adapter  # the base is shared
    alone = job_state("colocated", model, layout, 8, lora=lora.lora)  # a job alone holds its base
    assert alone >= train_state_bytes(model, layout, lora.lora) > 4 * adapter
    wire = sync_seconds(acc, model, eff, 96, 12, 8, lora.lora) - eff.sync_fixed_s  # the adapter only
    assert wire < 0.05 * (sync_seconds(acc, model, eff, 96, 12, 8) - eff.sync_fixed_s)
    one_base = host_bytes(model, layout, 8, 4, True, False, lora.lora, shared_base=True)
    assert one_base < host_bytes(model, layout, 8, 4, True, False, lora.lora) / 3
    colo = run_deployment(lora, dep(kind="colocated", rollout_tp=8))
    assert colo.step_seconds < run_deployment(full, dep(kind="colocated", rollout_tp=8)).step_seconds


def test_one_job_in_the_engine_model_matches_the_planner_colocated_run() -> None:
    sc = scenario("qwen3_30b_a3b", steps=4, prompts=128, jobs=1)
    engine = run_one(sc, dep(kind="plexrl-engine", jobs_per_pool=1, rollout_tp=8))
    colo = run_deployment(sc, dep(kind="colocated", rollout_tp=8))
    # the same rollout model and training; the engine keeps its weights and adds the weight hand-over
    assert engine.step_seconds == pytest.approx(colo.step_seconds, rel=0.03)
    assert engine.gpu_hours_per_step == pytest.approx(colo.gpu_hours_per_step, rel=0.03)
    assert engine.tail_overlap == 0.0 and engine.off_policy is False
    assert 0 < engine.decode_efficiency <= 1


def test_jobs_sharing_one_engine_fill_each_others_tails() -> None:
    sc = scenario("qwen3_30b_a3b_lora", steps=4, prompts=128, jobs=2)
    alone = run_one(sc, dep(kind="plexrl-engine", jobs_per_pool=1, rollout_tp=8))
    two = run_one(sc, dep(kind="plexrl-engine", jobs_per_pool=2, rollout_tp=8))
    assert two.services == 1 and alone.services == 2 and two.steps == alone.steps == 8
    assert 0.1 < two.tail_overlap <= 1  # the two jobs' sequences decoded together
    assert two.gpu_hours_per_step < 0.8 * alone.gpu_hours_per_step  # half the accelerators, not twice the time
    assert two.step_seconds > alone.step_seconds  # but each job waits for the other's training
    assert two.decode_efficiency > alone.decode_efficiency
    run = simulate_pool(sc, dep(kind="plexrl-engine", jobs_per_pool=2, rollout_tp=8), sc.accelerator, 2)
    assert run.busy <= run.makespan + 1e-6 and run.together <= run.rollout and len(run.jct) == 2


def test_full_models_that_do_not_fit_one_engine_are_refused_with_the_fix() -> None:
    sc = scenario("qwen3_235b_a22b")
    with pytest.raises(DoesNotFit, match=r"in one engine need 2 copies.*raise rollout_tp"):
        run_one(sc, dep(kind="plexrl-engine", jobs_per_pool=2, rollout_tp=8))
    raw = yaml.safe_load((SIM / "qwen3_30b_a3b.yaml").read_text())
    with pytest.raises(ConfigError, match="plexrl-engine takes no tail, resident"):
        parse_sim({**raw, "deployments": [{"name": "x", "kind": "plexrl-engine", "resident": True}], "baseline": "x"})
