"""`DaskExecutor`: the runner's work carried out on a Dask cluster; batches stay on the workers.

One service per worker that has a `GPU` resource. The `Service` object (engines and job states) lives in
that worker process (a registry in `dask_tasks`, filled by a start-up task), so job state stays resident
there; every service task is pinned to its worker. CPU nodes are ordinary tasks on the CPU-pool workers.
With `ranks > 1` each service spans a worker group instead: the executor's `topology` (chosen at
construction, `runtime/topology.py`) carries every service task out one way or the other.

Data stays where it is made: a node task returns its `NodeResult` (report + output) and that future is
the node's output; a later node receives it as an argument, so Dask moves it worker to worker. Before it
returns, the task publishes its small `NodeReport` as a Dask event (`log_event`, to a topic this executor
subscribes to): that is all the runner receives of a node (`bytes_received` counts it), with no task and
no fetch of its own. A node's future is only looked at for failure (its worker died). Each job's frozen
spec is scattered once and reaches each worker that runs its tasks once.

A cpu node the planner marks `inline` (predicted shorter than a round trip) may run on any worker,
including the service worker that holds its input, instead of only the CPU pool (Dask picks the worker by
where the data is); nodes of operators declared `inline=False` (tool calls, untrusted code) never are.

Co-scheduled rollouts (`batch_rollouts`, `submit_cohort`): a cohort of several jobs' rollouts is ONE task on
the service's worker (one engine call), one place in the service's order; each member's handle is a small
task there that picks its result out, so its output stays on the worker like a node's (single-rank
services only).

Default cluster: a local `SpecCluster` with one worker process per service (`GPU=1`, one thread for
service nodes, one for inline cpu nodes) and one CPU-pool worker process with `cpu_threads` threads.
`scheduler="tcp://host:8786"` connects to an existing cluster instead (start it with `dask scheduler`,
`dask worker ADDRESS --resources GPU=1 --nthreads 2` per accelerator, and plain `dask worker ADDRESS` for
the CPU pool; see docs/architecture.md for the environment those workers need).

Nothing listens unauthenticated: Dask's protocol is pickle, so whoever reaches a scheduler, worker or nanny
can run code in it. The local cluster binds its scheduler, workers and nannies to `host` (127.0.0.1 by
default) and its HTTP servers (dashboard, the workers' /health and /metrics) always to 127.0.0.1. A `host`
off loopback is refused unless `tls` is given (`TLSFiles`: a CA and a certificate it signed, made by
`plexrl certs DIR`): then every member speaks tls:// and presents that certificate, and so must every
worker that joins (mutual TLS, `require_encryption`). The configs (`ClusterConfig`, `ServerConfig`) refuse
an external `scheduler` off loopback over plain tcp:// before anything starts.

A service worker that disappears (process killed, machine gone) is reported by `lost()` within `poll`
seconds; its work in flight is gone. Not done here: recovery from checkpoints.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import pickle
import queue
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from plexrl.planner.state import Tier
from plexrl.runtime.dask_cluster import local_cluster, pin, security_for, workers_of
from plexrl.runtime.dask_tasks import _run_cpu_node, _start_and_warm, _warm_up
from plexrl.runtime.executor import CheckpointReport, Finished, Handle, LoadReport, NodeReport, NodeTask
from plexrl.runtime.launchers import start_cluster
from plexrl.runtime.tls import LOOPBACK, TLSFiles
from plexrl.runtime.topology import Topology, Work, topology_for

log = logging.getLogger(__name__)


class DaskExecutor:
    def __init__(
        self,
        *,
        services: int = 1,
        cpu_threads: int = 2,
        service_threads: int | None = None,
        scheduler: str | None = None,
        device: str = "cpu",
        validate: bool = False,
        spill_dir: str | Path | None = None,
        poll: float = 0.5,
        ranks: int = 1,
        group_timeout: float = 60.0,
        host: str = LOOPBACK,
        tls: TLSFiles | None = None,
        pin_cores: bool = False,
        worker_env: dict[str, dict[str, str]] | None = None,
        deterministic: bool = False,
        host_memory: int | None = None,
        cpu_node_s: float | None = None,
        launcher: Any = None,
    ) -> None:
        """`cpu_node_s`: each CPU node runs in a process of its worker, killed past this many seconds (a server's
        `limits.max_cpu_node_s`, `runtime/cpu_nodes.py`); `worker_env`: a local cluster's worker environments by
        worker name (`plexrl.devices.worker_envs`: each service rank's `CUDA_VISIBLE_DEVICES` and CUDA settings,
        the CPU pool's empty GPU list); `deterministic`: torch's deterministic algorithms in every service worker
        (`devices.configure_process`)."""
        self.clock = time.time
        self.cpu_node_s = cpu_node_s
        self.launcher = launcher  # Slurm or Kubernetes starts the workers (`runtime/launchers.py`)
        self.worker_env = worker_env or {}
        self.deterministic = deterministic
        self.host_memory = host_memory  # each service's host tier (its pinned pool stays within it)
        self.pin_cores = pin_cores  # a local cluster: services on cores of their own (runtime/affinity.py)
        self.pinned: dict[str, list[int]] = {}  # worker address -> its cores, when pinned
        self.host, self.tls = host, tls  # the local cluster's interface; mutual TLS (see the module docstring)
        self.n_services, self.cpu_threads, self.service_threads = services, cpu_threads, service_threads
        self.scheduler, self.device, self.validate, self.poll = scheduler, device, validate, poll
        self.spill_dir = str(spill_dir) if spill_dir is not None else None
        self.worker_of: dict[str, str] = {}  # service id -> worker address
        self.cpu_workers: list[str] = []
        self.bytes_received = 0  # pickled bytes of every result fetched into this process
        self.bytes_by_job: dict[str, int] = {}  # the part of it that belongs to each job's loads and nodes
        self.client: Any = None
        self.cluster: Any = None
        self.token = uuid.uuid4().hex[:8]  # names this executor's services inside the workers
        self.topic = f"plexrl-reports-{self.token}"  # where the workers publish node reports
        self._work: dict[Handle, Work] = {}
        self.specs: dict[str, Any] = {}  # job -> scattered spec future
        self.loaded: dict[str, Any] = {}  # job -> future of its load (its service nodes run after it)
        self.gone: set[str] = set()  # services whose worker is gone (`lost`)
        self._reports: queue.Queue[dict[str, Any]] = queue.Queue()  # node reports published by the workers
        self._next_check = 0.0
        self._ids = itertools.count()
        self._refused: list[Finished] = []  # work refused at submission (its service is lost), reported by wait
        self._starting: dict[str, tuple[str, Any]] = {}  # worker address -> (service id, start future): joined
        self._next_join = 0.0
        self._refused_workers: set[str] = set()  # joined GPU workers where a service failed to start
        # worker groups (runtime/group.py): each service spans `ranks` workers with one process group
        self.ranks, self.group_timeout = ranks, group_timeout
        # how services sit on workers (one each, or a worker group each): every service task goes through it
        self.topology: Topology = topology_for(self)

    @property
    def groups(self) -> Any:
        """The `WorkerGroups` when services span several ranks (after `start`), else None."""
        return self.topology.groups

    # -- cluster ------------------------------------------------------------------------------------
    def start(self) -> list[str]:
        """Connect to the cluster (start a local one, or have the launcher start its workers), find its service
        and CPU-pool workers (`dask_cluster.py`), form the services on them (`topology`), subscribe to reports."""
        from distributed import Client

        if not logging.getLogger().isEnabledFor(logging.INFO):
            logging.getLogger("distributed").setLevel(logging.ERROR)  # no INFO chatter on start and stop
        security = security_for(self.scheduler, self.tls, self.host)
        if self.launcher is not None:  # Slurm or Kubernetes starts the workers; returns once they joined
            self.cluster = start_cluster(self.launcher, self.n_services * self.ranks, self.cpu_threads, self.host,
                                         self.tls)  # fmt: skip
            self.client = Client(self.cluster, security=security)
        elif self.scheduler is None:
            self.cluster = local_cluster(self.n_services, self.ranks, self.cpu_threads, self.host, security,
                                         self.worker_env)  # fmt: skip
            self.client = Client(self.cluster, security=security)
        else:
            self.client = Client(self.scheduler, security=security)
        # a local cluster: every worker it was given (a service missing at start would never be used); a
        # cluster of the user's: at least one service's ranks and the CPU pool (a worker restarting joins late)
        self.client.wait_for_workers(self.ranks + 1 if self.scheduler else self.n_services * self.ranks + 1,
                                     timeout=120)  # fmt: skip
        gpu, self.cpu_workers = workers_of(self.client)
        if self.pin_cores and self.scheduler is None and self.launcher is None:
            self.pinned = pin(self.client, [a for _, a in gpu], self.cpu_workers, self.device, self.service_threads)
        if self.deterministic:
            from plexrl.devices import configure_process

            self.client.run(configure_process, self.device, True, workers=[a for _, a in gpu])
        self.topology.form(gpu)
        self.client.run(_warm_up)
        self.client.subscribe_topic(self.topic, lambda event: self._reports.put(event[1]))
        self._next_check = time.time() + self.poll
        return list(self.worker_of)

    def start_args(self) -> tuple[Any, ...]:
        return self.device, self.validate, self.spill_dir, self.service_threads, self.host_memory

    def close(self) -> dict[str, dict[str, Any]]:
        reports: dict[str, dict[str, Any]] = {}
        if self.client is None:
            return reports
        try:
            for work in self._work.values():
                if not work.reported:
                    work.future.cancel()
            self._work.clear()
            alive = self._alive()
            reports = self.topology.stop(alive)
        finally:
            self.client.close()
            if self.cluster is not None:
                self.cluster.close()
        return reports

    def key(self, service_id: str) -> str:
        return f"{self.token}/{service_id}"

    def on(self, service_id: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A task that touches the service (load, node, save, release, stop): pinned to its worker and holding
        the worker's one GPU slot, so two never overlap; a tiny cpu node placed next to its input may use the
        worker's second thread."""
        return self.client.submit(
            fn, *args, workers=[self.worker_of[service_id]], allow_other_workers=False, pure=False,
            resources={"GPU": 1}, **kwargs,
        )  # fmt: skip

    def fetch(self, fut: Any, timeout: float | None = None, job_id: str = "") -> Any:
        value = fut.result(timeout=timeout)
        self._count(value, job_id)
        return value

    def _alive(self) -> set[str]:
        """Worker addresses the scheduler knows now (asked, not the client's periodically refreshed cache)."""
        return set(self.client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.workers)))

    # -- jobs and nodes -----------------------------------------------------------------------------
    def ship(self, spec: Any) -> None:
        # scattered once, not broadcast, to the CPU pool (a service worker may die; the spec must not die with
        # it): Dask copies it to a worker the first time a task there needs it, then keeps it there
        self.specs[spec.job_id] = self.client.scatter(spec, hash=False, workers=self.cpu_workers or None)

    def unship(self, job_id: str) -> None:
        """Drop the spec's future (Dask frees the data once no task needs it)."""
        self.specs.pop(job_id, None)
        self.loaded.pop(job_id, None)
        self.bytes_by_job.pop(job_id, None)

    def load(self, job_id: str, service_id: str, tier: Tier) -> Handle:
        handle = next(self._ids)  # in the key: a job submitted again (after its service was lost) loads again
        fut = self.topology.load(service_id, job_id, tier, f"load-{self.token}-{job_id}-{handle}")
        self.loaded[job_id] = fut
        self._work[handle] = Work(fut, False, service_id, job_id)
        return handle

    def submit(self, task: NodeTask) -> Handle:
        handle = next(self._ids)
        key = f"{task.job_id}-{task.iteration}-{task.node}-{self.token}-{handle}"
        if task.service_id is None:
            inputs = {port: self._work[h].future for port, h in task.inputs.items()}
            fut = self.client.submit(
                _run_cpu_node, self.topic, handle, self.specs[task.job_id], task.iteration, task.node, inputs, 1,
                self.cpu_node_s, workers=None if task.inline else self.cpu_workers, pure=False, key=key,
            )  # fmt: skip
            ranks: list[Any] = []
        else:
            involved = {task.job_id} | {m.job_id for m in (*task.swaps, *task.prefetch)}
            after = [self.loaded[j] for j in sorted(involved) if j in self.loaded]
            ins = {p: self._work[h] for p, h in task.inputs.items()}
            parts = [self._work[h] for h in task.parts]  # earlier chunks: on this worker already
            fut, ranks = self.topology.node(task, handle, ins, parts, after, key)
        self._work[handle] = Work(fut, True, task.lane, task.job_id, task.iteration, task.node, ranks=ranks)
        return handle

    def submit_cohort(self, tasks: Sequence[NodeTask]) -> list[Handle]:
        """Co-scheduled rollouts (`planner/batches.py`): `tasks`, nodes of distinct jobs on one service, run as
        ONE task on its worker (one engine call, `services.batched.run_cohort`), after the members' loads and
        the service's previous task; the first task's swaps and prefetch are the cohort's. One handle per task,
        in order, each with its own report and its output on the worker (a later node's input, as after
        `submit`). A member whose load failed is reported not run. Worker groups refuse it (NotImplementedError)."""
        handles = [next(self._ids) for _ in tasks]
        involved = {t.job_id for t in tasks} | {m.job_id for m in (*tasks[0].swaps, *tasks[0].prefetch)}
        after = [self.loaded[j] for j in sorted(involved) if j in self.loaded]
        inputs = [{p: self._work[h] for p, h in t.inputs.items()} for t in tasks]
        first = tasks[0]
        key = f"cohort-{first.job_id}-{first.iteration}-{first.node}-{self.token}-{handles[0]}"
        futs = self.topology.cohort(tasks, handles, inputs, after, key)
        for h, t, fut in zip(handles, tasks, futs, strict=True):
            self._work[h] = Work(fut, True, t.lane, t.job_id, t.iteration, t.node)
        return handles

    def wait(self, timeout: float) -> list[Finished]:
        """Node reports arrive as events the workers publish when a node ends (no task, no fetch); loads are
        fetched; a task that failed outside its operator (its worker died) is found by its future's status."""
        deadline = time.time() + timeout
        while True:
            out, self._refused = self._refused, []
            out += self._collect_reports()
            out += self._collect_futures()
            if out or time.time() >= deadline:
                return sorted(out, key=lambda f: f.handle)  # submission order
            with contextlib.suppress(queue.Empty):  # a node report wakes this at once; loads, failures: 50 ms
                self._reports.put(self._reports.get(timeout=min(0.05, max(deadline - time.time(), 0.0))))

    def _collect_reports(self) -> list[Finished]:
        out: list[Finished] = []
        while True:
            try:
                msg = self._reports.get_nowait()
            except queue.Empty:
                return out
            work = self._work.get(msg["handle"])
            if work is None or work.reported:
                continue  # its service was lost, or the runner forgot it
            work.reported = True
            self._count(msg, work.job_id)
            fields = msg["report"]
            fields["weight_loads"] = [tuple(w) for w in fields["weight_loads"]]
            out.append(Finished(msg["handle"], NodeReport(**fields)))

    def _collect_futures(self) -> list[Finished]:
        out = []
        alive: set[str] | None = None
        for handle, work in list(self._work.items()):
            if work.reported or work.future.status == "pending":
                continue
            if work.is_node and work.future.status == "finished":
                continue  # done: its report event is on its way
            if work.future.status != "finished" and work.lane in self.worker_of:
                alive = self._alive() if alive is None else alive
                if self.worker_of[work.lane] not in alive:  # its service worker died: `lost` reports the service
                    self._next_check = 0.0
                    continue
            work.reported = True
            if not work.is_node:
                self._work.pop(handle)
            out.append(Finished(handle, self._outcome(work.future, work)))
        return out

    def _count(self, value: Any, job_id: str) -> None:
        """Bytes of what reached this process (pickled size), in all and per job ("" for none)."""
        nbytes = len(pickle.dumps(value))
        self.bytes_received += nbytes
        if job_id:
            self.bytes_by_job[job_id] = self.bytes_by_job.get(job_id, 0) + nbytes

    def _outcome(self, fut: Any, work: Work) -> Any:
        if fut.status == "finished":
            return self.fetch(fut, job_id=work.job_id)
        if fut.status == "error":
            exc = fut.exception()
        else:
            exc = RuntimeError(self.topology.why_cancelled(fut) if fut.status == "cancelled" else f"task {fut.status}")
        error = f"{type(exc).__name__}: {exc}"
        now = self.clock()
        if work.checkpoint:
            return CheckpointReport(work.job_id, work.lane, work.checkpoint, now, now, error)
        if not work.is_node:
            return LoadReport(work.job_id, work.lane, 0, now, now, error)
        return NodeReport(work.job_id, work.iteration, work.node, error, now, now)  # its worker died, say

    def lost(self) -> list[tuple[str, str]]:
        if time.time() < self._next_check:
            return []
        self._next_check = time.time() + self.poll
        alive = self._alive()
        out = []
        for sid, addr in self.worker_of.items():
            if sid in self.gone or addr in alive:
                continue
            self.gone.add(sid)
            for handle, work in list(self._work.items()):
                if work.lane == sid:
                    self._work.pop(handle)
            out.append((sid, f"worker {addr} is gone"))
        return out

    def joined(self) -> list[str]:
        """Services on GPU workers that joined after `start` (a worker the nanny restarted after a crash, a new
        machine): each gets a new service id once its service has started there (single-rank services only;
        a worker group needs all its ranks). Checked every `poll` seconds."""
        if self.client is None or not self.topology.joins:
            return []
        out = []
        for addr, (sid, fut) in list(self._starting.items()):
            if fut.status == "pending":
                continue
            del self._starting[addr]
            if fut.status == "finished":
                self.worker_of[sid] = addr
                out.append(sid)
            else:
                self._refused_workers.add(addr)  # never tried again
                log.error("could not start a service on the worker %s that joined: %s", addr, fut.exception())
        if time.time() < self._next_join:
            return out
        self._next_join = time.time() + self.poll
        gpu = self.client.run_on_scheduler(
            lambda dask_scheduler: [a for a, w in dask_scheduler.workers.items() if w.resources.get("GPU", 0) >= 1]
        )
        known = set(self.worker_of.values()) | set(self._starting) | self._refused_workers
        for addr in sorted(set(gpu) - known):
            sid = f"service-{len(self.worker_of) + len(self._starting) + len(self._refused_workers)}"
            fut = self.client.submit(
                _start_and_warm, self.key(sid), *self.start_args(),
                workers=[addr], allow_other_workers=False, pure=False, key=f"start-{self.key(sid)}",
            )  # fmt: skip
            self._starting[addr] = (sid, fut)
        return out

    def save(self, job_id: str, service_id: str, path: Path) -> Path:
        if service_id in self.gone:
            raise RuntimeError(f"service {service_id} is lost; the model of {job_id} cannot be saved")
        fut = self.topology.save(service_id, job_id, path, f"save-{self.token}-{job_id}-{next(self._ids)}")
        return Path(self.fetch(fut, 300))

    def checkpoint(self, job_id: str, service_id: str, path: Path, extra: dict[str, Any]) -> Handle:
        """A task on the service, after the job's load and the service's previous task, and before the next
        one: the same order in which the runner sent them (the topology keeps it)."""
        handle = next(self._ids)
        refused = "lost" if service_id in self.gone else None
        if refused is None:
            after = [self.loaded[job_id]] if job_id in self.loaded else []
            key = f"checkpoint-{self.token}-{job_id}-{handle}"
            try:
                fut = self.topology.checkpoint(service_id, job_id, path, extra, after, key)
            except NotImplementedError as exc:
                refused = str(exc)
        if refused is not None:
            now = self.clock()
            self._refused.append(Finished(handle, CheckpointReport(job_id, service_id, str(path), now, now, refused)))
            return handle
        self._work[handle] = Work(fut, False, service_id, job_id, checkpoint=str(path))
        return handle

    def release(self, job_id: str, service_id: str) -> None:
        self.loaded.pop(job_id, None)
        if service_id not in self.gone:
            self.topology.release(service_id, job_id, f"release-{self.token}-{job_id}-{next(self._ids)}")

    def forget(self, handles: Iterable[Handle]) -> None:
        for h in list(handles):
            work = self._work.get(h)
            if work is not None and work.reported:
                del self._work[h]  # dropping the last reference lets Dask free the output on its worker
