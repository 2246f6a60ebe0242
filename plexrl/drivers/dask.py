"""`DaskDriver`: the planner's instructions carried out on a Dask cluster.

One service per worker that has a `GPU` resource. The `Service` object (engines and job states) lives in
that worker process (a registry in this module, filled by a start-up task), so job state stays resident
there and only node inputs and outputs travel; every service task is pinned to its worker. CPU nodes are
ordinary tasks on the CPU workers. The planner runs here, in the client process, and stays pure: this
driver submits work, waits for the first result, and feeds it back as an event.

Default cluster: a local `SpecCluster` with one worker process per service (`GPU=1`, one thread) and one
CPU-pool worker process with `cpu_threads` threads. A CPU node whose observed duration is below
`inline_below` (default 10 ms, less than a task round trip) runs in the driver process instead. With
`lookahead` (default on) the planner sends a service its next node (of another job) while the current one
runs, so the service starts it without waiting for a round trip through the scheduler and this driver.
`scheduler="tcp://host:8786"` connects to an existing cluster instead (start it with `dask scheduler`,
`dask worker ADDRESS --resources GPU=1 --nthreads 1` per accelerator, and plain `dask worker ADDRESS` for
the CPU pool; see docs/architecture.md for the environment those workers need).

A service worker that disappears (process killed, machine gone) is noticed within `poll` seconds: the
planner gets `ServiceLost` and fails the jobs placed there with a message; the other jobs go on.
Not done here: recovery from checkpoints (a lost job is failed, not re-placed).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plexrl.drivers.base import Budgets, DriverBase
from plexrl.hooks.base import Hook
from plexrl.job import JobHandle
from plexrl.planner import (
    FailJob,
    IterationDone,
    JobDone,
    JobSubmitted,
    NodeFinished,
    PlaceJob,
    RunNode,
    ServiceLost,
)
from plexrl.planner.costs import CostModel
from plexrl.planner.events import Event, Instruction
from plexrl.planner.policies import OrderingPolicy, PlacementPolicy
from plexrl.planner.state import Move
from plexrl.services.service import NodeResult, Service, run_cpu_node

log = logging.getLogger(__name__)

# -- what runs inside the workers ---------------------------------------------------------------------
_SERVICES: dict[str, Service] = {}


def _start_service(key: str, device: str, validate: bool, spill_dir: str | None, threads: int | None) -> int:
    """Create the service `key` (`<driver token>/<service id>`: two drivers on one cluster never share one)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    if key in _SERVICES:
        raise RuntimeError(f"service {key} already runs in this worker")
    service_id = key.rpartition("/")[2]
    _SERVICES[key] = Service(service_id, device, spill_dir=spill_dir, validate=validate, clock=time.time)
    return os.getpid()


def _warm_up() -> None:
    """Import what every node needs once per worker, at cluster start, not inside a job's first node."""
    import importlib

    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    import plexrl.engines.torch_engine  # noqa: F401

    for name in ("data", "rollout", "verify", "advantage", "train", "evaluate", "critic", "shaping", "external"):
        importlib.import_module(f"plexrl.operators.{name}")


def _service(service_id: str) -> Service:
    try:
        return _SERVICES[service_id]
    except KeyError:
        raise RuntimeError(f"service {service_id} is not running in this worker (was the worker restarted?)") from None


def _load_job(service_id: str, job: JobHandle, tier: str) -> tuple[int, float, float]:
    start = time.time()
    nbytes = _service(service_id).load_job(job, tier)
    return nbytes, start, time.time()


def _run_service_node(
    service_id: str,
    job_id: str,
    iteration: int,
    node: str,
    inputs: dict[str, Any],
    swaps: Sequence[Move],
    prefetch: Sequence[Move],
    *loaded: int,
) -> NodeResult:
    return _service(service_id).run_node(job_id, iteration, node, inputs, swaps, prefetch)


def _run_cpu_node(job: JobHandle, iteration: int, node: str, inputs: dict[str, Any], threads: int) -> NodeResult:
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return run_cpu_node(job, iteration, node, inputs, time.time)


def _save_model(service_id: str, job_id: str, path: str) -> str:
    return str(_service(service_id).save_model(job_id, Path(path)))


def _release(service_id: str, job_id: str) -> None:
    if service_id in _SERVICES:
        _SERVICES[service_id].release(job_id)


def _stop_service(service_id: str) -> dict[str, Any]:
    svc = _SERVICES.pop(service_id, None)
    if svc is None:
        return {}
    report = svc.report()
    svc.close()
    return report


