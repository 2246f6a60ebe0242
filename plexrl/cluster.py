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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ByteSize, Field, ValidationError, model_validator

from plexrl.errors import ConfigError, Problem, pydantic_problem
from plexrl.job.budget import device_need
from plexrl.job.load import LoadedJob, load_job
from plexrl.job.model_config import StrictModel
from plexrl.runtime.tls import is_loopback

if TYPE_CHECKING:
    from plexrl.hooks.base import Hook
    from plexrl.hooks.timeline import Span
    from plexrl.runtime.executor import Executor
    from plexrl.runtime.runner import Runner

log = logging.getLogger(__name__)


class ServicesConfig(StrictModel):
    """The shared LLM services: one per accelerator (here: per Dask worker with a GPU resource)."""

    count: int = Field(1, ge=1, le=4096, description="Number of services (accelerators).")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the device tier lives.")
    device_memory: ByteSize | None = Field(None, description="Device-tier budget per service, e.g. '24MB'.")
    host_memory: ByteSize | None = Field(None, description="Host-tier budget per service (None: unlimited).")
    disk: ByteSize | None = Field(None, description="Disk-tier budget per service (None: unlimited).")
    threads: int | None = Field(None, ge=1, description="torch threads per service worker (default: torch's).")
    ranks: int = Field(
        1, ge=1, le=1024,
        description="Accelerators (Dask workers) per service: > 1 makes each service a worker group with one "
        "process group (FSDP2 training, rollouts on rank 0); budgets are per rank. Needs driver: dask.",
    )  # fmt: skip
    group_timeout: float = Field(
        60.0, gt=0, le=3600,
        description="Seconds a worker group waits for a rank to join or a collective to finish before the node fails.",
    )  # fmt: skip


class DaskTLS(StrictModel):
    """Mutual TLS for the Dask cluster: every member (scheduler, workers, nannies) and this client present `cert`,
    signed by the CA in `ca_file`, and accept only peers that do. `plexrl certs DIR` makes all three files."""

    ca_file: str = Field(description="The CA certificate (PEM) that signed every member's certificate.")
    cert: str = Field(description="The certificate (PEM) this process and the local cluster's members present.")
    key: str = Field(description="The private key (PEM) of `cert`; keep it readable by its owner only.")


def scheduler_host(address: str) -> str:
    """The host part of a Dask address: `tls://10.0.0.5:8786` -> `10.0.0.5`, `[::1]:8786` -> `::1`."""
    rest = address.split("://", 1)[-1]
    if rest.startswith("["):
        return rest[1 : rest.find("]")]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def dask_network_problem(host: str, scheduler: str | None, tls: bool, allow_plaintext: bool = False) -> str | None:
    """Why a Dask network setting lets others run code (Dask's protocol is pickle), with the fix; None if it
    does not. `host`: the local cluster's interface (used when `scheduler` is None); `scheduler`: an external
    scheduler's address (tls:// passes here: the executor refuses it at start without certificates, from
    `dask_tls` or Dask's own `distributed.comm.tls` configuration); `tls`: TLS files are given;
    `allow_plaintext`: plain tcp:// off loopback accepted."""
    if scheduler is None:
        if is_loopback(host) or tls:
            return None
        return (
            f"dask_host {host!r} lets anyone who reaches it run code on the local Dask cluster: give `dask_tls` "
            "(ca_file, cert, key; make them with `plexrl certs DIR`), or keep dask_host: 127.0.0.1"
        )
    if scheduler.startswith(("tls://", "inproc://")) or is_loopback(scheduler_host(scheduler)) or allow_plaintext:
        return None
    return (
        f"scheduler {scheduler!r} is reached over plain TCP off this machine: anyone who reaches it can run code "
        "on its workers and in this process. Run the cluster with TLS (`plexrl certs DIR`; `dask scheduler "
        "--protocol tls --tls-ca-file DIR/ca.pem --tls-cert DIR/cert.pem --tls-key DIR/key.pem`, the same "
        "--tls-* options on every `dask worker`), connect to tls://HOST:PORT and set `dask_tls` to those files; "
        "or, on a network you trust entirely, set allow_plaintext_scheduler: true"
    )


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


