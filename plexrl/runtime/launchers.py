"""Clusters where teams' GPUs are, on Dask's own launchers: Slurm through dask-jobqueue and Kubernetes through
dask-kubernetes (its operator's `DaskCluster` / `DaskWorkerGroup` resources). The runtime section's `launcher:`
(`RuntimeConfig.launcher`) says which; `DaskExecutor.start` asks `start_cluster` for the cluster and then uses
it like its local one: one worker per GPU (`--resources GPU=1`, two threads: service nodes and inline cpu
nodes; the launcher gives it its GPU: Slurm's `--gres` sets CUDA_VISIBLE_DEVICES, Kubernetes' device plugin
mounts one), and the CPU pool as a job class of its own (no GPU resource, `cpu_threads` threads).

What is decided here is plain data, tested without a cluster: the keyword arguments of dask-jobqueue's
`SLURMCluster` and of the CPU pool's `SLURMJob` (`slurm_options`), and the custom resources handed to
dask-kubernetes' `KubeCluster` (`kube_specs`: pod and service specs the tests validate against the Kubernetes
schema). Nothing here submits a job or talks to an API server except `start_cluster`, which hands those to the
launcher. The launchers' packages are optional (`pip install 'plexrl[slurm]'` or `'plexrl[kubernetes]'`) and
imported only there.

Network: Dask's protocol is pickle. On Slurm the scheduler runs in this process and binds `dask_host`; a
loopback one keeps every worker on this machine (a single-node Slurm), anything else needs `dask_tls`
(`RuntimeConfig` refuses it otherwise), and every worker presents the same certificate. On Kubernetes the
scheduler is a pod: without `dask_tls` the section must say `allow_plaintext_scheduler: true` (a namespace
whose NetworkPolicy admits only the server and the workers; docs/operations.md).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

from pydantic import Field

from plexrl.job.model_config import StrictModel
from plexrl.runtime.tls import LOOPBACK, TLSFiles, is_loopback

SERVICE_THREADS = 2  # a service worker: one thread for service nodes, one for inline cpu nodes (DaskExecutor)
TLS_DIR = "/etc/plexrl/dask-tls"  # where a Kubernetes pod finds the `dask_tls` files (a Secret's keys)


class SlurmJobClass(StrictModel):
    """One Slurm job class: what each of its jobs asks for (one Dask worker per job)."""

    cpus: int = Field(1, ge=1, le=1024, description="CPUs per job (--cpus-per-task).")
    memory: str = Field("16GB", pattern=r"^\d+(\.\d+)?\s*[KMGT]?i?B$", description="Memory per job (--mem).")
    gres: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_:,.-]+$",
        description="Generic resources per job, e.g. 'gpu:1' (one GPU: Slurm then sets CUDA_VISIBLE_DEVICES for "
        "the worker). None: none (a single-node test without GPUs).",
    )
    directives: list[Annotated[str, Field(pattern=r"^--[A-Za-z0-9-]+(=[^\s]+)?$")]] = Field(
        default_factory=list, description="More #SBATCH options, e.g. '--constraint=h100'."
    )


class SlurmLauncher(StrictModel):
    """Services and the CPU pool as Slurm jobs, through dask-jobqueue's SLURMCluster (its scheduler in this
    process): `services.count x services.ranks` jobs of the `service` class and one of the `cpu_pool` class."""

    kind: Literal["slurm"] = Field(description="Start the Dask workers as Slurm jobs (dask-jobqueue).")
    partition: str | None = Field(None, pattern=r"^[A-Za-z0-9_.,-]+$", description="Slurm partition (-p).")
    account: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", description="Slurm account (-A).")
    walltime: str = Field("24:00:00", pattern=r"^(\d+-)?\d{1,3}:\d{2}:\d{2}$", description="Time limit per job.")
    service: SlurmJobClass = Field(
        default_factory=lambda: SlurmJobClass(cpus=4, memory="64GB", gres="gpu:1"),
        description="The job of one service rank: one GPU (gres), its CPUs and memory.",
    )
    cpu_pool: SlurmJobClass = Field(
        default_factory=lambda: SlurmJobClass(cpus=8, memory="32GB", gres=None),
        description="The CPU pool's job (verifiers, tools, advantages); its worker runs `cpu_threads` threads.",
    )
    python: str | None = Field(None, description="The Python on the compute nodes (default: this interpreter).")
    prologue: list[str] = Field(
        default_factory=list,
        description="Shell lines run before each worker starts (module load ..., source VENV/bin/activate).",
    )
    interface: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]+$", description="Network interface the workers bind (e.g. ib0)."
    )
    log_directory: str | None = Field(None, description="Where the jobs' output goes (default: the submit dir).")
    start_timeout_s: float = Field(600.0, gt=0, description="Seconds to wait for every worker to join.")


class KubePods(StrictModel):
    """What each worker pod of a group asks for."""

    cpu: str = Field("4", pattern=r"^\d+(\.\d+)?m?$", description="CPU request and limit per pod.")
    memory: str = Field("64Gi", pattern=r"^\d+(\.\d+)?([KMGTE]i?)?$", description="Memory request and limit per pod.")
    gpus: int = Field(0, ge=0, le=16, description="GPUs per pod (the launcher's `gpu_resource`).")


class KubernetesLauncher(StrictModel):
    """Services and the CPU pool as pods of a `DaskCluster` (dask-kubernetes' operator, which must be installed
    in the cluster): the default worker group holds the `services.count x services.ranks` GPU workers, a
    `cpu-pool` worker group the CPU pool."""

    kind: Literal["kubernetes"] = Field(description="Start the Dask cluster on Kubernetes (dask-kubernetes).")
    name: str = Field("plexrl", pattern=r"^[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?$", description="DaskCluster name.")
    namespace: str | None = Field(
        None, pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", description="Namespace (default: the pod's own)."
    )
    image: str = Field(description="The PlexRL image (the same as the server's: PlexRL and its venv installed).")
    gpu_resource: str = Field("nvidia.com/gpu", description="The device plugin's GPU resource name.")
    service: KubePods = Field(
        default_factory=lambda: KubePods(cpu="4", memory="64Gi", gpus=1),
        description="One service rank's pod: one GPU, its CPUs and memory.",
    )
    cpu_pool: KubePods = Field(
        default_factory=lambda: KubePods(cpu="8", memory="32Gi", gpus=0), description="The CPU pool's pod."
    )
    env: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], str] = Field(
        default_factory=dict, description="Environment of the scheduler and worker pods."
    )
    tls_secret: str = Field(
        "plexrl-dask-tls",
        description=f"With dask_tls: the Secret (keys ca.pem, cert.pem, key.pem) mounted at {TLS_DIR} in every pod.",
    )
    start_timeout_s: float = Field(900.0, gt=0, description="Seconds to wait for every worker to join.")


Launcher = Annotated[SlurmLauncher | KubernetesLauncher, Field(discriminator="kind")]


# -- Slurm ---------------------------------------------------------------------------------------------------
def _worker_net(host: str, interface: str | None) -> list[str]:
    """Worker options that keep its comms where the scheduler's are: loopback on one machine, else `interface`;
    its HTTP server (/health, /metrics) always on loopback."""
    args = ["--dashboard-address", f"{LOOPBACK}:0"]
    if is_loopback(host):
        return [*args, "--host", host]
    return [*args, "--interface", interface] if interface else args


def _slurm_job(job: SlurmJobClass, threads: int, extra: list[str]) -> dict[str, Any]:
    """One job class's keyword arguments of dask-jobqueue's SLURMJob: one worker (`processes=1`) of `threads`
    threads on `job.cpus` CPUs, no Dask memory limit (Slurm's --mem is the limit; a paused worker would hold a
    service's state hostage), the GPU by --gres."""
    directives = [*job.directives, *([f"--gres={job.gres}"] if job.gres else [])]
    return {
        "cores": threads, "processes": 1, "job_cpu": job.cpus, "memory": job.memory.replace(" ", ""),
        "job_mem": job.memory.replace(" ", ""), "job_extra_directives": directives,
        "worker_extra_args": [*extra, "--memory-limit", "0"],
    }  # fmt: skip


def slurm_options(
    launcher: SlurmLauncher, *, cpu_threads: int, host: str, tls: TLSFiles | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(SLURMCluster's keyword arguments: the service class, the scheduler; the CPU pool's SLURMJob options).
    The worker environment drops Dask's MALLOC_TRIM_THRESHOLD_ (torch on CPU ran 2.2x slower with it, see
    `DaskExecutor.start`); `tls`: every member presents it (protocol tls)."""
    net = _worker_net(host, launcher.interface)
    prologue = ["export DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON='{}'", *launcher.prologue]
    scheduler: dict[str, Any] = {"host": host, "dashboard_address": f"{LOOPBACK}:0"}
    common: dict[str, Any] = {
        "queue": launcher.partition, "account": launcher.account, "walltime": launcher.walltime,
        "python": launcher.python or sys.executable, "job_script_prologue": prologue,
        "log_directory": launcher.log_directory, "scheduler_options": scheduler, "silence_logs": "error",
    }  # fmt: skip
    if tls is not None:
        common["security"] = tls.security()
        common["protocol"] = "tls://"
    gpu = _slurm_job(launcher.service, SERVICE_THREADS, [*net, "--resources", "GPU=1"])
    gpu["job_name"] = "plexrl-service"
    cpu = _slurm_job(launcher.cpu_pool, cpu_threads, net)
    cpu["job_name"] = "plexrl-cpu"
    return {**common, **gpu}, cpu


def _start_slurm(launcher: SlurmLauncher, workers: int, cpu_threads: int, host: str, tls: TLSFiles | None) -> Any:
    """A SLURMCluster with `workers` service jobs and one CPU-pool job (a second job class in the same
    SpecCluster: its own SLURMJob options, name `cpu-pool`)."""
    try:
        from dask_jobqueue import SLURMCluster
        from dask_jobqueue.slurm import SLURMJob
    except ImportError as exc:
        raise RuntimeError("launcher: slurm needs dask-jobqueue: pip install 'plexrl[slurm]'") from exc
    cluster_kw, cpu = slurm_options(launcher, cpu_threads=cpu_threads, host=host, tls=tls)
    cluster = SLURMCluster(**cluster_kw)
    cluster.scale(workers)
    # the cluster's own job options (config name, interface, protocol, the workers' security) under the CPU pool's
    job = {k: v for k, v in cluster._job_kwargs.items() if k not in cpu}
    cluster.worker_spec["cpu-pool"] = {"cls": SLURMJob, "options": {**job, **cpu}}
    cluster.scale(workers + 1)  # keeps every spec and starts the new one
    return cluster


# -- Kubernetes ----------------------------------------------------------------------------------------------
def _container(name: str, image: str, args: list[str], env: dict[str, str], pods: KubePods | None,
               gpu_resource: str, tls: bool) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {"name": name, "image": image, "args": args,
                           "env": [{"name": k, "value": v} for k, v in sorted(env.items())]}  # fmt: skip
    if pods is not None:
        limits: dict[str, Any] = {"cpu": pods.cpu, "memory": pods.memory}
        if pods.gpus:
            limits[gpu_resource] = pods.gpus
        out["resources"] = {"limits": limits, "requests": {"cpu": pods.cpu, "memory": pods.memory}}
    if tls:
        out["volumeMounts"] = [{"name": "dask-tls", "mountPath": TLS_DIR, "readOnly": True}]
    return out


def _pod(container: dict[str, Any], tls_secret: str | None) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": [container]}
    if tls_secret is not None:
        pod["volumes"] = [{"name": "dask-tls", "secret": {"secretName": tls_secret, "defaultMode": 0o400}}]
    return pod


def _tls_args() -> list[str]:
    """A Dask member's TLS options, the files from the mounted Secret."""
    return [
        "--tls-ca-file",
        f"{TLS_DIR}/ca.pem",
        "--tls-cert",
        f"{TLS_DIR}/cert.pem",
        "--tls-key",
        f"{TLS_DIR}/key.pem",
    ]


def kube_specs(launcher: KubernetesLauncher, *, workers: int, cpu_threads: int, tls: bool) -> dict[str, Any]:
    """The custom resources dask-kubernetes gets: {"cluster": the DaskCluster (scheduler pod and service, the
    default worker group of `workers` GPU workers), "cpu_pool": the `cpu-pool` group's worker spec (replicas and
    pod spec, `KubeCluster.add_worker_group(custom_spec=...)`)}. `tls`: every member speaks tls:// with the
    files of the launcher's `tls_secret`."""
    proto = ["--protocol", "tls", *_tls_args()] if tls else []
    env = {"DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON": "{}", **launcher.env}
    secret = launcher.tls_secret if tls else None
    worker = ["dask", "worker", "--name", "$(DASK_WORKER_NAME)", "--dashboard", "--dashboard-address", "8788",
              "--memory-limit", "0", *(_tls_args() if tls else [])]  # fmt: skip
    dash = [{"name": "http-dashboard", "containerPort": 8788, "protocol": "TCP"}]
    gpu = _container("worker", launcher.image, [*worker, "--resources", "GPU=1", "--nthreads", str(SERVICE_THREADS)],
                     env, launcher.service, launcher.gpu_resource, tls)  # fmt: skip
    gpu["ports"] = dash
    cpu = _container("worker", launcher.image, [*worker, "--nthreads", str(cpu_threads)], env, launcher.cpu_pool,
                     launcher.gpu_resource, tls)  # fmt: skip
    cpu["ports"] = dash
    sched = _container("scheduler", launcher.image, ["dask", "scheduler", "--host", "0.0.0.0", *proto], env, None,
                       launcher.gpu_resource, tls)  # fmt: skip
    sched["ports"] = [{"name": "tcp-comm", "containerPort": 8786, "protocol": "TCP"},
                      {"name": "http-dashboard", "containerPort": 8787, "protocol": "TCP"}]  # fmt: skip
    probe = {"httpGet": {"port": "http-dashboard", "path": "/health"}}
    sched["readinessProbe"] = {**probe, "initialDelaySeconds": 0, "periodSeconds": 1, "timeoutSeconds": 300}
    sched["livenessProbe"] = {**probe, "initialDelaySeconds": 15, "periodSeconds": 20}
    service = {
        "type": "ClusterIP",
        "selector": {"dask.org/cluster-name": launcher.name, "dask.org/component": "scheduler"},
        "ports": [{"name": "tcp-comm", "protocol": "TCP", "port": 8786, "targetPort": "tcp-comm"},
                  {"name": "http-dashboard", "protocol": "TCP", "port": 8787, "targetPort": "http-dashboard"}],
    }  # fmt: skip
    metadata: dict[str, Any] = {"name": launcher.name}
    if launcher.namespace:
        metadata["namespace"] = launcher.namespace
    cluster = {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskCluster",
        "metadata": metadata,
        "spec": {
            "worker": {"replicas": workers, "spec": _pod(gpu, secret)},
            "scheduler": {"spec": _pod(sched, secret), "service": service},
        },
    }
    return {"cluster": cluster, "cpu_pool": {"replicas": 1, "spec": _pod(cpu, secret)}}


def _start_kubernetes(launcher: KubernetesLauncher, workers: int, cpu_threads: int, tls: TLSFiles | None) -> Any:
    try:
        from dask_kubernetes.operator import KubeCluster
    except ImportError as exc:
        raise RuntimeError("launcher: kubernetes needs dask-kubernetes: pip install 'plexrl[kubernetes]'") from exc
    specs = kube_specs(launcher, workers=workers, cpu_threads=cpu_threads, tls=tls is not None)
    kw: dict[str, Any] = {"custom_cluster_spec": specs["cluster"]}
    if launcher.namespace:
        kw["namespace"] = launcher.namespace
    cluster = KubeCluster(**kw)
    cluster.add_worker_group("cpu-pool", custom_spec=specs["cpu_pool"])
    return cluster


def start_cluster(
    launcher: SlurmLauncher | KubernetesLauncher, workers: int, cpu_threads: int, host: str, tls: TLSFiles | None
) -> Any:
    """The launcher's Dask cluster (a `distributed.deploy.Cluster`) once its `workers` GPU workers and the CPU
    pool have joined (at most `start_timeout_s`; a Slurm queue may hold the jobs a while). The scheduler runs
    without Dask's active memory manager, as the local cluster's (`DaskExecutor.start` says why)."""
    import dask

    dask.config.set({"distributed.scheduler.active-memory-manager.start": False})
    if isinstance(launcher, SlurmLauncher):
        cluster = _start_slurm(launcher, workers, cpu_threads, host, tls)
    else:
        cluster = _start_kubernetes(launcher, workers, cpu_threads, tls)
    try:
        cluster.wait_for_workers(workers + 1, timeout=launcher.start_timeout_s)
    except BaseException:
        cluster.close()
        raise
    return cluster


__all__ = [
    "KubePods",
    "KubernetesLauncher",
    "Launcher",
    "SlurmJobClass",
    "SlurmLauncher",
    "kube_specs",
    "slurm_options",
    "start_cluster",
]
