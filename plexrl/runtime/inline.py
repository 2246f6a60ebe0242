"""`InlineExecutor`: in-process and synchronous. Each node runs the moment it is submitted, on a `Service` in
this process (service nodes) or here (cpu nodes); its output stays in a dict keyed by its handle until the
runner forgets it. Results are deterministic; `plexrl run JOB.yaml` and the tests use it. It is also the
fastest way to run one job alone: no scheduler, no round trips, no copies of a batch.

Concurrency: the executor is driven by ONE thread (the runner's). A server also builds models on its
preparation threads in the same process, so every load and every service node runs under
`plexrl.job.construction.model_construction()` (transformers' model init patches process-global state; a service node
may build a model too: a critic, a vLLM engine). Errors are returned in reports, never raised: a job whose
load failed gets an error report for each node sent to it, and nothing of it runs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from plexrl.job.construction import model_construction
from plexrl.planner.state import Tier
from plexrl.runtime.executor import CheckpointReport, Finished, Handle, LoadReport, NodeReport, NodeTask


class InlineExecutor:
    def __init__(
        self,
        *,
        services: int = 1,
        device: str = "cpu",
        validate: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        spill_dir: str | Path | None = None,
        devices: list[str] | None = None,
        host_memory: int | None = None,
        cpu_node_s: float | None = None,
    ) -> None:
        """`devices`: the torch device of each service (`plexrl.devices.inline_devices`: one GPU each on CUDA);
        None: every service on `device`; `host_memory`: each service's host tier (its host pool stays within it);
        `cpu_node_s`: run each CPU node in a worker process, killed past this many seconds (a server's
        `limits.max_cpu_node_s`: `runtime/cpu_nodes.py`); None: here, in this thread."""
        self.clock = clock
        self.cpu_node_s = cpu_node_s
        self.host_memory = host_memory
        self.n_services, self.device, self.validate, self.spill_dir = services, device, validate, spill_dir
        self.devices = list(devices) if devices is not None else [device] * services
        if len(self.devices) != services:
            raise ValueError(f"{services} services need {services} devices, got {self.devices}")
        self.services: dict[str, Any] = {}
        self.specs: dict[str, Any] = {}
        self.outputs: dict[Handle, Any] = {}
        self._done: list[Finished] = []
        self._ids = itertools.count()
        self._load_failed: dict[tuple[str, str], str] = {}  # (job, service) -> why its load failed

    def start(self) -> list[str]:
        from plexrl.services.service import Service

        for i in range(self.n_services):
            sid = f"service-{i}"
            spill = Path(self.spill_dir) / sid if self.spill_dir is not None else None
            dev = self.devices[i]
            self.services[sid] = Service(
                sid, dev, spill_dir=spill, validate=self.validate, clock=self.clock, host_memory=self.host_memory
            )
        return list(self.services)

    def ship(self, spec: Any) -> None:
        self.specs[spec.job_id] = spec

    def unship(self, job_id: str) -> None:
        self.specs.pop(job_id, None)
        if self.cpu_node_s is not None:
            from plexrl.runtime.cpu_nodes import POOL

            POOL.forget(job_id)
        for key in [k for k in self._load_failed if k[0] == job_id]:
            del self._load_failed[key]

    def load(self, job_id: str, service_id: str, tier: Tier) -> Handle:
        handle = next(self._ids)
        start = self.clock()
        self._load_failed.pop((job_id, service_id), None)
        try:
            with model_construction():
                nbytes = self.services[service_id].load_job(self.specs[job_id], tier)
            report = LoadReport(job_id, service_id, nbytes, start, self.clock())
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self._load_failed[job_id, service_id] = error
            report = LoadReport(job_id, service_id, 0, start, self.clock(), error)
        self._done.append(Finished(handle, report))
        return handle

    def submit(self, task: NodeTask) -> Handle:
        from plexrl.services.service import run_cpu_node

        handle = next(self._ids)
        failed = self._load_failed.get((task.job_id, task.service_id)) if task.service_id is not None else None
        if failed is not None:  # the planner sent it before the runner saw the failed load
            self._not_run(handle, task, f"loading the job on {task.service_id} failed ({failed})")
            return handle
        try:
            inputs = {port: self.outputs[h] for port, h in task.inputs.items()}
            if task.service_id is None and self.cpu_node_s is not None:
                from plexrl.runtime.cpu_nodes import run_bounded

                spec = self.specs[task.job_id]
                res = run_bounded(spec, task.iteration, task.node, inputs, self.clock, self.cpu_node_s)
            elif task.service_id is None:
                res = run_cpu_node(self.specs[task.job_id], task.iteration, task.node, inputs, self.clock)
            else:
                svc = self.services[task.service_id]
                parts = [self.outputs[h] for h in task.parts]
                with model_construction():
                    res = svc.run_node(task.job_id, task.iteration, task.node, inputs, task.swaps, task.prefetch,
                                       task.chunk, task.chunks, parts, call=task.call)  # fmt: skip
        except Exception as exc:  # (the node's own errors come back in its report; this is anything else)
            now = self.clock()
            error = f"{type(exc).__name__}: {exc}"
            self._done.append(Finished(handle, NodeReport(task.job_id, task.iteration, task.node, error, now, now)))
            return handle
        if res.output is not None:
            self.outputs[handle] = res.output
        self._done.append(Finished(handle, res.report))
        return handle

    def submit_cohort(self, tasks: Sequence[NodeTask]) -> list[Handle]:
        """Co-scheduled rollouts (`planner/batches.py`): `tasks`, nodes of distinct jobs on one service, run in
        ONE engine call (`services.batched.run_cohort`); the first task's swaps and prefetch are the cohort's. One
        handle and one report per task, in order. A member whose load failed is reported not run."""
        from plexrl.services.batched import Member, run_cohort

        handles = [next(self._ids) for _ in tasks]
        sid = tasks[0].service_id
        assert sid is not None
        svc = self.services[sid]
        members, mine = [], []
        for h, t in zip(handles, tasks, strict=True):
            failed = self._load_failed.get((t.job_id, sid))
            if failed is not None:
                now = self.clock()
                self._done.append(Finished(h, NodeReport(t.job_id, t.iteration, t.node,
                                                         f"not run: loading the job on {sid} failed ({failed})", now,
                                                         now)))  # fmt: skip
                continue
            members.append(Member(t.job_id, t.iteration, t.node, {p: self.outputs[i] for p, i in t.inputs.items()},
                                  t.call))  # fmt: skip
            mine.append(h)
        if not members:  # (their moves still happen: the planner counts on them)
            svc.apply(tasks[0].swaps)
            return handles
        try:
            with model_construction():
                results = run_cohort(svc, members, tasks[0].swaps, tasks[0].prefetch)
        except Exception as exc:  # (the nodes' own errors come back in their reports; this is anything else)
            now = self.clock()
            error = f"{type(exc).__name__}: {exc}"
            for h, m in zip(mine, members, strict=True):
                self._done.append(Finished(h, NodeReport(m.job_id, m.iteration, m.node, error, now, now)))
            return handles
        for h, res in zip(mine, results, strict=True):
            if res.output is not None:
                self.outputs[h] = res.output
            self._done.append(Finished(h, res.report))
        return handles

    def _not_run(self, handle: Handle, task: NodeTask, why: str) -> None:
        """Report `task` failed without running it. The other jobs' moves that came with it still happen (the
        planner counts on them: it put their states where those moves take them); the job's own do not."""
        assert task.service_id is not None
        svc = self.services[task.service_id]
        start = self.clock()
        error = f"not run: {why}"
        try:
            moved = svc.apply([m for m in task.swaps if m.job_id != task.job_id])
            prefetch = [m for m in task.prefetch if m.job_id != task.job_id]
            if prefetch:
                svc.background.queue(prefetch)
        except Exception as exc:
            moved, error = 0, f"{error}; the other jobs' moves sent with it failed: {type(exc).__name__}: {exc}"
        now = self.clock()
        report = NodeReport(task.job_id, task.iteration, task.node, error, now, now, start, now, moved)
        self._done.append(Finished(handle, report))

    def wait(self, timeout: float) -> list[Finished]:
        """Everything finished since the last call (work runs inside `submit`). With nothing finished, nothing
        can finish later either: block for `timeout` (the runner waits so only for a job's arrival)."""
        done, self._done = self._done, []
        if not done and timeout > 0:
            time.sleep(timeout)
        return done

    def lost(self) -> list[tuple[str, str]]:
        return []

    def joined(self) -> list[str]:
        return []

    def save(self, job_id: str, service_id: str, path: Path) -> Path:
        return Path(self.services[service_id].save_model(job_id, path))

    def checkpoint(self, job_id: str, service_id: str, path: Path, extra: dict[str, Any]) -> Handle:
        """Save the job's engine state and `extra` to `path` atomically (`Service.checkpoint`), now."""
        handle = next(self._ids)
        start = self.clock()
        try:
            where = str(self.services[service_id].checkpoint(job_id, Path(path), extra))
            report = CheckpointReport(job_id, service_id, where, start, self.clock())
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            report = CheckpointReport(job_id, service_id, str(path), start, self.clock(), error)
        self._done.append(Finished(handle, report))
        return handle

    def release(self, job_id: str, service_id: str) -> None:
        self._load_failed.pop((job_id, service_id), None)
        self.services[service_id].release(job_id)

    def forget(self, handles: Iterable[Handle]) -> None:
        for h in list(handles):
            self.outputs.pop(h, None)

    def close(self) -> dict[str, dict[str, Any]]:
        reports = {}
        for sid, svc in self.services.items():
            reports[sid] = svc.report()
            svc.close()
        self.outputs.clear()
        return reports
