"""Many jobs on shared services: the cluster config, its validation, and the run that ends with the
accounting table and a cluster-level MLflow run.

A cluster YAML names the services (count, per-tier memory budgets, device), the policies, and the jobs
(each a job YAML path relative to the cluster file, with optional `--set`-style overrides, or an inline
job). `load_cluster` validates everything at once, including whether each job's state fits a service's
device budget, and raises one `ConfigError` listing every problem.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ByteSize, Field, ValidationError, model_validator

from plexrl.config import JobConfig, LoadedJob, StrictModel, _problem, load_job
from plexrl.errors import ConfigError, Problem
from plexrl.job import state_copies, state_parts

log = logging.getLogger(__name__)


class ServicesConfig(StrictModel):
    """The shared LLM services: one per accelerator (here: per Dask worker with a GPU resource)."""

    count: int = Field(1, ge=1, le=4096, description="Number of services (accelerators).")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the device tier lives.")
    device_memory: ByteSize | None = Field(None, description="Device-tier budget per service, e.g. '24MB'.")
    host_memory: ByteSize | None = Field(None, description="Host-tier budget per service (None: unlimited).")
    disk: ByteSize | None = Field(None, description="Disk-tier budget per service (None: unlimited).")
    threads: int | None = Field(None, ge=1, description="torch threads per service worker (default: torch's).")


class ClusterJob(StrictModel):
    """One job of the mix: a job YAML (path relative to the cluster file) with overrides, or inline."""

    config: str | None = Field(None, description="Job YAML path, relative to the cluster file.")
    set: dict[str, Any] = Field(default_factory=dict, description="Overrides, e.g. {seed: 1, iterations: 50}.")
    job: dict[str, Any] | None = Field(None, description="An inline job config instead of a file.")

    @model_validator(mode="after")
    def _one_source(self) -> ClusterJob:
        if (self.config is None) == (self.job is None):
            raise ValueError("give exactly one of `config` (a job YAML path) or `job` (an inline job config)")
        return self


class ClusterConfig(StrictModel):
    """Services, policies and the jobs that share them."""

    name: str = Field("cluster", description="Name of the cluster-level MLflow run.")
    run_dir: str = Field("runs", description="Directory for the cluster's timeline, report and MLflow store.")
    driver: Literal["dask", "local"] = Field("dask", description="dask: a Dask cluster; local: in-process.")
    scheduler: str | None = Field(None, description="Address of an existing Dask scheduler (default: start one).")
    cpu_threads: int = Field(2, ge=1, description="Threads of the local CPU-pool worker.")
    services: ServicesConfig = Field(default_factory=ServicesConfig)  # type: ignore[arg-type]
    placement: Literal["isolated", "pack", "spread", "spread+backfill"] = Field(
        "spread+backfill", description="Placement policy."
    )
    max_load: float = Field(1.0, gt=0, le=64, description="spread+backfill: admit while predicted load <= this.")
    ordering: Literal["fifo", "hrrs"] = Field("hrrs", description="Ordering of ready service nodes.")
    lookahead: bool = Field(
        True, description="dask: send a service its next node while one runs (saves a round trip per node)."
    )
    validate_state: bool = Field(False, description="Planner invariants after every event and state checksums.")
    mlflow: bool = Field(True, description="Log a cluster-level MLflow run (jobs log their own runs).")
    experiment: str = Field("plexrl", description="MLflow experiment of the cluster run.")
    progress: bool = Field(True, description="Progress bars on a terminal.")
    jobs: list[ClusterJob] = Field(description="The jobs that share the services.", min_length=1)


@dataclass(slots=True)
class LoadedCluster:
    config: ClusterConfig
    jobs: list[LoadedJob]
    source: str
    raw: dict[str, Any] = field(default_factory=dict)


def estimate_state_bytes(cfg: JobConfig, loaded: LoadedJob) -> int:
    """Bytes of a job's state before its model exists: fp32 parameters of the configured Llama times the
    copies its pipeline keeps (see `JobHandle.state_bytes`)."""
    return estimate_weight_bytes(cfg) * state_copies(loaded.graph)


def estimate_engine_bytes(cfg: JobConfig) -> int:
    """Device bytes of the vLLM engine the job's rollouts will use (one weight copy + KV cache; shared by the
    same-architecture jobs of a service), 0 when they run on the torch engine."""
    from plexrl.config import vllm_problem

    if cfg.engine == "torch" or (cfg.engine == "auto" and vllm_problem(cfg.model)):
        return 0
    return estimate_weight_bytes(cfg) + cfg.vllm.kv_cache_mb * 2**20


def estimate_weight_bytes(cfg: JobConfig) -> int:
    """fp32 bytes of the job's model weights (the saved files for `model.path`)."""
    from plexrl.tasks.arithmetic import ALPHABET

    m = cfg.model
    if m.path is not None:
        weights = sum(f.stat().st_size for f in Path(m.path).glob("*.safetensors"))
    else:
        vocab = len(ALPHABET) + 3
        per_layer = 4 * m.hidden * m.hidden + 3 * m.hidden * m.intermediate + 2 * m.hidden
        params = vocab * m.hidden * (1 if m.tie_embeddings else 2) + m.layers * per_layer + m.hidden
        weights = params * 4
    return weights