# -- the driver ---------------------------------------------------------------------------------------
_SEQ = itertools.count()


@dataclass(slots=True)
class _Pending:
    kind: str  # "node" | "load"
    job_id: str
    lane: str
    iteration: int = 0
    node: str = ""
    seq: int = field(default_factory=lambda: next(_SEQ))  # submission order


class DaskDriver(DriverBase):
    def __init__(
        self,
        *,
        services: int = 1,
        cpu_threads: int = 2,
        service_threads: int | None = None,
        scheduler: str | None = None,
        hooks: list[Hook] | None = None,
        placement: PlacementPolicy | None = None,
        ordering: OrderingPolicy | None = None,
        device: str = "cpu",
        validate: bool = True,
        budgets: Budgets | None = None,
        costs: CostModel | None = None,
        spill_dir: str | Path | None = None,
        poll: float = 0.5,
        inline_below: float = 0.01,
        lookahead: bool = True,
    ) -> None:
        super().__init__(
            hooks=hooks, placement=placement, ordering=ordering, clock=time.time, validate=validate,
            budgets=budgets, costs=costs, lookahead=lookahead,
        )  # fmt: skip
        self.n_services, self.cpu_threads, self.service_threads = services, cpu_threads, service_threads
        self.scheduler, self.device, self.validate, self.poll = scheduler, device, validate, poll
        self.spill_dir = str(spill_dir) if spill_dir is not None else None
        self.inline_below = inline_below
        self.worker_of: dict[str, str] = {}  # service id -> worker address
        self.service_reports: dict[str, dict[str, Any]] = {}
        self._inflight: dict[Any, _Pending] = {}
        self._last_on: dict[str, Any] = {}  # service -> its latest task: the next one depends on it (order)
        self._loaded: dict[str, Any] = {}  # job -> future of its load on its service
        self._job_futures: dict[str, Any] = {}  # job -> scattered JobHandle
        self.client: Any = None
        self.cluster: Any = None
        self.token = uuid.uuid4().hex[:8]  # names this driver's services inside the workers

    def run(self, jobs: list[JobHandle]) -> list[JobHandle]:
        """Start (or connect to) the cluster, run `jobs` to completion, shut down what was started here."""
        self._register(jobs)
        try:
            self._connect()
            events: deque[Event] = deque(self.budgets.joined(s) for s in self.worker_of)
            for job in jobs:
                self._job_futures[job.job_id] = self.client.scatter(job, broadcast=True, hash=False)
                events.append(JobSubmitted(job.job_id, job.plan()))
            self.hooks.on_start(self.clock())
            self._loop(events)
        except BaseException as exc:
            self._close_open_jobs(exc)
            raise
        finally:
            self.hooks.close()
            self._shutdown()
        return jobs

    # -- cluster ------------------------------------------------------------------------------------
    def _connect(self) -> None:
        import dask
        from distributed import Client, Nanny, Scheduler, SpecCluster

        if not logging.getLogger().isEnabledFor(logging.INFO):
            logging.getLogger("distributed").setLevel(logging.ERROR)  # no INFO chatter on start and stop
        if self.scheduler is None:
            # Dask's nanny exports MALLOC_TRIM_THRESHOLD_ to its workers; glibc then stops adapting its mmap
            # threshold and every tensor allocation >= 128 KiB becomes an mmap + page faults: torch on CPU
            # ran 2.2x slower in a worker than in a plain process (measured). Spawn workers without it.
            dask.config.set({"distributed.nanny.pre-spawn-environ": {}})
            workers: dict[str, Any] = {
                f"service-{i}": {
                    "cls": Nanny,
                    "options": {
                        "nthreads": 1,
                        "resources": {"GPU": 1},
                        "memory_limit": 0,
                        "name": f"service-{i}",
                        "silence_logs": logging.ERROR,
                    },
                }
                for i in range(self.n_services)
            }
            workers["cpu-0"] = {
                "cls": Nanny,
                "options": {
                    "nthreads": self.cpu_threads,
                    "memory_limit": 0,
                    "name": "cpu-0",
                    "silence_logs": logging.ERROR,
                },
            }
            scheduler = {"cls": Scheduler, "options": {"dashboard_address": None}}
            self.cluster = SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR)
            self.client = Client(self.cluster)
        else:
            self.client = Client(self.scheduler)
        self.client.wait_for_workers(1, timeout=120)
        info = self.client.scheduler_info()["workers"]
        gpu = sorted((w.get("name", a), a) for a, w in info.items() if w.get("resources", {}).get("GPU", 0) >= 1)
        if not gpu:
            raise RuntimeError(
                "the Dask cluster has no worker with a GPU resource; start service workers with "
                "`dask worker ADDRESS --resources GPU=1 --nthreads 1`"
            )
        self.cpu_workers = [a for a, w in info.items() if not w.get("resources", {}).get("GPU")]
        if not self.cpu_workers:
            raise RuntimeError("the Dask cluster has no CPU-pool worker (a worker without a GPU resource); start one")
        for i, (_, addr) in enumerate(gpu):
            sid = f"service-{i}"
            self.worker_of[sid] = addr
        futs = [
            self.client.submit(
                _start_service, self._key(sid), self.device, self.validate, self.spill_dir, self.service_threads,
                workers=[addr], allow_other_workers=False, pure=False, key=f"start-{self._key(sid)}",
            )
            for sid, addr in self.worker_of.items()
        ]  # fmt: skip
        self.client.gather(futs)
        self.client.run(_warm_up)

    def _shutdown(self) -> None:
        if self.client is None:
            return
        try:
            for fut in list(self._inflight):
                fut.cancel()
            alive = self._alive()
            futs = {
                sid: self.client.submit(
                    _stop_service, self._key(sid), workers=[a], allow_other_workers=False, pure=False
                )
                for sid, a in self.worker_of.items()
                if a in alive
            }
            for sid, fut in futs.items():
                try:
                    self.service_reports[sid] = fut.result(timeout=60)
                except Exception:
                    log.exception("could not stop service %s cleanly", sid)
        finally:
            self.client.close()
            if self.cluster is not None:
                self.cluster.close()

    def _key(self, service_id: str) -> str:
        return f"{self.token}/{service_id}"

    def _alive(self) -> set[str]:
        """Worker addresses the scheduler knows now (asked, not the client's periodically refreshed cache)."""
        return set(self.client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.workers)))

    def _lost(self) -> list[str]:
        alive = self._alive()
        return [sid for sid, addr in self.worker_of.items() if addr not in alive]

    # -- the loop -----------------------------------------------------------------------------------
    def _loop(self, events: deque[Event]) -> None:
        from distributed import wait
        from distributed.client import FuturesCancelledError

        lost: set[str] = set()
        next_check = time.time() + self.poll
        while True:
            events.extend(self._take_cancels())
            while events:
                for ins in self.planner.handle(events.popleft()):
                    ev = self._carry_out(ins)
                    if ev is not None:
                        events.append(ev)
            if not self._inflight:
                if self.planner.finished:
                    return
                if not self._cancels:
                    raise RuntimeError("nothing is running but jobs are unfinished (driver bug)")
                continue
            cancelled = False
            try:
                done = wait(list(self._inflight), timeout=self.poll, return_when="FIRST_COMPLETED").done
            except TimeoutError:
                done = set()
            except FuturesCancelledError:  # e.g. the scheduler forgot a task whose worker died
                done, cancelled = {f for f in self._inflight if f.status == "cancelled"}, True
            if time.time() >= next_check or not done or cancelled:
                next_check = time.time() + self.poll
                for sid in self._lost():
                    if sid in lost:
                        continue
                    lost.add(sid)
                    log.error("service %s lost (worker %s gone)", sid, self.worker_of[sid])
                    for fut, p in list(self._inflight.items()):
                        if p.lane == sid:
                            del self._inflight[fut]
                    events.append(ServiceLost(sid, f"worker {self.worker_of[sid]} is gone"))
            # after the liveness check (a lost service's futures are already dropped), in submission order:
            # a service's results must reach the planner in the order its nodes were sent
            ordered = sorted((f for f in done if f in self._inflight), key=lambda f: self._inflight[f].seq)
            for fut in ordered:
                ev = self._collect(fut)
                if ev is not None:
                    events.append(ev)

    def _collect(self, fut: Any) -> Event | None:
        p = self._inflight.pop(fut, None)
        if p is None:
            return None
        job = self.jobs[p.job_id]
        if fut.status != "finished":
            exc = fut.exception() if fut.status == "error" else RuntimeError(f"task {fut.status}")
            if p.kind == "load":
                return self._fail(job, f"loading the job on {p.lane}", exc)
            now = self.clock()
            self.hooks.after_node(job, p.iteration, p.node, p.lane, now, now, None)
            error = f"{type(exc).__name__}: {exc}"
            return NodeFinished(job.job_id, p.iteration, p.node, ok=False, error=error)
        if p.kind == "load":
            nbytes, start, end = fut.result()
            self.hooks.on_swap(job, p.lane, start, end, nbytes)  # the service spent this time loading the job
            return None
        res: NodeResult = fut.result()
        return self._node_done(job, res, p.lane)

    def _carry_out(self, ins: Instruction) -> Event | None:
        if ins.job_id in self.failing and not isinstance(ins, FailJob):
            return None
        job = self.jobs[ins.job_id]
        if isinstance(ins, RunNode):
            return self._submit_node(job, ins)
        if isinstance(ins, PlaceJob):
            self._start_job(job, ins.service_id)
            addr = self.worker_of[ins.service_id]
            fut = self.client.submit(
                _load_job, self._key(ins.service_id), self._job_futures[job.job_id], ins.tier,
                workers=[addr], allow_other_workers=False, pure=False, key=f"load-{self.token}-{job.job_id}",
            )  # fmt: skip
            self._loaded[job.job_id] = fut
            self._inflight[fut] = _Pending("load", job.job_id, ins.service_id)
        elif isinstance(ins, IterationDone):
            return self._end_iteration(job, ins.iteration)
        elif isinstance(ins, JobDone):
            self._end_job(job, "done", "", ins.service_id)
        elif isinstance(ins, FailJob):
            self.failing.discard(job.job_id)
            self._end_job(job, "cancelled" if ins.cancelled else "failed", ins.reason, ins.service_id)
        return None

    def _submit_node(self, job: JobHandle, ins: RunNode) -> NodeFinished | None:
        lane = ins.service_id or "cpu"
        self._node_started(job, ins.iteration, ins.node, lane, self.clock())
        inputs = self._inputs(job, ins.node)
        key = f"{job.job_id}-{ins.iteration}-{ins.node}-{time.monotonic_ns()}"
        costs = self.planner.costs
        tiny = (
            job.graph.node(ins.node).operator.inline
            and costs.observed(job.job_id, ins.node)
            and costs.predict(job.job_id, ins.node) < self.inline_below
        )
        if ins.service_id is None and tiny:
            # a CPU node that took less than a task round trip: run it here, as Dask inlines tiny tasks
            return self._node_done(job, run_cpu_node(job, ins.iteration, ins.node, inputs, self.clock), lane)
        if ins.service_id is None:
            fut = self.client.submit(
                _run_cpu_node, self._job_futures[job.job_id], ins.iteration, ins.node, inputs, 1,
                workers=self.cpu_workers, pure=False, key=key,
            )  # fmt: skip
        else:
            involved = {job.job_id} | {m.job_id for m in (*ins.swaps, *ins.prefetch)}
            deps = [self._loaded[j] for j in sorted(involved) if j in self._loaded]
            previous = self._last_on.get(ins.service_id)
            if previous is not None and previous in self._inflight:
                deps.append(previous)  # with lookahead, the service runs its nodes in the order they were sent
            fut = self.client.submit(
                _run_service_node, self._key(ins.service_id), job.job_id, ins.iteration, ins.node, inputs,
                ins.swaps, ins.prefetch, *deps,
                workers=[self.worker_of[ins.service_id]], allow_other_workers=False, pure=False, key=key,
            )  # fmt: skip
            self._last_on[ins.service_id] = fut
        self._inflight[fut] = _Pending("node", job.job_id, lane, ins.iteration, ins.node)
        return None

    def _end_job(self, job: JobHandle, status: str, reason: str, service_id: str | None) -> None:
        sid = service_id or ""
        alive = sid in self.worker_of and sid not in self._lost()
        if status == "done" and alive and job.config.tracking.log_model:
            try:
                path = job.run_dir / "jobs" / job.job_id / "model"
                fut = self.client.submit(
                    _save_model, self._key(sid), job.job_id, str(path),
                    workers=[self.worker_of[sid]], allow_other_workers=False, pure=False,
                )  # fmt: skip
                job.artifacts["model"] = Path(fut.result(timeout=300))
            except Exception:
                log.exception("could not save the final model of job %s", job.job_id)
        self._close(job, status, reason)
        if alive:
            self.client.submit(
                _release, self._key(sid), job.job_id,
                workers=[self.worker_of[sid]], allow_other_workers=False, pure=False,
            )  # fmt: skip
        self._loaded.pop(job.job_id, None)
