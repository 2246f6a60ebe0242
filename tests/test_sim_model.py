"""The simulator's corrected cost model and its tuned baselines: the running KV context under continuous
batching, resident vs offloaded colocated state, host DRAM, CPU-Adam, weight sync per replica, one decoding
efficiency scale, and the baselines' layout search. Deterministic; no torch."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from plexrl.errors import ConfigError
from plexrl.sim.config import LengthDist, Scenario, parse_sim
from plexrl.sim.costs import (
    Decoder,
    DoesNotFit,
    check_host,
    host_bytes,
    mean_context,
    rollout_samples,
    switch_seconds,
    sync_seconds,
    train_seconds,
    train_state_bytes,
)
from plexrl.sim.deploy import run_deployment, tune_candidates, tune_deployment
from plexrl.sim.scenario import ScenarioResult

SIM = Path(__file__).resolve().parents[1] / "configs" / "sim"


def scenario(name: str = "qwen3_30b_a3b", steps: int = 3, prompts: int = 64, **changes: Any) -> Scenario:
    raw = yaml.safe_load((SIM / f"{name}.yaml").read_text())
    raw["workload"].update(prompts=prompts, samples=8, steps=steps)
    raw.update({"jobs": 2, "rollout_samples": 2, "sweep_accelerators": [], **changes})
    sc = parse_sim(raw, "test")
    assert isinstance(sc, Scenario)
    return sc


def test_running_context_is_length_biased_under_continuous_batching() -> None:
    sc = scenario()
    work = sc.workload.model_copy(
        update={
            "prompt_tokens": 100,
            "response": LengthDist(median=2000, sigma=0.0, max_tokens=20480, empirical=[1000, 3000]),
        }
    )
    # E[L^2] / 2E[L] = (1e6 + 9e6) / 2 / (2 * 2000) = 1,250 tokens, not the mean / 2 = 1,000
    assert mean_context(work, random.Random(0)) == pytest.approx(100 + 1250, rel=0.02)
    shipped = scenario().workload
    naive = shipped.prompt_tokens + 4100 / 2  # the old prompt + mean / 2 at the shipped profile
    assert mean_context(shipped, random.Random(0)) > 1.4 * naive


def test_resident_state_takes_kv_room_and_saves_switch_time() -> None:
    sc = scenario()
    acc, model, eff, layout = sc.accelerator, sc.model, sc.efficiency, sc.train
    state = train_state_bytes(model, layout)
    free, held = Decoder(acc, model, eff, 2, 4000), Decoder(acc, model, eff, 2, 4000, reserved=state)
    assert held.kv_room == pytest.approx(free.kv_room - 2 * state)
    assert held.slots < free.slots
    assert switch_seconds(acc, model, eff, layout, 2, resident=True) < switch_seconds(acc, model, eff, layout, 2)
    with pytest.raises(DoesNotFit, match="resident: false"):
        Decoder(acc, model, eff, 1, 4000, reserved=40e9)


def test_host_dram_cpu_adam_and_weight_sync_are_costed() -> None:
    sc = scenario("qwen3_235b_a22b")
    acc, model, eff, layout = sc.accelerator, sc.model, sc.efficiency, sc.train
    one = host_bytes(model, layout, 8, jobs=1, on_pool=False, resident=False)
    assert host_bytes(model, layout, 8, jobs=2, on_pool=False, resident=False) > 2 * one  # + the swapped state
    check_host(acc, host_bytes(model, layout, 8, 2, False, False), "two jobs")  # fits 256 GB per accelerator
    with pytest.raises(DoesNotFit, match="host DRAM"):
        check_host(acc, host_bytes(model, layout, 8, 12, False, False), "twelve jobs")
    slow = eff.model_copy(update={"cpu_adam_gparams_s": eff.cpu_adam_gparams_s / 4})
    assert train_seconds(acc, model, slow, sc.workload, layout, 10**6) > train_seconds(
        acc, model, eff, sc.workload, layout, 10**6
    )
    assert sync_seconds(acc, model, eff, 96, replicas=24, tp=4) > sync_seconds(acc, model, eff, 96, replicas=6, tp=8)


def test_decoding_efficiency_is_on_one_scale_for_every_layout() -> None:
    sc = scenario(prompts=256)
    acc, model, eff, work = sc.accelerator, sc.model, sc.efficiency, sc.workload
    roomy, dec = rollout_samples(acc, model, eff, work, 32, 2, 2, 0)
    starved, low = rollout_samples(acc, model, eff, work, 32, 2, 2, 0, reserved=25e9)  # a resident state
    assert low.slots < dec.slots
    for s in starved + roomy:
        assert 0 < s.efficiency <= 1
    # each layout's own full-batch rate would hide this: the starved replicas are measured on the same scale
    assert max(s.efficiency for s in starved) < min(s.efficiency for s in roomy)


def test_tuned_baselines_keep_the_cheapest_layout_of_the_grid() -> None:
    sc = scenario(tune={"rollout_accelerators": [32, 64, 128], "rollout_tp": [2, 4], "jobs": 1})
    dep = next(d for d in sc.deployments if d.kind == "split-async")
    assert dep.tune and len(tune_candidates(sc, dep)) == 6
    best = tune_deployment(sc, dep)
    assert len(best.candidates) == 6 and best.jobs == 2
    assert best.gpu_hours_per_step <= run_deployment(sc, dep).gpu_hours_per_step + 1e-9  # the shipped layout
    cheapest = min(best.candidates, key=lambda c: c[1])
    assert best.layout == cheapest[0]
    colo = next(d for d in sc.deployments if d.kind == "colocated")
    labels = {c[0] for c in tune_deployment(sc, colo).candidates}
    assert {"TP2 offloaded", "TP2 resident"} <= labels


def test_the_strongest_baseline_and_the_matched_step_headline() -> None:
    sc = scenario(tune={"rollout_accelerators": [64, 128], "rollout_tp": [2], "jobs": 1})
    res = ScenarioResult(sc, [tune_deployment(sc, d) if d.tune else run_deployment(sc, d) for d in sc.deployments])
    base = res.strongest()
    assert base.kind in ("colocated", "split-sync", "split-async")
    assert all(
        base.gpu_hours_per_step <= r.gpu_hours_per_step
        for r in res.results
        if r.kind in ("colocated", "split-sync", "split-async")
    )
    on = res.headline()
    if on is not None:
        assert not on.off_policy and on.step_seconds <= 1.1 * base.step_seconds
    off = [r for r in res.results if r.off_policy and r.kind == "plexrl"]
    assert off and all("offpolicy" in r.name for r in off)  # off-policy PlexRL layouts are named so


def test_the_report_headline_ignores_cheaper_rows_at_a_slower_step(tmp_path: Path) -> None:
    from plexrl.sim.report import format_scenario, headline, plot_scenario

    sc = scenario()

    def row(name: str, kind: str, gph: float, step: float, policy: str = "on-policy") -> dict[str, Any]:
        return {
            "deployment": name, "kind": kind, "layout": "R8 TP1", "policy": policy, "jobs": 2, "accelerators": 8,
            "gpu_hours_per_step": gph, "step_seconds": step, "step_vs_strongest": step / 100,
            "saving_vs_strongest": 1 - gph / 10, "bubble": 0.1, "effective_bubble": 0.2, "decode_efficiency": 0.5,
            "slowdown_mean": 1.0, "slowdown_max": 1.0, "candidates": [("R4 TP1", 12.0, 150.0)], "tail_overlap": 0.0,
        }  # fmt: skip

    rows = [
        row("colocated", "colocated", 10, 100),
        row("split-async", "split-async", 14, 60, "off-policy"),
        row("fast", "plexrl", 8, 109),
        row("cheap-but-slow", "plexrl", 5, 120),
        row("fast-offpolicy", "plexrl", 6, 105, "off-policy"),
    ]
    best = headline(sc, rows)
    assert best is not None and best["deployment"] == "fast"  # 20% at 1.09x, not 50% at 1.2x
    off = headline(sc, rows, "off-policy")
    assert off is not None and off["deployment"] == "fast-offpolicy"
    text = format_scenario(sc, rows, {})
    assert "strongest baseline (cheapest tuned): colocated" in text
    assert "headline (on-policy): fast saves +20.0%" in text and "NOT met" in text
    assert "cheapest PlexRL row at any step time: cheap-but-slow (on-policy) +50.0% at 1.20x" in text
    png = tmp_path / "frontier.png"
    plot_scenario(sc, rows, png)
    assert 1000 < png.stat().st_size < 200_000


def test_sensitivity_bands_rerun_the_headline_with_one_knob_moved() -> None:
    from plexrl.sim.sensitivity import KNOBS, format_bands, sensitivity

    sc = scenario(jobs=2, tune={"rollout_accelerators": [64], "rollout_tp": [2], "jobs": 1})
    assert KNOBS["sigma +0.2"](sc).workload.response.sigma == pytest.approx(sc.workload.response.sigma + 0.2)
    bands = sensitivity(sc, ["train_mfu x0.75"])
    assert [b.knob for b in bands] == ["shipped", "train_mfu x0.75"]
    assert bands[0].strongest.split()[0] in ("colocated", "split-sync", "split-async")
    assert bands[0].saving_any != bands[1].saving_any  # a slower trainer moves the comparison
    assert "train_mfu x0.75" in format_bands(sc, bands)
    with pytest.raises(ValueError, match="unknown sensitivity knobs"):
        sensitivity(sc, ["nope"])


def test_partial_rollouts_move_the_tail_off_the_pool() -> None:
    from plexrl.sim.deploy import run_deployment as run
    from plexrl.sim.tail import tail_samples

    sc = scenario(prompts=128)
    acc, model, eff, work = sc.accelerator, sc.model, sc.efficiency, sc.workload
    full, _ = rollout_samples(acc, model, eff, work, 128, 8, 2, 0)
    cut = tail_samples(acc, model, eff, work, 128, 8, 2, 0, 0.0, 0.1, 16)
    for f, c in zip(full, cut, strict=True):
        assert c.tokens == f.tokens  # the same draws
        assert c.bulk < 0.8 * f.seconds and c.tail > 0  # the last 10% of sequences hold the pool > 20% of the time
        assert c.efficiency > f.efficiency  # the pool's part runs at fuller batches
    with pytest.raises(ConfigError, match="tail is for kinds colocated and plexrl-shared"):
        parse_sim({**yaml.safe_load((SIM / "qwen3_30b_a3b.yaml").read_text()),
                   "deployments": [{"name": "x", "kind": "plexrl", "tail": 0.1}], "baseline": "x"})  # fmt: skip
    dep = next(d for d in sc.deployments if d.kind == "plexrl-shared")
    moved = run(sc, dep.model_copy(update={"tail": 0.1, "tail_accelerators": 16, "rollout_tp": 8}))
    assert moved.own_accelerators == 16 and moved.accelerators == moved.services * 128 + 2 * 16
    assert "tail 10%->16" in moved.layout


def test_elastic_pools_scale_the_training_pool_of_a_plexrl_layout() -> None:
    sc = scenario(jobs=3)
    dep = next(d for d in sc.deployments if d.name == "plexrl")
    one = run_deployment(sc, dep.model_copy(update={"jobs_per_pool": 3}))
    two = run_deployment(sc, dep.model_copy(update={"jobs_per_pool": 3, "pool_scale": 2}))
    assert two.service_accelerators == 2 * one.service_accelerators == 2 * sc.train.accelerators
    assert two.step_seconds < one.step_seconds  # training on twice the accelerators
    with pytest.raises(ConfigError, match="pool_scale is for the plexrl kinds"):
        parse_sim({**yaml.safe_load((SIM / "qwen3_30b_a3b.yaml").read_text()),
                   "deployments": [{"name": "x", "kind": "colocated", "pool_scale": 2}], "baseline": "x"})  # fmt: skip


def test_a_pool_of_jobs_can_share_one_set_of_tail_accelerators() -> None:
    from plexrl.sim.deploy import run_deployment as run

    sc = scenario(prompts=128, jobs=4)
    dep = next(d for d in sc.deployments if d.kind == "plexrl-shared")
    tail = dep.model_copy(update={"tail": 0.1, "tail_accelerators": 16, "rollout_tp": 8})
    own, pooled = run(sc, tail), run(sc, tail.model_copy(update={"tail_shared": True}))
    assert own.accelerators == 2 * 128 + 4 * 16 and pooled.accelerators == 2 * (128 + 16)
    assert pooled.step_seconds == own.step_seconds  # the same schedule: sharing is accounting, checked by overlap
    assert pooled.gpu_hours_per_step < own.gpu_hours_per_step
    assert 0.0 <= pooled.tail_overlap <= 1.0 and own.tail_overlap == 0.0
    assert pooled.layout.endswith("/pool")
    with pytest.raises(ConfigError, match="tail_shared needs tail"):
        bad = [{"name": "x", "kind": "plexrl-shared", "tail_shared": True}]
        parse_sim({**yaml.safe_load((SIM / "qwen3_30b_a3b.yaml").read_text()), "deployments": bad, "baseline": "x"})
