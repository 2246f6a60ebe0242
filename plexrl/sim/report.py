"""`plexrl simulate CONFIG`: run a scenario (deployments compared) or a trace (placements compared), print
the tables, draw the pictures, write `report.json` / `report.txt`, and log it all as one MLflow run.

Output: `runs/simulate/<name>/` and the MLflow store `runs/mlflow.db` by default. Nothing here changes what is
simulated; it formats the results of `plexrl.sim.deploy` and `plexrl.sim.trace`.
"""

from __future__ import annotations

import json
import logging
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plexrl.sim.config import Scenario, Trace, load_profiles
from plexrl.sim.deploy import BASELINES, SLICING, DeploymentResult
from plexrl.sim.scenario import ScenarioResult, run_one
from plexrl.sim.trace import DAY, PolicyResult, class_tables, run_policy, trace_jobs

log = logging.getLogger(__name__)

# what the paper reports, for side-by-side columns (arXiv 2605.20863)
PAPER_SAVING = {"qwen2.5-7b": 0.3136, "qwen3-30b-a3b": 0.3010, "qwen3-235b-a22b": 0.3758}
PAPER_TRACE_RATIO = {"isolated": 1.0, "spread+backfill": 0.56}  # pack and spread: "about 65-70%"


@dataclass(slots=True)
class SimReport:
    kind: str
    name: str
    text: str
    data: dict[str, Any]
    out_dir: Path
    files: list[Path] = field(default_factory=list)
    tracking: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0


Progress = Callable[[str], None]


# -- scenario -------------------------------------------------------------------------------------------
GOAL_SAVING = 0.30  # the goal: >= 30% fewer GPU-hours per step than the strongest baseline at <= 1.1x its step


def scenario_rows(res: ScenarioResult, results: list[DeploymentResult]) -> list[dict[str, Any]]:
    base = res.strongest(results)
    rows = []
    for r in results:
        slow = res.slowdowns(r, results)
        rows.append({
            "deployment": r.name, "kind": r.kind, "layout": r.layout,
            "policy": "off-policy" if r.off_policy else "on-policy", "jobs": r.jobs, "accelerators": r.accelerators,
            "gpu_hours_per_step": r.gpu_hours_per_step, "step_seconds": r.step_seconds,
            "step_vs_strongest": r.step_seconds / base.step_seconds, "saving_vs_strongest": res.saving(r, base),
            "bubble": r.bubble, "effective_bubble": r.effective_bubble, "decode_efficiency": r.decode_efficiency,
            "slowdown_mean": statistics.fmean(slow), "slowdown_max": max(slow), "swap_seconds": r.swap_seconds,
            "makespan_s": r.makespan, "candidates": r.candidates, "tail_overlap": r.tail_overlap,
        })  # fmt: skip
    return rows


def headline(sc: Scenario, rows: list[dict[str, Any]], policy: str = "on-policy") -> dict[str, Any] | None:
    """The cheapest PlexRL row of `policy` whose step is at most `matched_step` x the strongest baseline's."""
    ok = [
        r for r in rows
        if r["kind"].startswith("plexrl") and r["policy"] == policy and r["step_vs_strongest"] <= sc.matched_step
    ]  # fmt: skip
    return max(ok, key=lambda r: r["saving_vs_strongest"], default=None)


def strongest_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return min((r for r in rows if r["kind"] in BASELINES), key=lambda r: r["gpu_hours_per_step"])


