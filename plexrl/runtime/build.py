"""The runtime built from its one config section (`runtime.config.RuntimeConfig`): `make_executor` (in-process
or a Dask cluster), `budgets_of` (each service's tiers) and `build_runner`, THE builder of a `Runner`, used by
every entry point: `plexrl run JOB.yaml` (`runtime/jobs.run_jobs`, on the section's defaults), a cluster
(`plexrl.cluster.run_cluster`) and the server (`server.api.server_runner`, its embedded `cluster:` section).
The planner comes from the same section (`Planner.from_config`); the runner is built whole: nothing is set
on it afterwards."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from plexrl.errors import ConfigError, Problem
from plexrl.hooks.base import Hook
from plexrl.planner import Planner
from plexrl.runtime.config import RuntimeConfig
from plexrl.runtime.executor import Executor
from plexrl.runtime.records import Budgets
from plexrl.runtime.runner import Runner

if TYPE_CHECKING:
    from plexrl.job.load import LoadedJob

log = logging.getLogger(__name__)


def make_executor(cfg: RuntimeConfig, *, cpu_node_s: float | None = None) -> Executor:
    """The executor the section asks for: in-process (`driver: local`) or a Dask cluster. On CUDA each service
    rank gets its own GPU (`plexrl.devices`: a local cluster's workers see one GPU each through
    `CUDA_VISIBLE_DEVICES`, the CPU pool none). `cpu_node_s`: a server's time limit per CPU node (each runs in
    a process killed past it: `runtime/cpu_nodes.py`)."""
    from plexrl.devices import configure_process, inline_devices, visible_gpus, worker_envs

    s = cfg.services
    cuda = s.device == "cuda"
    host = int(s.host_memory) if s.host_memory is not None else None
    if cfg.driver == "local":
        from plexrl.runtime.inline import InlineExecutor

        configure_process(s.device, s.deterministic)  # this process runs the services
        devices = inline_devices(s.device, s.count, s.devices, visible_gpus() if cuda else [])
        return InlineExecutor(
            services=s.count, devices=devices, validate=cfg.validate_state, clock=time.time, host_memory=host,
            cpu_node_s=cpu_node_s,
        )  # fmt: skip
    from plexrl.runtime.dask import DaskExecutor, TLSFiles

    env: dict[str, dict[str, str]] = {}
    if cfg.scheduler is None and cfg.launcher is None:  # a launcher's workers get their GPUs from it
        visible = visible_gpus() if cuda else []
        env = worker_envs(s.device, s.count, s.ranks, s.devices, visible, deterministic=s.deterministic)
    t = cfg.dask_tls
    return DaskExecutor(
        services=s.count, cpu_threads=cfg.cpu_threads, service_threads=s.threads, scheduler=cfg.scheduler,
        device=s.device, validate=cfg.validate_state, ranks=s.ranks, group_timeout=s.group_timeout,
        host=cfg.dask_host, tls=TLSFiles(t.ca_file, t.cert, t.key) if t is not None else None,
        pin_cores=cfg.pin_cores, worker_env=env, deterministic=s.deterministic, host_memory=host,
        cpu_node_s=cpu_node_s,
        launcher=cfg.launcher,
    )  # fmt: skip


def device_budget(cfg: RuntimeConfig, jobs: Sequence[LoadedJob] | None = None) -> int | None:
    """Each service rank's device budget: `services.device_memory` when set; None (unlimited) on CPU; on CUDA
    the default of `plexrl.devices.services_budget`, from this machine's GPUs (described without a CUDA context)
    and the headroom `jobs` need (None: a server's, `services.reserve`, or 10% of each GPU). A cluster on an
    external scheduler runs on GPUs this process cannot see: its budget must be given."""
    s = cfg.services
    if s.device_memory is not None:
        return int(s.device_memory)
    if s.device != "cuda":
        return None
    if cfg.driver == "dask" and cfg.scheduler is not None:
        why = "a cluster on an external scheduler runs on GPUs this process cannot measure: set it (bytes per GPU)"
        raise ConfigError([Problem("services.device_memory", why)])
    from plexrl.devices import query_gpus, services_budget, visible_gpus
    from plexrl.job.budget import estimate_engine_bytes
    from plexrl.job.devices import headroom_of

    heads = None
    if jobs is not None:
        heads = [headroom_of(j.config, j.graph, vllm=estimate_engine_bytes(j.config) > 0) for j in jobs]
    reserve = int(s.reserve) if s.reserve is not None else None
    split = services_budget(query_gpus(), services=s.count, ranks=s.ranks, named=s.devices, visible=visible_gpus(),
                            jobs=heads, reserve=reserve)  # fmt: skip
    log.info("services.device_memory unset on CUDA: %s", split.describe())  # the split, stated once
    return split.budget


def budgets_of(cfg: RuntimeConfig, jobs: Sequence[LoadedJob] | None = None) -> Budgets:
    """Each service's byte budget per tier (None: unlimited); the device's from `device_budget`. Services on
    GPUs move states on a copy stream beside compute (`copy_engine`)."""
    s = cfg.services
    return Budgets(
        device_budget(cfg, jobs),
        int(s.host_memory) if s.host_memory is not None else None,
        int(s.disk) if s.disk is not None else None,
        copy_engine=s.device == "cuda",
    )


def build_runner(
    cfg: RuntimeConfig, hooks: list[Hook], executor: Executor | None = None, *,
    jobs: Sequence[LoadedJob] | None = None, **options: Any,
) -> Runner:  # fmt: skip
    """The `Runner` of a runtime section over `executor` (default: `make_executor(cfg)`), with the planner of
    that section (`Planner.from_config`) and its budgets (on CUDA from `jobs`' headroom when they are known).
    `options` (`forget_ended`, `on_closed`, `checkpoint_every`, `checkpoint_at`, `poll`) go to the `Runner` as
    they are; `bundle_calls` and `bundle_window` are the section's unless given."""
    ex = executor if executor is not None else make_executor(cfg)
    options.setdefault("bundle_calls", cfg.bundle_calls)
    options.setdefault("bundle_window", cfg.bundle_window_s)
    return Runner(ex, Planner.from_config(cfg, ex.clock), hooks=hooks, budgets=budgets_of(cfg, jobs), **options)


__all__ = ["budgets_of", "build_runner", "device_budget", "make_executor"]