class DaskNetwork(StrictModel):
    """How a Dask cluster is reached and laid out on this machine: the fields a cluster config and a server
    config share (Dask's protocol is pickle: see `dask_network_problem`)."""

    driver: Literal["dask", "local"] = Field(
        "dask",
        description="dask: nodes run on a Dask cluster (a local one, or `scheduler`); local: in this process "
        "(no worker to lose; for tests and a single small machine).",
    )
    scheduler: str | None = Field(None, description="Address of an existing Dask scheduler (default: start one).")
    dask_host: str = Field(
        "127.0.0.1",
        description="Interface the local Dask cluster's scheduler, workers and nannies bind (its dashboard stays "
        "on 127.0.0.1). Anything but loopback needs `dask_tls`.",
    )
    dask_tls: DaskTLS | None = Field(
        None,
        description="Mutual TLS for the Dask cluster (`plexrl certs DIR` makes the files): needed for a dask_host "
        "off loopback and for a tls:// scheduler.",
    )
    allow_plaintext_scheduler: bool = Field(
        False,
        description="Accept a `scheduler` off this machine over plain tcp://. Whoever reaches that scheduler can "
        "run code on its workers and in this process: only on a network you trust entirely; prefer dask_tls.",
    )
    pin_cores: bool = Field(
        True,
        description="A local Dask cluster: each service worker on a core of its own and the CPU pool on the rest "
        "(os.sched_setaffinity; plexrl/runtime/affinity.py), as accelerators and host CPUs are apart on a real node. "
        "Skipped (with a warning) when the machine has too few cores; false: no pinning.",
    )

    @model_validator(mode="after")
    def _dask_network(self) -> DaskNetwork:
        if self.driver == "dask":
            tls, plain = self.dask_tls is not None, self.allow_plaintext_scheduler
            problem = dask_network_problem(self.dask_host, self.scheduler, tls, plain)
            if problem is not None:
                raise ValueError(problem)
        return self


class ClusterRuntime(DaskNetwork):
    """A cluster without its jobs: the services, the policies and the driver, what `make_executor` and
    `make_runner` need. A cluster config is one with jobs; a server's config gives one (`ServerConfig.cluster`,
    validated like any config)."""

    name: str = Field("cluster", description="Name of the cluster-level MLflow run.")
    run_dir: str = Field("runs", description="Directory for the cluster's timeline, report and MLflow store.")
    cpu_threads: int = Field(2, ge=1, description="Threads of the local CPU-pool worker.")
    services: ServicesConfig = Field(default_factory=ServicesConfig)  # type: ignore[arg-type]
    placement: Literal["isolated", "pack", "spread", "spread+backfill"] = Field(
        "spread+backfill", description="Placement policy."
    )
    max_load: float = Field(
        1.0, gt=0, le=64,
        description="pack and spread+backfill: admit a job to a shared service while its predicted load <= this.",
    )  # fmt: skip
    ordering: Literal["fifo", "hrrs", "slowdown", "deadline", "io-first"] = Field(
        "hrrs",
        description="Ordering of ready service nodes: fifo, hrrs (highest response ratio, gap-aware), "
        "slowdown (the job furthest behind its solo pace first, then hrrs: evens out the slowdowns), "
        "deadline (least laxity against per-job deadlines, 1.6 x solo time or the mix's earliest end) or "
        "io-first (the jobs whose rest is least service work, behind verifiers and tools, first; then hrrs).",
    )
    lookahead: bool = Field(
        True, description="dask: send a service its next node while one runs (saves a round trip per node)."
    )
    hold_ahead: bool | None = Field(
        None,
        description="with lookahead: send nothing ahead while a node the ordering prefers is due before the "
        "running node ends (it goes ahead instead; planner/ahead.py). Default: as the ordering says (on for "
        "io-first, off for the others).",
    )
    batch_rollouts: bool = Field(
        False, description="Co-schedule rollouts: LoRA jobs on one shared vLLM engine roll out in ONE engine call "
        "(each job's own tokens; either driver, not with services.ranks > 1).",
    )  # fmt: skip
    validate_state: bool = Field(False, description="Planner invariants after every event and state checksums.")
    mlflow: bool = Field(True, description="Log a cluster-level MLflow run (jobs log their own runs).")
    experiment: str = Field("plexrl", description="MLflow experiment of the cluster run.")
    progress: bool = Field(True, description="Progress bars on a terminal.")

    @model_validator(mode="after")
    def _groups_on_dask(self) -> ClusterRuntime:
        if self.services.ranks > 1 and self.driver != "dask":
            raise ValueError("services.ranks > 1 (worker groups) needs driver: dask; set driver: dask or ranks: 1")
        if self.batch_rollouts and self.services.ranks > 1:
            raise ValueError("batch_rollouts does not run on worker groups (services.ranks > 1); set services.ranks: "
                             "1 or batch_rollouts: false")  # fmt: skip
        return self


class ClusterConfig(ClusterRuntime):
    """Services, policies and the jobs that share them."""

    jobs: list[ClusterJob] = Field(description="The jobs that share the services.", min_length=1)


@dataclass(slots=True)
class LoadedCluster:
    config: ClusterConfig
    jobs: list[LoadedJob]
    source: str
    raw: dict[str, Any] = field(default_factory=dict)


def load_cluster(source: str | Path, overrides: list[str] | None = None) -> LoadedCluster:
    """Read and validate a cluster YAML and every job in it; one `ConfigError` lists all problems."""
    from plexrl.job.load import apply_overrides
    from plexrl.yamlio import load_yaml_file

    path = Path(source)
    raw = load_yaml_file(path) or {}  # bounded time and memory, clear errors: see plexrl.yamlio
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


