"""`plexrl simulate`: cost models, deployments on the real planner, trace replay, calibration against a recorded
run, the configs and the command. Deterministic; no torch, no Dask, nothing sleeps."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from plexrl.errors import ConfigError
from plexrl.hooks.timeline import TimelineRecorder
from plexrl.planner import ORDERINGS, JobSubmitted, NodePlan, Planner, ServiceJoined, placement_policy
from plexrl.runtime.runner import Budgets, Runner
from plexrl.runtime.sim import GB, SeededCosts, SimExecutor, SimJob
from plexrl.sim.calibrate import fit, predict
from plexrl.sim.config import LengthDist, Scenario, Trace, load_sim, parse_sim
from plexrl.sim.costs import Decoder, SampledCosts, draw_lengths, rollout_samples, train_seconds, train_state_bytes
from plexrl.sim.deploy import job_graph, run_deployment
from plexrl.sim.scenario import run_scenario
from plexrl.sim.trace import alone_seconds, arrivals, class_tables, run_policy, trace_jobs

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "configs" / "sim"


def small_scenario(name: str = "qwen3_30b_a3b", steps: int = 4, prompts: int = 64, **changes: Any) -> Scenario:
    raw = yaml.safe_load((SIM / f"{name}.yaml").read_text())
    raw["workload"].update(prompts=prompts, samples=8 if prompts < 512 else 16, steps=steps)
    raw.update({"jobs": 4, "rollout_samples": 4, "sweep_accelerators": [], **changes})
    sc = parse_sim(raw, "test")
    assert isinstance(sc, Scenario)
    return sc


def test_every_shipped_sim_config_validates_and_opens_with_its_command() -> None:
    paths = sorted(p for p in SIM.glob("*.yaml") if p.name != "profiles.yaml")
    assert len(paths) >= 4
    for path in paths:
        cfg = load_sim(path)
        assert isinstance(cfg, Scenario | Trace)
        assert path.read_text().startswith(f"# plexrl simulate configs/sim/{path.name}")


def test_bad_sim_configs_name_the_problem() -> None:
    raw = yaml.safe_load((SIM / "qwen25_7b.yaml").read_text())
    with pytest.raises(ConfigError, match="unknown profile 'b200'"):
        parse_sim({**raw, "accelerator": "b200"})
    with pytest.raises(ConfigError, match="baseline"):
        parse_sim({**raw, "baseline": "nope"})
    with pytest.raises(ConfigError, match="jobs_per_pool must be 1"):
        parse_sim({**raw, "deployments": [{"name": "x", "kind": "split-async", "jobs_per_pool": 2}], "baseline": "x"})
    with pytest.raises(ConfigError, match="typo_field: Extra inputs"):
        parse_sim({**raw, "typo_field": 1})


# -- cost models ----------------------------------------------------------------------------------------
def test_decode_step_grows_with_batch_and_moe_touches_more_experts_with_more_tokens() -> None:
    sc = small_scenario()
    dec = Decoder(sc.accelerator, sc.model, sc.efficiency, 2, context=4000)
    steps = [dec.step_seconds(n) for n in (1, 8, 64, 256)]
    assert steps == sorted(steps) and steps[0] < steps[-1]
    tokens_per_s = [n / dec.step_seconds(n) for n in (1, 8, 64, 256)]
    assert tokens_per_s == sorted(tokens_per_s)  # batching pays
    assert dec.slots <= sc.efficiency.max_num_seqs


def test_a_longer_tail_lowers_decoding_efficiency_and_fewer_replicas_raise_it() -> None:
    sc = small_scenario()
    acc, model, eff, work = sc.accelerator, sc.model, sc.efficiency, sc.workload

    def efficiency(w: Any, accelerators: int) -> float:
        samples, _ = rollout_samples(acc, model, eff, w, accelerators, 2, 4, seed=0)
        return sum(s.efficiency for s in samples) / len(samples)

    short = work.model_copy(update={"response": LengthDist(median=2000, sigma=0.1, max_tokens=20480, empirical=None)})
    long = work.model_copy(update={"response": LengthDist(median=2000, sigma=1.2, max_tokens=20480, empirical=None)})
    assert efficiency(long, 16) < efficiency(short, 16)
    assert efficiency(long, 4) > efficiency(long, 32)  # more sequences per replica: the tail is shared


def test_lengths_respect_the_cap_and_training_scales_with_tokens() -> None:
    sc = small_scenario()
    lengths = draw_lengths(LengthDist(median=1000, sigma=2.0, max_tokens=3000, empirical=None), 2000, random.Random(0))
    assert max(lengths) == 3000 and min(lengths) >= 1
    t1 = train_seconds(sc.accelerator, sc.model, sc.efficiency, sc.workload, sc.train, 1_000_000)
    t2 = train_seconds(sc.accelerator, sc.model, sc.efficiency, sc.workload, sc.train, 2_000_000)
    assert t2 == pytest.approx(2 * t1)
    zero1 = sc.train.model_copy(update={"zero": 1})
    assert train_state_bytes(sc.model, zero1) > train_state_bytes(sc.model, sc.train)  # ZeRO-2 shards gradients


# -- deployments on the real planner ------------------------------------------------------------------------
def test_split_sync_steps_are_the_sum_and_split_async_the_max_of_their_phases() -> None:
    sc = small_scenario("qwen25_7b", steps=8, prompts=512)  # the full batch: rollout and training both ~400 s
    by = {d.kind: d for d in sc.deployments}
    sync = run_deployment(sc, by["split-sync"])
    asyn = run_deployment(sc, by["split-async"])
    assert sync.steps == asyn.steps == 4 * 8
    assert asyn.step_seconds < sync.step_seconds  # rollout of step k+1 overlaps training of step k
    assert sync.allocated == pytest.approx(sum(sync.jct.values()) * (sync.own_accelerators + sync.service_accelerators))
    assert 0 < sync.bubble < 1 and sync.effective_bubble >= sync.bubble


def test_sharing_a_training_pool_saves_accelerators_and_the_gap_aware_order_keeps_jobs_in_antiphase() -> None:
    sc = small_scenario()
    base = next(d for d in sc.deployments if d.kind == "split-sync")
    shared = base.model_copy(update={"name": "pool", "kind": "plexrl", "jobs_per_pool": 2})
    alone, pooled = run_deployment(sc, base), run_deployment(sc, shared)
    assert pooled.services == alone.services // 2
    assert pooled.gpu_hours_per_step < alone.gpu_hours_per_step
    # training is short next to rollout, so two jobs interleave with little slowdown
    assert pooled.step_seconds < 1.1 * alone.step_seconds
    # 7B: training (~410 s) as long as rollout (~490 s). Gap-aware HRRS runs job A's 5 s sync (which frees A for
    # its rollout) before job B's training; textbook HRRS lets B's longer-waiting training go first, and the
    # two jobs then run in phase, each waiting for the other's training every step
    sc7 = small_scenario("qwen25_7b", steps=4, prompts=512, jobs=2)
    plexrl = next(d for d in sc7.deployments if d.name == "plexrl")
    gap = run_deployment(sc7, plexrl)
    classic = run_deployment(sc7, plexrl.model_copy(update={"ordering": "hrrs-classic"}))
    assert classic.step_seconds > 1.2 * gap.step_seconds


def test_gap_after_follows_cpu_successors_and_wraps_into_the_next_iteration() -> None:
    nodes, _, _ = job_graph("split-sync", "none", agentic=False)
    planner = Planner(clock=lambda: 0.0)
    planner.handle(ServiceJoined("s0"))
    from plexrl.planner import JobPlan

    planner.handle(JobSubmitted("j", JobPlan(nodes, 3, tuple(nodes))))
    for node, sec in {"rollout": 100.0, "verify": 5.0, "train": 20.0, "sync": 1.0}.items():
        planner.costs.observe("j", node, sec)
    assert planner.gap_after("j", "train") == 0.0  # sync (a service node) follows at once
    assert planner.gap_after("j", "sync") == pytest.approx(105.0)  # next iteration: rollout + verify off-service
    assert planner.gap_after("j", "rollout") == pytest.approx(5.0)


def test_scenario_comparison_runs_every_deployment_and_the_sweep() -> None:
    sc = small_scenario(sweep_accelerators=["a100"])
    from plexrl.sim.config import Accelerator, load_profiles

    accs = {k: Accelerator.model_validate(v) for k, v in load_profiles()["accelerators"].items()}
    res = run_scenario(sc, accs)
    assert [r.name for r in res.results] == [d.name for d in sc.deployments]
    base = res.strongest()  # slowdowns and savings are measured against the cheapest baseline
    assert res.saving(base, base) == 0.0 and all(s == 1.0 for s in res.slowdowns(base))
    slower = {r.name: r.step_seconds for r in res.sweep["a100"]}
    assert all(slower[r.name] > r.step_seconds for r in res.results)  # an A100 is slower than an H800


# -- trace replay ---------------------------------------------------------------------------------------
def small_trace(**changes: Any) -> Trace:
    raw = yaml.safe_load((SIM / "trace_3months.yaml").read_text())
    for c in raw["classes"]:
        c["steps_median"] = 30
        c["workload"].update(prompts=32, samples=4)
    raw.update({"jobs": 12, "days": 3, "rollout_samples": 4, "steps_per_node": 5, **changes})
    tr = parse_sim(raw, "test")
    assert isinstance(tr, Trace)
    return tr


def test_arrivals_are_seeded_sorted_and_within_the_span() -> None:
    tr = small_trace()
    a, b = arrivals(tr), arrivals(tr)
    assert a == b and len(a) == 12
    assert [x.at for x in a] == sorted(x.at for x in a) and all(0 <= x.at <= 3 * 86400 for x in a)
    assert arrivals(small_trace(seed=1)) != a


def test_trace_replay_sharing_queues_less_than_isolated_and_alone_is_exact(tmp_path: Path) -> None:
    # 12 jobs at once on 640 accelerators: user-sized isolated allocations (48-128 each) queue
    tr = small_trace(cluster_accelerators=640, rollout_fleet=512, service_accelerators=64, days=0.05, burst=0.0)
    iso = run_policy(tr, "isolated")
    shared = run_policy(tr, "spread+backfill")
    assert max(iso.queue.values()) > 0 and iso.makespan > shared.makespan
    assert min(shared.slowdown.values()) >= 1.0 - 1e-9  # nobody beats running alone
    assert 0 < shared.fleet_peak <= 512
    # the slowdown's denominator is exactly a lone run of the job on an empty pool
    jobs, _ = trace_jobs(tr, class_tables(tr))
    costs = SampledCosts(tr.seed, tr.accelerator.host_gbps * GB, tr.accelerator.disk_gbps * GB)
    for job in jobs[:3]:
        ex = SimExecutor(1, costs)
        (run,) = Runner(ex, Planner(clock=ex.clock), budgets=Budgets(device=80 * GB)).run([job])
        assert run.finished_at is not None and run.started_at is not None
        assert run.finished_at - run.started_at == pytest.approx(alone_seconds(job, costs), rel=1e-12)
    assert all(0.0 <= u <= 1.0 + 1e-9 for _, u in shared.utilisation)


# -- calibration against a recorded run -----------------------------------------------------------------
CHAIN = {
    "prompts": NodePlan("cpu"),
    "rollout": NodePlan("service", ("prompts",)),
    "verify": NodePlan("cpu", ("rollout",)),
    "train": NodePlan("service", ("verify", "rollout")),
}


def mix() -> list[SimJob]:
    return [
        SimJob(f"j{i}", CHAIN, 30, {"prompts": 0.005, "rollout": 0.25 + 0.05 * i, "verify": v, "train": 0.2},
               tuple(CHAIN), state_bytes=GB)
        for i, v in enumerate((0.01, 0.5, 0.8))
    ]  # fmt: skip


def reality(seed: int, services: int, placement: str, jobs: list[SimJob], hooks: list[Any] | None = None) -> list[Any]:
    """Stands in for a real run: jittered durations, 20/30 ms round trips, swaps at 10 GB/s, loads in 1 s."""
    costs = SeededCosts(seed, jitter=0.3, swap_bandwidth=10 * GB, load_bandwidth=GB)
    ex = SimExecutor(services, costs, dispatch=(0.02, 0.03))
    runner = Runner(
        ex,
        Planner(
            clock=ex.clock, placement=placement_policy(placement, 1.5), ordering=ORDERINGS["hrrs"](), lookahead=True
        ),
        hooks=hooks,
        budgets=Budgets(device=2 * GB),
    )
    return runner.run(jobs)


def test_calibration_fitted_on_one_run_predicts_another_within_15_percent(tmp_path: Path) -> None:
    timeline = TimelineRecorder(tmp_path, draw=False)
    reality(1, 1, "spread+backfill", mix(), [timeline])
    plans = {j.job_id: j.plan() for j in mix()}
    fitted = fit(timeline.spans, plans)
    assert fitted.dispatch_cpu == pytest.approx(0.02) and fitted.dispatch_service == pytest.approx(0.03)
    assert fitted.swap_bandwidth == pytest.approx(10 * GB) and fitted.state_bytes["j0"] == GB
    pred = predict(fitted, plans, services=1, placement="spread+backfill", ordering="hrrs",
                   budgets=Budgets(device=2 * GB), max_load=1.5)  # fmt: skip
    iso = {}
    for job in mix():  # the truth: another run (another seed) of the same jobs
        (run,) = reality(2, 1, "isolated", [job])
        iso[job.job_id] = run.finished_at - run.started_at
    runs = reality(2, 1, "spread+backfill", mix())
    first = min(r.started_at for r in runs)
    completion = {r.job_id: r.finished_at - first for r in runs}
    true_ratio = max(completion.values()) / sum(iso.values())
    assert pred.ratio == pytest.approx(true_ratio, rel=0.15)
    for job_id, sd in pred.slowdowns().items():
        assert sd == pytest.approx(completion[job_id] / iso[job_id], rel=0.15), job_id
    # without the fitted round trips the prediction is visibly worse: the fit is doing the work
    fitted = dataclasses.replace(fitted, cpu_gaps=[0.0], service_gaps=[0.0], dispatch_cpu=0.0, dispatch_service=0.0)
    bare = predict(fitted, plans, services=1, placement="spread+backfill", ordering="hrrs",
                   budgets=Budgets(device=2 * GB), max_load=1.5)  # fmt: skip
    assert abs(bare.iso_cost_per_step - sum(iso.values()) / 90) > abs(pred.iso_cost_per_step - sum(iso.values()) / 90)


def test_calibration_takes_its_swap_model_from_the_runs_move_records(tmp_path: Path) -> None:
    """With move records, the swap model is the records' (not the blocking spans'): moves into kept buffers give
    bandwidth and fixed cost, moves that made a buffer the first-touch rate that the simulated run's first moves
    pay; another job's records and empty moves do not enter it."""
    from plexrl.sim.calibrate import FittedCosts

    timeline = TimelineRecorder(tmp_path, draw=False)
    reality(1, 1, "spread+backfill", mix(), [timeline])
    plans = {j.job_id: j.plan() for j in mix()}

    def rec(job: str, nbytes: int, seconds: float, made: int = 0) -> dict[str, Any]:
        return {"job": job, "nbytes": nbytes, "copy": seconds * 0.8, "wait": seconds * 0.2, "made": made,
                "background": False}  # fmt: skip

    kept = [rec("j0", n, n / (8 * GB) + 0.004) for n in (GB // 4, GB, 2 * GB)]  # 8 GB/s and 4 ms a move
    moves = [*kept, rec("j1", GB, GB / (0.5 * GB), made=1), rec("other", GB, 100.0), rec("j2", 0, 1.0)]
    spans_only = fit(timeline.spans, plans)
    fitted = fit(timeline.spans, plans, moves)
    assert spans_only.swap_from == "swap spans" and spans_only.move_fixed_s == 0.0
    assert fitted.swap_bandwidth == pytest.approx(8 * GB) and fitted.move_fixed_s == pytest.approx(0.004)
    assert (fitted.fresh_moves, fitted.fresh_bandwidth) == (1, pytest.approx(0.5 * GB))
    assert fitted.swap_from.startswith("move records: 3 moves into kept buffers, 1 that made one")
    assert fitted.durations == spans_only.durations  # the rest of the fit is the spans'
    costs = FittedCosts(fitted)
    assert costs.swap_seconds(GB) == pytest.approx(2.004)  # the first move: a first touch
    assert costs.swap_seconds(GB) == pytest.approx(0.129)  # then kept buffers
    assert costs.swap_seconds(0) == 0.0


# -- runner: late arrivals ------------------------------------------------------------------------------
def test_jobs_arrive_when_told_and_a_job_cancelled_before_arriving_never_runs() -> None:
    jobs = mix()
    ex = SimExecutor(2, SeededCosts(0, jitter=0.0, swap_bandwidth=10 * GB, load_bandwidth=GB))
    runner = Runner(ex, Planner(clock=ex.clock, validate=True), budgets=Budgets(device=4 * GB))
    runner.cancel("j2", "changed my mind")
    runs = runner.run(jobs, arrivals={"j1": 5.0, "j2": 50.0})
    by = {r.job_id: r for r in runs}
    assert by["j0"].submitted_at == 0.0 and by["j1"].submitted_at == 5.0
    assert by["j1"].started_at is not None and by["j1"].started_at >= 5.0
    assert by["j2"].status == "cancelled" and by["j2"].started_at is None and "j2" not in ex.specs
    assert by["j0"].status == by["j1"].status == "done"
    with pytest.raises(ValueError, match="not in the run"):
        ex = SimExecutor(1, SeededCosts())
        Runner(ex, Planner(clock=ex.clock)).run(mix(), arrivals={"nope": 1.0})


# -- the command and the benchmark ----------------------------------------------------------------------
def test_plexrl_simulate_prints_the_comparison_and_logs_an_mlflow_run(tmp_path: Path) -> None:
    cfg = tmp_path / "small.yaml"
    raw = yaml.safe_load((SIM / "qwen3_30b_a3b.yaml").read_text())
    raw["workload"].update(prompts=64, samples=8, steps=3)
    raw.update(jobs=2, rollout_samples=2, sweep_accelerators=[])
    cfg.write_text(yaml.safe_dump(raw))
    out = subprocess.run(
        [sys.executable, "-m", "plexrl.cli", "simulate", str(cfg), "--run-dir", str(tmp_path / "runs"),
         "--no-progress"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "split-async" in out.stdout and "GPU-h/step" in out.stdout and "MLflow run:" in out.stdout
    report = tmp_path / "runs" / "simulate" / raw["name"]
    assert (report / "report.json").is_file() and (report / "frontier.png").stat().st_size > 1000
    assert "strongest baseline (cheapest tuned)" in out.stdout and "headline (on-policy)" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "plexrl.cli", "simulate", str(cfg), "--set", "accelerator=b200", "--no-mlflow"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "unknown profile 'b200'" in bad.stderr and "Traceback" not in bad.stderr


def load_benchmark(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Import benchmarks/NAME.py as a module (its dataclasses look their module up in sys.modules)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / f"benchmarks/{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_simulate_benchmark_smoke(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_benchmark("simulate", monkeypatch)
    module.main(["--smoke"])
    out = capsys.readouterr().out
    assert "events/s" in out and "spread+backfill" in out and not math.isnan(float(out.split("wall ")[-1].split()[0]))


def test_layout_search_smoke(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_benchmark("sim_layouts", monkeypatch)
    module.main([str(SIM / "qwen25_7b.yaml"), "--rollout", "8,16", "--pools", "1,2", "--smoke"])
    out = capsys.readouterr().out
    assert "8 PlexRL layouts vs the strongest baseline" in out and "off-policy, step <= 1.1x" in out
    assert "cheapest at any step time: R" in out


def test_sensitivity_benchmark_smoke(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_benchmark("sim_sensitivity", monkeypatch)
    module.main([str(SIM / "qwen3_30b_a3b.yaml"), "--smoke", "--jobs", "2"])
    out = capsys.readouterr().out
    assert "shipped" in out and "sigma +0.2" in out and "strongest baseline" in out


def test_calibrate_prints_the_scenario_swap_constants_a_runs_move_records_stand_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_benchmark("calibrate", monkeypatch)

    def rec(nbytes: int, seconds: float, made: int = 0, background: bool = False) -> dict[str, Any]:
        return {"job": "a", "nbytes": nbytes, "copy": seconds, "wait": 0.0, "made": made, "background": background}

    moves = [rec(n, n / 25e9 + 0.002, background=n > 10**9) for n in (10**8, 10**9, 4 * 10**9)]  # 25 GB/s, 2 ms
    path = tmp_path / "moves.json"
    path.write_text(json.dumps([*moves, rec(4 * 10**9, 2.0, made=1)]))
    module.main(["--moves", str(path)])
    out = capsys.readouterr().out
    assert "4 move records: 3 into kept buffers, 1 that made a buffer" in out
    assert "25.00 GB/s + 2.00 ms a move" in out and "2.00 GB/s (the first touch" in out
    assert "accelerator_set: {host_gbps: 25.0}; efficiency: {switch_fixed_s: 0.002}" in out
    path.write_text(json.dumps([rec(10**9, 1.0, made=1)]))
    module.main(["--moves", str(path)])
    assert "none into a kept buffer: nothing to fit" in capsys.readouterr().out