def load_cluster(source: str | Path, overrides: list[str] | None = None) -> LoadedCluster:
    """Read and validate a cluster YAML and every job in it; one `ConfigError` lists all problems."""
    from plexrl.config import apply_overrides

    path = Path(source)
    if not path.is_file():
        raise ConfigError([Problem(str(path), "file not found; check the path (configs/ has examples)")], str(path))
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([Problem(str(path), f"not valid YAML: {exc}")], str(path)) from None
    if not isinstance(raw, dict):
        raise ConfigError([Problem(str(path), "a cluster config must be a YAML mapping")], str(path))
    problems = apply_overrides(raw, overrides or [])
    try:
        cfg = ClusterConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(problems + [_problem(e, "", ClusterConfig) for e in exc.errors()], str(path)) from None
    jobs: list[LoadedJob] = []
    for i, entry in enumerate(cfg.jobs):
        where = f"jobs[{i}]"
        sets = [f"{k}={json.dumps(v)}" for k, v in entry.set.items()]
        try:
            if entry.config is not None:
                job_path = (path.parent / entry.config).resolve()
                if not job_path.is_file():
                    job_path = Path(entry.config).resolve()
                loaded = load_job(job_path, sets)
            else:
                loaded = load_job(entry.job, sets)
        except ConfigError as exc:
            problems += [Problem(f"{where}.{p.where}" if p.where else where, p.message) for p in exc.problems]
            continue
        jobs.append(loaded)
    names = [j.config.name for j in jobs]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(Problem("jobs", f"two jobs are named {name!r}; give each a unique `name` (set: {{name: ...}})"))
    budget = cfg.services.device_memory
    if budget is not None:
        for i, job in enumerate(jobs):
            need, engine = estimate_state_bytes(job.config, job), estimate_engine_bytes(job.config)
            holds = ", ".join(state_parts(job.graph))
            if need + engine > budget:
                with_engine = f" plus {engine / 2**20:.1f} MiB for its vLLM engine" if engine else ""
                fix = "; or lower vllm.kv_cache_mb, or set engine: torch" if engine else ""
                problems.append(
                    Problem(
                        f"jobs[{i}]",
                        f"job {job.config.name!r} needs about {need / 2**20:.1f} MiB of state "
                        f"({holds}){with_engine} but services.device_memory is {budget / 2**20:.1f} MiB; "
                        f"raise services.device_memory or use a smaller model{fix}",
                    )
                )
    if problems:
        raise ConfigError(problems, str(path))
    return LoadedCluster(cfg, jobs, str(path), raw)


def is_cluster_file(path: Path | None) -> bool:
    """A YAML with a top-level `jobs` list is a cluster config; anything else is a job."""
    if path is None or not path.is_file():
        return False
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return False
    return isinstance(raw, dict) and "jobs" in raw


# -- running ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class ClusterResult:
    jobs: list[Any]
    report: Any
    service_reports: dict[str, dict[str, Any]]
    timeline: Path | None
    tracking: dict[str, str] = field(default_factory=dict)


def make_driver(cfg: ClusterConfig, hooks: list[Any]) -> Any:
    from plexrl.drivers.base import Budgets
    from plexrl.planner.policies import ORDERINGS, PLACEMENTS, SpreadBackfill

    s = cfg.services
    budgets = Budgets(
        int(s.device_memory) if s.device_memory is not None else None,
        int(s.host_memory) if s.host_memory is not None else None,
        int(s.disk) if s.disk is not None else None,
    )
    placement = SpreadBackfill(cfg.max_load) if cfg.placement == "spread+backfill" else PLACEMENTS[cfg.placement]()
    ordering = ORDERINGS[cfg.ordering]()
    if cfg.driver == "local":
        from plexrl.drivers.local import LocalDriver

        return LocalDriver(
            services=s.count, hooks=hooks, placement=placement, ordering=ordering, device=s.device,
            validate=cfg.validate_state, budgets=budgets, clock=time.time,
        )  # fmt: skip
    from plexrl.drivers.dask import DaskDriver

    return DaskDriver(
        services=s.count, cpu_threads=cfg.cpu_threads, service_threads=s.threads, scheduler=cfg.scheduler,
        hooks=hooks, placement=placement, ordering=ordering, device=s.device, validate=cfg.validate_state,
        budgets=budgets, lookahead=cfg.lookahead,
    )  # fmt: skip


