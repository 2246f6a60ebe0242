"""Many jobs on shared services: the cluster config, its validation, and the run that ends with the
accounting table and a cluster-level MLflow run.

A cluster YAML names the services (count, per-tier memory budgets, device), the policies, and the jobs
(each a job YAML path relative to the cluster file, with optional `--set`-style overrides, or an inline
job). `load_cluster` validates everything at once, including whether each job's state fits a service's
device budget, and raises one `ConfigError` listing every problem.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError, model_validator

from plexrl.errors import ConfigError, Problem, pydantic_problem
from plexrl.job.budget import device_need
from plexrl.job.devices import device_jobs
from plexrl.job.load import LoadedJob, load_job
from plexrl.job.model_config import StrictModel
from plexrl.runtime.config import RuntimeConfig

if TYPE_CHECKING:
    from plexrl.hooks.base import Hook
    from plexrl.hooks.timeline import Span

log = logging.getLogger(__name__)


class ClusterJob(StrictModel):
    """One job of the mix: a job YAML (path relative to the cluster file) with overrides, or inline."""

    config: str | None = Field(None, description="Job YAML path, relative to the cluster file.")
    set: dict[str, Any] = Field(default_factory=dict, description="Overrides, e.g. {seed: 1, iterations: 50}.")
    job: dict[str, Any] | None = Field(None, description="An inline job config instead of a file.")
    user: str = Field(
        "", max_length=64, description="Who the job belongs to (fair share and per-user limits, as a server's users)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> ClusterJob:
        if (self.config is None) == (self.job is None):
            raise ValueError("give exactly one of `config` (a job YAML path) or `job` (an inline job config)")
        return self


class ClusterConfig(RuntimeConfig):
    """The runtime section (services, driver, policies: `RuntimeConfig`), the jobs that share the services, and
    the run's name and outputs."""

    name: str = Field("cluster", description="Name of the cluster-level MLflow run.")
    run_dir: str = Field("runs", description="Directory for the cluster's timeline, report and MLflow store.")
    mlflow: bool = Field(True, description="Log a cluster-level MLflow run (jobs log their own runs).")
    experiment: str = Field("plexrl", description="MLflow experiment of the cluster run.")
    progress: bool = Field(
        True, description="Progress: bars on a terminal, else a line per job every 30 s (a log, CI, tmux)."
    )
    jobs: list[ClusterJob] = Field(description="The jobs that share the services.", min_length=1)


@dataclass(slots=True)
class LoadedCluster:
    config: ClusterConfig
    jobs: list[LoadedJob]
    source: str
    raw: dict[str, Any] = field(default_factory=dict)


def load_cluster(source: str | Path, overrides: list[str] | None = None, *, raw: Any = None) -> LoadedCluster:
    """Read and validate a cluster YAML and every job in it; one `ConfigError` lists all problems. `raw`: the
    file already parsed (`config_kinds.read_config`: a file is parsed once), else it is read here."""
    from plexrl.job.load import apply_overrides
    from plexrl.yamlio import load_yaml_file

    path = Path(source)
    # bounded time and memory, clear errors (plexrl.yamlio); a parsed one is copied: the overrides edit it
    raw = (load_yaml_file(path) if raw is None else copy.deepcopy(raw)) or {}
    if not isinstance(raw, dict):
        raise ConfigError([Problem(str(path), "a cluster config must be a YAML mapping")], str(path))
    problems = apply_overrides(raw, overrides or [])
    try:
        cfg = ClusterConfig.model_validate(raw)
    except ValidationError as exc:
        problems += [pydantic_problem(e, "", ClusterConfig) for e in exc.errors()]
        raise ConfigError(problems, str(path)) from None
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
    jobs = device_jobs(cfg.services.device, cfg.services.ranks > 1, jobs)
    for i, job in enumerate(jobs):
        if cfg.services.ranks > 1:
            from plexrl.job.devices import group_problems

            problems += [Problem(f"jobs[{i}]", f"job {job.config.name!r}: {why}") for why in group_problems(job.config)]
    names = [j.config.name for j in jobs]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(Problem("jobs", f"two jobs are named {name!r}; give each a unique `name` (set: {{name: ...}})"))
    budget = cfg.services.device_memory
    if budget is not None:
        for i, job in enumerate(jobs):
            size = device_need(job)
            need, engine, holds, shared = size.state, size.engine, size.holds, size.shared
            if need + engine > budget:
                with_engine = f" plus {engine / 2**20:.1f} MiB for {shared}" if engine else ""
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


