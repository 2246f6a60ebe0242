"""The runtime section of a config (`RuntimeConfig`): the services, the driver (in-process or a Dask cluster,
and how that cluster is reached) and the planner's policies. A cluster config is one with jobs
(`plexrl.cluster`), a server config embeds one (`plexrl.server.config`); the executor and the planner are built
from it whole (`plexrl.runtime.build`, `plexrl.planner.Planner.from_config`), never from copies of its fields.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ByteSize, Field, model_validator

from plexrl.job.model_config import StrictModel
from plexrl.runtime.launchers import KubernetesLauncher, Launcher
from plexrl.runtime.tls import is_loopback


class ServicesConfig(StrictModel):
    """The shared LLM services: one per accelerator (here: per Dask worker with a GPU resource)."""

    count: int = Field(1, ge=1, le=4096, description="Number of services (accelerators).")
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="Where the device tier lives. cuda: each service rank on a GPU of its own (`devices`); jobs "
        "that leave model.dtype and model.attention unset train in bfloat16 with sdpa there (docs/gpu.md).",
    )
    devices: list[Annotated[str, Field(pattern=r"^(\d{1,3}|GPU-[0-9a-fA-F-]{8,}|MIG-[0-9A-Za-z/-]{8,})$")]] | None = (
        Field(
            None,
            description="device: cuda: the GPUs of the services, as CUDA_VISIBLE_DEVICES names them (indices or "
            "UUIDs); service i rank r gets devices[i * ranks + r], and its worker sees only that GPU. None: the "
            "visible GPUs in order. Fewer GPUs than count x ranks is refused.",
        )
    )
    device_memory: ByteSize | None = Field(
        None,
        description="Device-tier budget per service rank, e.g. '24MB'. None: unlimited on cpu; on cuda the free "
        "memory of the smallest service GPU minus headroom for the CUDA context, activations, optimizer "
        "temporaries, vLLM's working memory and paused KV caches (plexrl.devices.device_split; docs/gpu.md).",
    )
    reserve: ByteSize | None = Field(
        None,
        description="device: cuda with device_memory unset: bytes of each GPU kept out of the budget for "
        "activations and temporaries, instead of the headroom computed from the jobs (a server, whose jobs come "
        "later: 10% of the GPU).",
    )
    deterministic: bool = Field(
        False,
        description="cuda: deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG, "
        "vLLM's batch-invariant kernels, Hopper or newer). Slower; equal runs give equal bits on one GPU model. "
        "Without it CUDA runs are equal in distribution, not in bits (docs/gpu.md).",
    )
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

    @model_validator(mode="after")
    def _gpus(self) -> ServicesConfig:
        if self.devices is not None:
            from plexrl.devices import service_gpus

            if self.device != "cuda":
                raise ValueError("services.devices names GPUs: set services.device: cuda, or remove devices")
            service_gpus(self.count, self.ranks, self.devices, [])  # raises (a ValueError) with the fix
        return self


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


class RuntimeConfig(DaskNetwork):
    """THE runtime section: the services, the driver and the planner's policies, everything that says how jobs
    run (not which ones). A cluster config is this plus its jobs and its run's name and outputs
    (`plexrl.cluster.ClusterConfig`); a server config embeds it whole as `cluster:` (`ServerConfig.cluster`).
    The executor is built from it (`runtime.build.make_executor`), the planner too (`Planner.from_config`), and
    each rule about it is checked here, once."""

    cpu_threads: int = Field(2, ge=1, description="Threads of the local CPU-pool worker.")
    launcher: Launcher | None = Field(
        None,
        description="driver: dask: start the workers on a Slurm cluster (kind: slurm, dask-jobqueue) or on "
        "Kubernetes (kind: kubernetes, dask-kubernetes) instead of this machine: one worker per GPU and the CPU "
        "pool as its own job class (plexrl/runtime/launchers.py; docs/operations.md).",
    )
    services: ServicesConfig = Field(default_factory=ServicesConfig)  # type: ignore[arg-type]
    placement: Literal["isolated", "pack", "spread", "spread+backfill"] = Field(
        "spread+backfill", description="Placement policy."
    )
    max_load: float = Field(
        1.0, gt=0, le=64,
        description="pack and spread+backfill: admit a job to a shared service while its predicted load <= this.",
    )  # fmt: skip
    ordering: Literal["fifo", "hrrs", "slowdown", "deadline", "io-first", "critical-path", "time-slicing"] = Field(
        "hrrs",
        description="Ordering of ready service nodes: fifo, hrrs (highest response ratio, gap-aware), "
        "slowdown (the job furthest behind its solo pace first, then hrrs: evens out the slowdowns), "
        "deadline (least laxity against per-job deadlines, 1.6 x solo time or the mix's earliest end), "
        "io-first (the jobs whose rest is least service work, behind verifiers and tools, first; then hrrs), "
        "critical-path (when a job's rest of turns, tools and verifiers outlasts the service's work: that job "
        "first, its gaps filled only with nodes predicted to end before it returns; else hrrs) or "
        "time-slicing (the llm-d / OpenRL design, for comparison: a FIFO lock per service held for a phase, the "
        "whole state moved out and in at each hand-over, no prefetch, lookahead or fair share).",
    )
    state_moves: Literal["planned", "exclusive"] = Field(
        "planned",
        description="planned: the StateManager keeps as many states on device as fit, evicting by next use, "
        "and prefetches; exclusive: one job's state on device at a time, every other one moved off whole at "
        "each hand-over, nothing prefetched (implied by ordering: time-slicing).",
    )
    lookahead: bool = Field(
        True, description="dask: send a service its next node while one runs (saves a round trip per node)."
    )
    hold_ahead: bool | None = Field(
        None,
        description="with lookahead: send nothing ahead while a node the ordering prefers is due before the "
        "running node ends (it goes ahead instead; planner/ahead.py). Default: as the ordering says (on for "
        "io-first and critical-path, off for the others).",
    )
    batch_rollouts: bool = Field(
        False, description="Co-schedule rollouts: LoRA jobs on one shared vLLM engine roll out in ONE engine call "
        "(each job's own tokens; either driver, not with services.ranks > 1); so do the sample calls of LoRA "
        "sessions over one base.",
    )  # fmt: skip
    bundle_calls: bool = Field(
        True, description="A session's own sample calls that wait together (its client sent them at once, of the "
        "same weights) run as ONE engine call, up to 8 of them, each with its own seed and parameters: the same tokens "
        "as alone up to the float noise of another batch composition. false: each call alone, its numbers exactly "
        "those alone (also the default of a runner built outside a server or a cluster config).",
    )  # fmt: skip
    bundle_window_s: float = Field(
        0.02, ge=0, le=1,
        description="With bundle_calls: how long the first call of an idle session whose client was seen sending "
        "calls at once waits for the rest before it runs, so that the whole burst runs as one engine call instead of "
        "its first call alone and the rest after it. 0: never waits.",
    )  # fmt: skip
    batch_window_s: float = Field(
        0.05, ge=0, le=10,
        description="With batch_rollouts: how long at most a session's sample call that finds its service idle "
        "waits for the sample calls of other sessions on its base that sit idle between calls (their clients may "
        "be about to send theirs: one engine call for all). It stops waiting at once when they have all come, or "
        "any other work queues there; a session alone on its base never waits. 0: never wait.",
    )  # fmt: skip
    phase_window_s: float = Field(
        30.0, ge=0, le=600,
        description="With batch_rollouts: how long at most a session's sample call lets other runnable work on its "
        "service go first while sessions of its base are busy there with calls of other kinds (training, saving) "
        "after which their clients sample: they then sample in one engine call instead of each alone as it comes "
        "round. The service never idles for it. 0: never.",
    )  # fmt: skip
    fair_share: bool = Field(
        True,
        description="Order each service's ready nodes by user first (the user whose jobs used the least service "
        "time goes next), then by `ordering`: one user's many jobs cannot starve another's single job. With one "
        "user (a cluster config's jobs are all nobody's) it is `ordering` exactly.",
    )
    share_half_life_s: float = Field(
        3600.0, gt=0, description="Half-life of the service seconds counted for fair share and quotas."
    )
    max_jobs_per_user: int | None = Field(
        None, ge=1, description="Jobs of one user running at once; more wait queued, with the reason shown."
    )
    max_share_per_user: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Quota: a user whose jobs use this share (0-1] of the cluster's accelerator-seconds (recent, "
        "decayed with `share_half_life_s`) gets no further job in until it falls; one job always goes in.",
    )
    validate_state: bool = Field(False, description="Planner invariants after every event and state checksums.")

    @model_validator(mode="after")
    def _rules(self) -> RuntimeConfig:
        if self.scheduler is not None and self.driver != "dask":
            raise ValueError("`scheduler` needs `driver: dask`")
        if self.launcher is not None and (self.driver != "dask" or self.scheduler is not None):
            raise ValueError("`launcher` starts a Dask cluster: set driver: dask and no `scheduler`")
        if (
            isinstance(self.launcher, KubernetesLauncher)
            and self.dask_tls is None
            and not self.allow_plaintext_scheduler
        ):
            raise ValueError(
                "launcher: kubernetes runs the Dask scheduler in a pod, reached over the network: give `dask_tls` "
                "(its files also in the launcher's tls_secret), or set allow_plaintext_scheduler: true in a namespace "
                "whose NetworkPolicy admits only the server and the workers (docs/operations.md)"
            )
        if self.services.ranks > 1 and self.driver != "dask":
            raise ValueError("services.ranks > 1 (worker groups) needs driver: dask; set driver: dask or ranks: 1")
        if self.batch_rollouts and self.ordering == "time-slicing":
            raise ValueError("ordering: time-slicing runs one job's node at a time (the llm-d / OpenRL design): set "
                             "batch_rollouts: false, or another ordering")  # fmt: skip
        if self.batch_rollouts and self.services.ranks > 1:
            raise ValueError("batch_rollouts does not run on worker groups (services.ranks > 1); set services.ranks: "
                             "1 or batch_rollouts: false")  # fmt: skip
        return self


__all__ = [
    "DaskNetwork",
    "DaskTLS",
    "RuntimeConfig",
    "ServicesConfig",
    "dask_network_problem",
    "scheduler_host",
]