def against_slicing(sc: Scenario, rows: list[dict[str, Any]]) -> str | None:
    """Where PlexRL stands against exclusive time-slicing (the llm-d / OpenRL design, the cheapest `time-slicing`
    row): the cheapest on-policy PlexRL row whose step is at most `matched_step` x time-slicing's; None without
    a time-slicing row."""
    ts = min((r for r in rows if r["kind"] == SLICING), key=lambda r: r["gpu_hours_per_step"], default=None)
    if ts is None:
        return None
    head = (f"against time-slicing (the llm-d / OpenRL design; {ts['deployment']} {ts['layout']}: "
            f"{ts['gpu_hours_per_step']:.2f} GPU-h/step, {ts['step_seconds']:.0f} s/step, worst slowdown "
            f"{ts['slowdown_max']:.2f} vs the strongest baseline): ")  # fmt: skip
    limit = sc.matched_step * ts["step_seconds"]
    ok = [
        r for r in rows if r["kind"].startswith("plexrl") and r["policy"] == "on-policy" and r["step_seconds"] <= limit
    ]
    if not ok:
        return head + f"no on-policy PlexRL row within {sc.matched_step:g}x its step time"
    best = min(ok, key=lambda r: r["gpu_hours_per_step"])
    saving = 1 - best["gpu_hours_per_step"] / ts["gpu_hours_per_step"]
    return head + (f"{best['deployment']} saves {saving:+.1%} of GPU-hours per step at "
                   f"{best['step_seconds'] / ts['step_seconds']:.2f}x its step time (worst slowdown "
                   f"{best['slowdown_max']:.2f})")  # fmt: skip


def format_scenario(sc: Scenario, rows: list[dict[str, Any]], sweep: dict[str, list[dict[str, Any]]]) -> str:
    base = strongest_row(rows)
    lines = [
        f"scenario {sc.name}: {sc.model.name}"
        + (f" LoRA r={sc.lora.rank} jobs" if sc.lora else "")
        + f" on {sc.accelerator.name}, {rows[0]['jobs']} jobs x "
        f"{sc.workload.steps} steps; strongest baseline (cheapest tuned): {base['deployment']} {base['layout']}",
        f"{'deployment':<28}{'layout':<34}{'policy':<11}{'accel':>6}{'GPU-h/step':>11}{'step s':>8}{'x step':>7}"
        f"{'saving':>8}{'bubble':>8}{'eff.bubble':>11}{'decode eff':>11}{'slowdown':>13}",
    ]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        lines.append(
            f"{r['deployment']:<28}{r['layout']:<34}{r['policy']:<11}{r['accelerators']:>6}"
            f"{r['gpu_hours_per_step']:>11.2f}{r['step_seconds']:>8.0f}{r['step_vs_strongest']:>7.2f}"
            f"{r['saving_vs_strongest']:>+8.1%}{r['bubble']:>8.1%}{r['effective_bubble']:>11.1%}"
            f"{r['decode_efficiency']:>11.1%}{r['slowdown_mean']:>7.2f}/{r['slowdown_max']:<5.2f}"
        )
    paper = PAPER_SAVING.get(sc.name)
    for policy in ("on-policy", "off-policy"):
        best = headline(sc, rows, policy)
        if best is None:
            lines.append(f"headline ({policy}): no PlexRL row within {sc.matched_step:g}x the strongest step time")
            continue
        ok = "met" if best["saving_vs_strongest"] >= GOAL_SAVING else "NOT met"
        lines.append(
            f"headline ({policy}): {best['deployment']} saves {best['saving_vs_strongest']:+.1%} of GPU-hours per step "
            f"vs {base['deployment']} at {best['step_vs_strongest']:.2f}x its step time"
            + (f" (paper: {paper:.2%} vs split-async)" if paper is not None and policy == "on-policy" else "")
            + f"; goal >= {GOAL_SAVING:.0%} at <= {sc.matched_step:g}x: {ok}"
        )
    versus = against_slicing(sc, rows)
    if versus is not None:
        lines.append(versus)
    plex = [r for r in rows if r["kind"].startswith("plexrl")]
    if plex:
        cheap = max(plex, key=lambda r: r["saving_vs_strongest"])
        lines.append(
            f"cheapest PlexRL row at any step time: {cheap['deployment']} ({cheap['policy']}) "
            f"{cheap['saving_vs_strongest']:+.1%} at {cheap['step_vs_strongest']:.2f}x the step time"
        )
    for r in rows:
        if r["layout"].endswith("/pool"):
            lines.append(f"{r['deployment']}: its pool's tails overlapped {r['tail_overlap']:.0%} of the tail time "
                         "(shared tail accelerators; the overlap is not slowed down in this model)")  # fmt: skip
        if r["kind"] == "plexrl-engine":
            lines.append(f"{r['deployment']}: two or more jobs' rollouts were in flight together "
                         f"{r['tail_overlap']:.0%} of the decode time (one engine per pool; an engine-level model, "
                         "not the planner)")  # fmt: skip
    for acc, srows in sweep.items():
        b, best = strongest_row(srows), headline(sc, srows)
        got = (
            "none within the step limit" if best is None else f"{best['deployment']} {best['saving_vs_strongest']:+.1%}"
        )
        lines.append(f"on {acc}: strongest baseline {b['deployment']} {b['layout']}; on-policy headline {got}")
    lines.append(
        "saving and x step: vs the strongest baseline; slowdown = completion time / the same job's under it "
        "(mean/max); bubble = no node running; eff.bubble also counts decode capacity the long tail leaves unused"
    )
    return "\n".join(lines)