# -- running ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class ClusterResult:
    jobs: list[Any]  # JobRun records
    report: Any
    service_reports: dict[str, dict[str, Any]]
    timeline: Path | None
    tracking: dict[str, str] = field(default_factory=dict)
    spans: list[Span] = field(default_factory=list)  # what the timeline recorded (nodes, swaps, loads)
    moves: list[dict[str, Any]] = field(default_factory=list)  # every state move's record (`moves.json`)
    # the planner's counts: nodes sent ahead (lookahead), co-scheduled cohorts sent and their members
    planner: dict[str, int] = field(default_factory=dict)


def run_cluster(loaded: LoadedCluster, *, progress: bool = False, hooks: Sequence[Hook] = ()) -> ClusterResult:
    """Prepare every job (warm starts cached), run them on the shared services, account, track. Every output
    (timeline, accounting, the cluster MLflow run) is a hook; `hooks`: more of them, after those, given to the
    runner when it is built (nothing is set on it afterwards). The result carries the timeline's spans."""
    from plexrl.devices import visible_gpus
    from plexrl.hooks.cluster import Accounting, ClusterMlflow
    from plexrl.hooks.timeline import TimelineRecorder
    from plexrl.job.spec import prepare_job
    from plexrl.runtime.build import build_runner
    from plexrl.runtime.jobs import standard_hooks

    cfg = loaded.config
    run_dir = Path(cfg.run_dir).resolve()
    warm = "cuda" if cfg.services.device == "cuda" and visible_gpus() else "cpu"  # where warm starts train
    users = [j.user for j in cfg.jobs] if len(cfg.jobs) == len(loaded.jobs) else [""] * len(loaded.jobs)
    specs = [replace(prepare_job(job, device=warm), user=u) for job, u in zip(loaded.jobs, users, strict=True)]
    extra = list(hooks)
    hooks = standard_hooks(run_dir, progress=progress, mlflow=any(j.config.tracking.mlflow for j in loaded.jobs))
    out_dir = run_dir / "clusters" / f"{cfg.name}-{int(time.time())}"
    timeline = hooks[0]
    assert isinstance(timeline, TimelineRecorder)
    accounting = Accounting(timeline, out_dir, f"{cfg.name}: {cfg.placement} / {cfg.ordering}", loaded.raw)
    hooks.append(accounting)
    tracker = None
    if cfg.mlflow:
        tracker = ClusterMlflow(
            accounting, run_dir, cfg.name, cfg.experiment, cfg.model_dump(mode="json", exclude={"jobs"})
        )
        hooks.append(tracker)
    runner = build_runner(cfg, [*hooks, *extra], jobs=loaded.jobs)
    runs = runner.run(specs)
    counts = runner.planner.counts()
    log.info(
        "planner: %(sent_ahead)d nodes sent ahead (%(held_ahead)d times held back), %(cohorts_sent)d cohorts of "
        "%(cohort_members)d rollouts",
        counts,
    )
    return ClusterResult(
        runs,
        accounting.report,
        accounting.service_reports,
        accounting.png,
        tracker.tracking if tracker else {},
        spans=list(timeline.spans),
        moves=list(timeline.moves),
        planner=counts,
    )


__all__ = [
    "ClusterConfig",
    "ClusterJob",
    "ClusterResult",
    "LoadedCluster",
    "load_cluster",
    "run_cluster",
]