def is_cluster_file(path: Path | None) -> bool:
    """A YAML with a top-level `jobs` list is a cluster config; anything else is a job."""
    if path is None or not path.is_file():
        return False
    from plexrl.yamlio import load_yaml_file

    try:
        raw = load_yaml_file(path)
    except ConfigError:
        return False  # not readable as YAML: loading it as a job reports why
    return isinstance(raw, dict) and "jobs" in raw


# -- running ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class ClusterResult:
    jobs: list[Any]  # JobRun records
    report: Any
    service_reports: dict[str, dict[str, Any]]
    timeline: Path | None
    tracking: dict[str, str] = field(default_factory=dict)
    spans: list[Span] = field(default_factory=list)  # what the timeline recorded (nodes, swaps, loads)
    # the planner's counts: nodes sent ahead (lookahead), co-scheduled groups sent and their members
    planner: dict[str, int] = field(default_factory=dict)


def make_executor(cfg: ClusterRuntime) -> Executor:
    """The executor a cluster config asks for: in-process (`driver: local`) or a Dask cluster."""
    s = cfg.services
    if cfg.driver == "local":
        from plexrl.runtime.inline import InlineExecutor

        return InlineExecutor(services=s.count, device=s.device, validate=cfg.validate_state, clock=time.time)
    from plexrl.runtime.dask import DaskExecutor, TLSFiles

    t = cfg.dask_tls
    return DaskExecutor(
        services=s.count, cpu_threads=cfg.cpu_threads, service_threads=s.threads, scheduler=cfg.scheduler,
        device=s.device, validate=cfg.validate_state, ranks=s.ranks, group_timeout=s.group_timeout,
        host=cfg.dask_host, tls=TLSFiles(t.ca_file, t.cert, t.key) if t is not None else None,
        pin_cores=cfg.pin_cores,
    )  # fmt: skip


def make_runner(
    cfg: ClusterRuntime, hooks: list[Hook], executor: Executor | None = None, *, fair_share: bool = False,
    share_half_life_s: float | None = None, **options: Any,
) -> Runner:  # fmt: skip
    """The one `Runner` (`runtime.build.build_runner`), with the config's policies and budgets, over
    `executor` (default: `make_executor`), built whole: `fair_share` orders by user first (`FairShare` over the
    config's ordering), with service seconds decayed over `share_half_life_s`; `options` (`forget_ended`,
    `on_closed`, `checkpoint_at`) go to the `Runner` as they are. Used by `plexrl run CLUSTER.yaml` and the
    server."""
    from plexrl.runtime.build import build_runner
    from plexrl.runtime.records import Budgets

    s = cfg.services
    budgets = Budgets(
        int(s.device_memory) if s.device_memory is not None else None,
        int(s.host_memory) if s.host_memory is not None else None,
        int(s.disk) if s.disk is not None else None,
    )
    return build_runner(
        executor if executor is not None else make_executor(cfg), hooks, placement=cfg.placement,
        max_load=cfg.max_load, ordering=cfg.ordering, budgets=budgets, validate=cfg.validate_state,
        dask=cfg.driver == "dask", lookahead=cfg.lookahead, hold_ahead=cfg.hold_ahead, fair_share=fair_share,
        share_half_life_s=share_half_life_s, batch_rollouts=cfg.batch_rollouts, **options,
    )  # fmt: skip


def run_cluster(loaded: LoadedCluster, *, progress: bool = False, hooks: Sequence[Hook] = ()) -> ClusterResult:
    """Prepare every job (warm starts cached), run them on the shared services, account, track. Every output
    (timeline, accounting, the cluster MLflow run) is a hook; `hooks`: more of them, after those, given to the
    runner when it is built (nothing is set on it afterwards). The result carries the timeline's spans."""
    from plexrl.hooks.cluster import Accounting, ClusterMlflow
    from plexrl.hooks.timeline import TimelineRecorder
    from plexrl.job.spec import prepare_job
    from plexrl.runtime.jobs import standard_hooks

    cfg = loaded.config
    run_dir = Path(cfg.run_dir).resolve()
    specs = [prepare_job(job) for job in loaded.jobs]
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
    runner = make_runner(cfg, [*hooks, *extra])
    runs = runner.run(specs)
    p = runner.planner
    counts = {
        "sent_ahead": p.sent_ahead,
        "held_ahead": p.held_ahead,
        "groups_sent": p.groups_sent,
        "grouped_nodes": p.grouped_nodes,
    }
    log.info(
        "planner: %(sent_ahead)d nodes sent ahead (%(held_ahead)d times held back), %(groups_sent)d groups of "
        "%(grouped_nodes)d rollouts",
        counts,
    )
    return ClusterResult(
        runs,
        accounting.report,
        accounting.service_reports,
        accounting.png,
        tracker.tracking if tracker else {},
        spans=list(timeline.spans),
        planner=counts,
    )


__all__ = [
    "ClusterConfig",
    "ClusterRuntime",
    "DaskTLS",
    "LoadedCluster",
    "dask_network_problem",
    "is_cluster_file",
    "load_cluster",
    "make_runner",
    "run_cluster",
]