def plot_scenario(sc: Scenario, rows: list[dict[str, Any]], path: Path, dpi: int = 110) -> None:
    """The cost-vs-step-time frontier: every row and every tuned layout the baselines' search tried, the
    strongest baseline's step-time limit, and the frontier (no point both cheaper and faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = strongest_row(rows)
    fig, ax = plt.subplots(figsize=(8, 5))
    pts = []
    for r in rows:
        for _label, gph, step in r["candidates"]:
            ax.scatter(step, gph, s=14, color="lightgray", zorder=1)
            pts.append((step, gph))
    style = {"on-policy": ("tab:orange", "o"), "off-policy": ("tab:purple", "s")}
    for r in rows:
        plex = r["kind"].startswith("plexrl")
        color, marker = style[r["policy"]] if plex else ("tab:gray", "^")
        ax.scatter(r["step_seconds"], r["gpu_hours_per_step"], s=46, color=color, marker=marker, zorder=3)
        ax.annotate(r["deployment"], (r["step_seconds"], r["gpu_hours_per_step"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")  # fmt: skip
        pts.append((r["step_seconds"], r["gpu_hours_per_step"]))
    front, low = [], float("inf")
    for step, gph in sorted(pts):
        if gph < low:
            front.append((step, gph))
            low = gph
    ax.step([x for x, _ in front], [y for _, y in front], where="post", color="tab:blue", lw=1, label="frontier")
    ax.axvline(sc.matched_step * base["step_seconds"], color="tab:red", ls="--", lw=1,
               label=f"{sc.matched_step:g}x the strongest baseline's step")  # fmt: skip
    ax.axhline((1 - GOAL_SAVING) * base["gpu_hours_per_step"], color="tab:green", ls=":", lw=1,
               label=f"goal: {GOAL_SAVING:.0%} below it")  # fmt: skip
    ax.set_xlabel("step time, s (mean per job)")
    ax.set_ylabel("GPU-hours per training step")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(f"{sc.name}: {sc.model.name} on {sc.accelerator.name} (simulated; gray: tuned baseline layouts)",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def run_scenario_report(sc: Scenario, out_dir: Path, progress: Progress) -> SimReport:
    from plexrl.sim.config import Accelerator

    tables: dict[Any, Any] = {}
    results = []
    for d in sc.deployments:
        progress(f"{sc.name}: {d.name}" + (" (tuning)" if d.tune else ""))
        results.append(run_one(sc, d, tables=tables))
    res = ScenarioResult(sc, results)
    rows = scenario_rows(res, results)
    profiles = load_profiles()["accelerators"]
    sweep: dict[str, list[dict[str, Any]]] = {}
    for name in sc.sweep_accelerators:
        if name not in profiles:
            raise ValueError(f"sweep_accelerators: unknown profile {name!r}; known: {sorted(profiles)}")
        acc = Accelerator.model_validate(profiles[name])
        tables = {}
        sres = []
        for d in sc.deployments:
            progress(f"{sc.name} on {name}: {d.name}")
            sres.append(run_one(sc, d, acc, tables))
        res.sweep[name] = sres
        sweep[name] = scenario_rows(res, sres)
    text = format_scenario(sc, rows, sweep)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "frontier.png"
    plot_scenario(sc, rows, png)
    data = {"scenario": sc.model_dump(), "rows": rows, "sweep": sweep}
    return SimReport("scenario", sc.name, text, data, out_dir, [png])


# -- trace ----------------------------------------------------------------------------------------------
def trace_rows(results: list[PolicyResult]) -> list[dict[str, Any]]:
    iso = next((r for r in results if r.placement == "isolated"), None)
    rows = []
    for r in results:
        q = sorted(r.queue.values())
        s = sorted(r.slowdown.values())
        rows.append({
            "placement": r.placement, "makespan_days": r.makespan / DAY,
            "makespan_vs_isolated": r.makespan / iso.makespan if iso else None,
            "queue_mean_hours": statistics.fmean(q) / 3600, "queue_p95_hours": q[int(0.95 * (len(q) - 1))] / 3600,
            "slowdown_mean": statistics.fmean(s), "slowdown_p95": s[int(0.95 * (len(s) - 1))],
            "slowdown_max": s[-1], "utilisation": r.busy / r.allocated, "fleet_peak": r.fleet_peak,
            "events": r.events, "wall_s": r.wall_s,
        })  # fmt: skip
    return rows


def format_trace(tr: Trace, rows: list[dict[str, Any]], jobs: int, steps: int) -> str:
    lines = [
        f"trace {tr.name}: {jobs} jobs ({steps:,} steps) over {tr.days:g} days on {tr.services} pools of "
        f"{tr.service_accelerators} {tr.accelerator.name} + a rollout fleet of {tr.rollout_fleet} = "
        f"{tr.cluster_accelerators} ({tr.deployment}; {tr.steps_per_node} step(s) per node; isolated: user-sized "
        "allocations on the whole cluster)",
        f"{'placement':<18}{'makespan d':>11}{'vs isolated':>12}{'paper':>7}{'queue h mean/p95':>18}"
        f"{'slowdown mean/p95/max':>23}{'util':>7}{'fleet peak':>11}{'events':>9}{'wall s':>8}",
    ]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        paper = PAPER_TRACE_RATIO.get(r["placement"])
        ratio = "" if r["makespan_vs_isolated"] is None else f"{r['makespan_vs_isolated']:.1%}"
        lines.append(
            f"{r['placement']:<18}{r['makespan_days']:>11.1f}{ratio:>12}{'' if paper is None else f'{paper:.0%}':>7}"
            f"{r['queue_mean_hours']:>9.1f}/{r['queue_p95_hours']:<8.1f}"
            f"{r['slowdown_mean']:>9.2f}/{r['slowdown_p95']:.2f}/{r['slowdown_max']:<6.2f}"
            f"{r['utilisation']:>7.1%}{r['fleet_peak']:>11}{r['events']:>9}{r['wall_s']:>8.1f}"
        )
    sb = next((r for r in rows if r["placement"] == "spread+backfill"), None)
    if sb is not None and sb["makespan_vs_isolated"] is not None:
        ok = "met" if sb["makespan_vs_isolated"] <= 0.5 else "NOT met"
        lines.append(f"spread+backfill makespan {sb['makespan_vs_isolated']:.1%} of isolated (goal <= 50%: {ok})")
    lines.append("slowdown = (completion - arrival) / the job's time alone on its allocation; queue = arrival to "
                 "placement; util = busy accelerator-time (training and rollout) / (cluster x makespan)")  # fmt: skip
    return "\n".join(lines)


def plot_trace(tr: Trace, results: list[PolicyResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for r in results:
        a.plot([t for t, _ in r.utilisation], [u for _, u in r.utilisation], label=r.placement, lw=1.2)
    a.set_xlabel("day")
    a.set_ylabel("busy share of the pools")
    a.legend(fontsize=8)
    b.bar([r.placement for r in results], [r.makespan / DAY for r in results], color="tab:blue")
    b.set_ylabel("makespan, days")
    b.tick_params(axis="x", rotation=20)
    fig.suptitle(f"{tr.name}: {tr.jobs} jobs on {tr.services} x {tr.service_accelerators} {tr.accelerator.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_trace_report(tr: Trace, out_dir: Path, progress: Progress) -> SimReport:
    progress(f"{tr.name}: rollout tables")
    shared = trace_jobs(tr, class_tables(tr))
    iso = trace_jobs(tr, class_tables(tr, isolated=True), isolated=True) if "isolated" in tr.placements else None
    results = []
    for p in tr.placements:
        progress(f"{tr.name}: {p}")
        results.append(run_policy(tr, p, shared, iso))
    rows = trace_rows(results)
    jobs = shared[0]
    steps = sum(j.iterations for j in jobs) * tr.steps_per_node
    text = format_trace(tr, rows, len(jobs), steps)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "trace.png"
    plot_trace(tr, results, png)
    data = {
        "trace": tr.model_dump(), "rows": rows,
        "slowdown": {r.placement: r.slowdown for r in results}, "queue_s": {r.placement: r.queue for r in results},
        "utilisation": {r.placement: r.utilisation for r in results},
    }  # fmt: skip
    return SimReport("trace", tr.name, text, data, out_dir, [png])


# -- entry point ----------------------------------------------------------------------------------------
def simulate(cfg: Scenario | Trace, run_dir: Path, progress: Progress | None = None, track: bool = True) -> SimReport:
    """Run `cfg`, write report.txt / report.json and the picture under `run_dir/simulate/<name>/`, and log an
    MLflow run to `run_dir`'s store (the same `runs/mlflow.db` as the training jobs by default)."""
    t0 = time.perf_counter()
    out_dir = run_dir / "simulate" / cfg.name
    say = progress or (lambda msg: None)
    rep = run_trace_report(cfg, out_dir, say) if isinstance(cfg, Trace) else run_scenario_report(cfg, out_dir, say)
    rep.wall_s = time.perf_counter() - t0
    (out_dir / "report.txt").write_text(rep.text + "\n")
    (out_dir / "report.json").write_text(json.dumps(rep.data, indent=1, default=str))
    rep.files += [out_dir / "report.txt", out_dir / "report.json"]
    if track:
        rep.tracking = log_mlflow(rep, run_dir)
    return rep