def run_cluster(loaded: LoadedCluster, *, progress: bool = False, driver_hook: Any = None) -> ClusterResult:
    """Prepare every job (warm starts cached), run them on the shared services, account, track."""
    from plexrl.accounting import JobFacts, account, format_report
    from plexrl.hooks.base import Hook
    from plexrl.hooks.timeline import TimelineRecorder, draw_cluster_timeline
    from plexrl.job import prepare_job

    cfg = loaded.config
    run_dir = Path(cfg.run_dir).resolve()
    handles = [prepare_job(job) for job in loaded.jobs]
    timeline = TimelineRecorder(run_dir / "timelines")
    hooks: list[Hook] = [timeline]
    if progress:
        from plexrl.hooks.progress import ProgressBar

        hooks.append(ProgressBar())
    if any(job.config.tracking.mlflow for job in loaded.jobs):
        from plexrl.hooks.mlflow_hook import MlflowHook

        hooks.append(MlflowHook())
    driver = make_driver(cfg, hooks)
    if driver_hook is not None:
        driver_hook(driver)
    interrupted: BaseException | None = None
    try:
        driver.run(handles)
    except KeyboardInterrupt as exc:
        interrupted = exc
    end = driver.clock()
    t0 = timeline.t0 if timeline.t0 is not None else end  # set when the services were up
    wall = end - t0
    start = time.time()
    facts = [
        JobFacts(
            j.job_id,
            driver.placed.get(j.job_id),
            j.iterations_done,
            (j.started_at - t0) if j.started_at is not None else 0.0,
            ((j.finished_at or driver.clock()) - t0),
            j.status,
        )
        for j in handles
    ]
    services = sorted(driver.services) if hasattr(driver, "services") else sorted(driver.worker_of)
    report = account(timeline.spans, facts, services, wall)
    service_reports = dict(getattr(driver, "service_reports", {}))
    if not service_reports and hasattr(driver, "services"):
        service_reports = {sid: svc.report() for sid, svc in driver.services.items()}
    out_dir = run_dir / "clusters" / f"{cfg.name}-{int(start)}"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(
        json.dumps(
            {"report": report.as_dict(), "services": service_reports, "config": loaded.raw}, indent=1, default=str
        )
    )
    (out_dir / "report.txt").write_text(format_report(report) + "\n")
    (out_dir / "timeline.json").write_text(json.dumps([asdict(sp) for sp in timeline.spans]))
    png: Path | None = None
    try:
        png = out_dir / "timeline.png"
        draw_cluster_timeline(timeline.spans, png, f"{cfg.name}: {cfg.placement} / {cfg.ordering}")
    except Exception:
        log.exception("could not draw the cluster timeline")
        png = None
    result = ClusterResult(handles, report, service_reports, png)
    if cfg.mlflow:
        try:
            result.tracking = log_cluster_run(cfg, result, out_dir)
        except Exception:
            log.exception("could not log the cluster run to MLflow")
    if interrupted is not None:
        raise interrupted
    return result


def log_cluster_run(cfg: ClusterConfig, result: ClusterResult, out_dir: Path) -> dict[str, str]:
    """One MLflow run for the cluster: policies and budgets as params, per-service and per-job accounting
    as metrics, the table, report and timeline as artifacts; each job's run is linked both ways by tags."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from plexrl.config import flatten
    from plexrl.hooks.mlflow_hook import tracking_uri

    uri = tracking_uri(Path(cfg.run_dir).resolve())
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(cfg.experiment)
    if exp is None:
        art = (Path(cfg.run_dir).resolve() / "mlartifacts").as_uri()
        exp_id = client.create_experiment(cfg.experiment, artifact_location=art)
    else:
        exp_id = exp.experiment_id
    run = client.create_run(exp_id, run_name=cfg.name, tags={"plexrl.kind": "cluster"})
    run_id = run.info.run_id
    params = flatten(cfg.model_dump(mode="json", exclude={"jobs"}))
    client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())])
    now = int(time.time() * 1000)
    rep = result.report
    metrics = [Metric("accelerator_seconds", rep.accelerator_seconds, now, 0), Metric("wall", rep.wall, now, 0)]
    for s in rep.services:
        for k in ("busy", "swap", "idle"):
            metrics.append(Metric(f"{s.service}/{k}_seconds", getattr(s, k), now, 0))
        metrics.append(Metric(f"{s.service}/utilization", s.utilization, now, 0))
    for j in rep.jobs:
        metrics += [
            Metric(f"job/{j.job_id}/allocated_seconds", j.allocated, now, 0),
            Metric(f"job/{j.job_id}/steps", float(j.steps), now, 0),
            Metric(f"job/{j.job_id}/completion_seconds", j.completion, now, 0),
        ]
        if j.steps:
            metrics.append(Metric(f"job/{j.job_id}/cost_per_step", j.cost_per_step, now, 0))
    client.log_batch(run_id, metrics=metrics)
    for job in result.jobs:
        if job.tracking.get("run_id"):
            client.set_tag(run_id, f"plexrl.job.{job.job_id}", job.tracking["run_id"])
            try:
                MlflowClient(tracking_uri=job.tracking["uri"]).set_tag(
                    job.tracking["run_id"], "plexrl.cluster_run", run_id
                )
            except Exception:
                log.exception("could not link job %s to the cluster run", job.job_id)
    for name in ("report.txt", "report.json", "timeline.png"):
        if (out_dir / name).is_file():
            client.log_artifact(run_id, str(out_dir / name))
    failed = any(j.status != "done" for j in result.jobs)
    client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")
    return {"uri": uri, "run_id": run_id}


__all__ = ["ClusterConfig", "LoadedCluster", "is_cluster_file", "load_cluster", "run_cluster"]
