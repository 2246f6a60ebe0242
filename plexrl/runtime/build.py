"""The runtime built from its one config section (`runtime.config.RuntimeConfig`): `make_executor` (in-process
or a Dask cluster), `budgets_of` (each service's tiers) and `build_runner`, THE builder of a `Runner`, used by
every entry point: `plexrl run JOB.yaml` (`runtime/jobs.run_jobs`, on the section's defaults), a cluster
(`plexrl.cluster.run_cluster`) and the server (`server.api.server_runner`, its embedded `cluster:` section).
The planner comes from the same section (`Planner.from_config`); the runner is built whole: nothing is set
on it afterwards."""

from __future__ import annotations

import time
from typing import Any

from plexrl.hooks.base import Hook
from plexrl.planner import Planner
from plexrl.runtime.config import RuntimeConfig
from plexrl.runtime.executor import Executor
from plexrl.runtime.records import Budgets
from plexrl.runtime.runner import Runner


def make_executor(cfg: RuntimeConfig) -> Executor:
    """The executor the section asks for: in-process (`driver: local`) or a Dask cluster."""
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


def budgets_of(cfg: RuntimeConfig) -> Budgets:
    """Each service's byte budget per tier (None: unlimited)."""
    s = cfg.services
    return Budgets(
        int(s.device_memory) if s.device_memory is not None else None,
        int(s.host_memory) if s.host_memory is not None else None,
        int(s.disk) if s.disk is not None else None,
    )


def build_runner(cfg: RuntimeConfig, hooks: list[Hook], executor: Executor | None = None, **options: Any) -> Runner:
    """The `Runner` of a runtime section over `executor` (default: `make_executor(cfg)`), with the planner of
    that section (`Planner.from_config`) and its budgets. `options` (`forget_ended`, `on_closed`,
    `checkpoint_every`, `checkpoint_at`, `poll`) go to the `Runner` as they are."""
    ex = executor if executor is not None else make_executor(cfg)
    return Runner(ex, Planner.from_config(cfg, ex.clock), hooks=hooks, budgets=budgets_of(cfg), **options)


__all__ = ["budgets_of", "build_runner", "make_executor"]