def log_mlflow(rep: SimReport, run_dir: Path) -> dict[str, str]:
    """One MLflow run (experiment `plexrl-simulate`): the config as params, headline figures as metrics (one
    step per row), the report and picture as artifacts."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from plexrl.hooks.mlflow_hook import tracking_uri
    from plexrl.job.config import flatten

    uri = tracking_uri(run_dir)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("plexrl-simulate")
    if exp is None:
        exp_id = client.create_experiment(
            "plexrl-simulate", artifact_location=(run_dir / "mlartifacts").resolve().as_uri()
        )
    else:
        exp_id = exp.experiment_id
    run = client.create_run(exp_id, run_name=rep.name, tags={"plexrl.kind": f"simulate-{rep.kind}"})
    rid = run.info.run_id
    cfg = rep.data.get("scenario") or rep.data.get("trace") or {}
    params = flatten(cfg)
    client.log_batch(rid, params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())][:100])
    now = int(time.time() * 1000)
    metrics = []
    key = "deployment" if rep.kind == "scenario" else "placement"
    for row in rep.data["rows"]:
        for k, v in row.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                name = re.sub(r"[^A-Za-z0-9_\-. :/]", "_", f"{row[key]}/{k}")  # MLflow's name alphabet
                metrics.append(Metric(name, float(v), now, 0))
    metrics.append(Metric("wall_seconds", rep.wall_s, now, 0))
    for i in range(0, len(metrics), 900):
        client.log_batch(rid, metrics=metrics[i : i + 900])
    for path in rep.files:
        if path.is_file():
            client.log_artifact(rid, str(path))
    client.set_terminated(rid, status="FINISHED")
    return {"uri": uri, "run_id": rid}
