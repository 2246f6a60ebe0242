"""The Dask cluster a `DaskExecutor` runs on, before any service starts: the security it requires
(`security_for`: nothing listens unauthenticated off loopback), the local `SpecCluster` it starts when no
scheduler or launcher is given (`local_cluster`), the service and CPU-pool workers it found (`workers_of`),
and a local cluster's processes pinned to cores (`pin`, `runtime/affinity.py`). See `runtime/dask.py` for
the cluster's shape and its security rules.

What it does NOT do: start a service, or start workers through a launcher (`runtime/launchers.py`).
"""

from __future__ import annotations

import logging
from typing import Any

from plexrl.runtime.tls import LOOPBACK, TLSFiles, is_loopback

log = logging.getLogger(__name__)


def security_for(scheduler: str | None, tls: TLSFiles | None, host: str) -> Any:
    """Dask's `Security` of `tls` (None without), after refusing what would listen or connect unprotected: a
    local cluster off loopback without TLS, a tls:// scheduler with no certificates anywhere."""
    import dask

    if scheduler is None and tls is None and not is_loopback(host):
        raise ValueError(
            f"a local Dask cluster on {host!r} would let anyone who reaches it run code in it (its "
            "protocol is pickle): give TLS files (dask_tls: ca_file, cert, key; make them with `plexrl certs "
            "DIR`), or bind 127.0.0.1"
        )
    security = tls.security() if tls is not None else None
    tls_scheduler = scheduler is not None and scheduler.startswith("tls://")
    if tls_scheduler and security is None and dask.config.get("distributed.comm.tls.ca-file", None) is None:
        raise ValueError(
            f"scheduler {scheduler!r} speaks TLS but no certificates are given: set `dask_tls` "
            "(ca_file, cert, key), or distributed.comm.tls in Dask's configuration"
        )
    return security


def local_cluster(
    services: int, ranks: int, cpu_threads: int, host: str, security: Any, worker_env: dict[str, dict[str, str]]
) -> Any:
    """A local `SpecCluster`: one worker process per service rank (`GPU=1`, two threads, named `service-i`
    or `service-i-rankr`, its environment from `worker_env`) and one CPU-pool worker `cpu-0` with
    `cpu_threads` threads; Dask's comms on `host`, its HTTP servers on loopback."""
    import dask
    from distributed import Nanny, Scheduler, SpecCluster

    # Dask's nanny exports MALLOC_TRIM_THRESHOLD_ to its workers; glibc then stops adapting its mmap
    # threshold and every tensor allocation >= 128 KiB becomes an mmap + page faults: torch on CPU
    # ran 2.2x slower in a worker than in a plain process (measured). Spawn workers without it.
    dask.config.set({"distributed.nanny.pre-spawn-environ": {}})
    # the active memory manager's ReduceReplicas dropped the copy of a job's spec that a worker had
    # fetched, so the next node there fetched (and pickled, on both workers' event loops) it again
    dask.config.set({"distributed.scheduler.active-memory-manager.start": False})
    # Dask's comms on `host`; the http servers (the scheduler's dashboard, each worker's /health and
    # /metrics, plain HTTP even with TLS) on loopback whatever `host` is
    net: dict[str, Any] = {"host": host, "protocol": "tls" if security else "tcp", "security": security}
    http = f"{LOOPBACK}:0"
    opts = {"memory_limit": 0, "silence_logs": logging.ERROR, "dashboard_address": http, **net}
    names = [f"service-{i}" + (f"-rank{r}" if r else "") for i in range(services) for r in range(ranks)]
    env = worker_env  # one GPU per service worker (CUDA_VISIBLE_DEVICES), none for the CPU pool
    workers: dict[str, Any] = {
        name: {"cls": Nanny, "options": {"nthreads": 2, "resources": {"GPU": 1}, "name": name,
                                         "env": dict(env.get(name, {})), **opts}}
        for name in names
    }  # fmt: skip
    workers["cpu-0"] = {"cls": Nanny, "options": {"nthreads": cpu_threads, "name": "cpu-0",
                                                  "env": dict(env.get("cpu-0", {})), **opts}}  # fmt: skip
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": http, **net}}
    cluster = SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR, security=security)
    log.info("local Dask cluster: scheduler %s, dashboard on 127.0.0.1", cluster.scheduler_address)
    return cluster


def workers_of(client: Any) -> tuple[list[tuple[str, str]], list[str]]:
    """The cluster's service workers as (name, address), by name, and its CPU-pool workers' addresses; a
    clear error when either kind is missing."""
    info = client.scheduler_info()["workers"]
    gpu = sorted((w.get("name", a), a) for a, w in info.items() if w.get("resources", {}).get("GPU", 0) >= 1)
    if not gpu:
        raise RuntimeError(
            "the Dask cluster has no worker with a GPU resource; start service workers with "
            "`dask worker ADDRESS --resources GPU=1 --nthreads 2`"
        )
    cpu = [a for a, w in info.items() if not w.get("resources", {}).get("GPU")]
    if not cpu:
        raise RuntimeError("the Dask cluster has no CPU-pool worker (a worker without a GPU resource); start one")
    return gpu, cpu


def pin(
    client: Any, service_workers: list[str], cpu_workers: list[str], device: str, service_threads: int | None
) -> dict[str, list[int]]:
    """Each service worker on cores of its own, the CPU pool on the rest (`affinity.core_plan`): worker address
    -> its cores. Nothing pinned, with a warning, when the machine has too few cores to leave the pool one."""
    from plexrl.devices import cores_per_service
    from plexrl.runtime.affinity import available_cores, core_plan, pin_process

    cores = available_cores()
    plan = core_plan(cores, len(service_workers), cores_per_service(device, service_threads))
    if plan is None:
        log.warning("pin_cores: %d cores cannot give %d services their own and the CPU pool one; not pinned",
                    len(cores), len(service_workers))  # fmt: skip
        return {}
    per_service, pool = plan
    targets = {**dict(zip(service_workers, per_service, strict=True)), **{a: pool for a in cpu_workers}}
    pinned = {addr: client.run(pin_process, mine, workers=[addr])[addr] for addr, mine in targets.items()}
    log.info("pinned: %s", pinned)
    return pinned


__all__ = ["local_cluster", "pin", "security_for", "workers_of"]
