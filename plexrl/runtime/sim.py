"""`SimExecutor`: the runner's work on a VIRTUAL clock, with durations from a cost model. No torch, no Dask,
nothing sleeps: the same `Runner` and planner as a real run, on as many simulated services as asked.

Contract (what it models):
- A service runs one unit of work at a time, in the order the runner submitted it: a job's load, then
  nodes. A node sent while its service is busy (the planner's lookahead) starts when the previous one ends.
- Before a node, its `swaps` run in order, each `costs.swap_seconds(move.nbytes)`, after every prefetch
  queued before them has landed (the real service's barrier, `BackgroundMoves.wait_all`). The node then
  waits for its own job's unfinished prefetch. All of that is the node's swap time (`swap_start`..`swap_end`,
  `swap_bytes`), as the real `Service` reports it; `measured` holds `job_id -> move.nbytes` for each swap
  whose source is device.
- `prefetch` moves start in the background when the node starts, on one prefetch channel per service (one
  batch after another, like the service's single prefetch thread), and land together at the batch's end.
- CPU nodes run concurrently on a pool of `cpu_slots` slots (None: unlimited), first come first served.
- Nodes in a job's `dedicated` set are cpu nodes to the planner but run on accelerators the job owns alone
  (the rollout of a split deployment): one after another on the job's own lane, outside the CPU pool;
  their time is counted per job (`dedicated_busy`).
- Loads take `costs.load_seconds(job, nbytes)` on the job's service and occupy it.
- A node in a job's `slice_s` (decode-step preemption) runs its drawn time in slices of at most that many
  seconds: each slice but the last is reported `paused` (no output), and the next slice, sent again by the
  planner, runs what is left.
- `wait` advances the clock to the earliest completion and returns everything that ends at that instant,
  in submission order. `failures` (service id -> virtual time) lose services: work that ends at or before
  that time is still returned; the rest on that service is dropped, never returned, and `lost()` names the
  service once. Work submitted to a lost service is dropped too.
- A move from a tier the job is not in (as this executor tracks it) fails the node with `swap failed`,
  as the real service does: a cheap check that the planner's moves are consistent.

- `dispatch=(cpu, service)`: seconds from submit until a node can start (a real driver's round trip, fitted
  by `plexrl.sim.calibrate`), each a constant or samples drawn with `seed`; a service node sent ahead to a
  busy service starts when the service frees up.

Jobs may arrive late (`Runner.run(..., arrivals=...)`): `wait` honours the runner's timeout, so the clock
stops at each arrival.

What it does NOT model: contention between a prefetch and a blocking swap or between services (every move
runs at full `swap_seconds`), the runner's own time (it does not advance the clock), data transfer between
nodes, state growth (a job's size is the `state_bytes` it was submitted with), node errors other than
inconsistent moves, and memory of the CPU pool. Outputs are not kept: `inputs` of a task are ignored.

The simulated jobs (`SimJob`), the cost models (`SimCosts`, `SeededCosts`) and the synthetic GRPO-like
workload live in `sim_jobs.py` (importable from here too).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plexrl.planner.state import Tier
from plexrl.runtime.executor import CheckpointReport, Finished, Handle, LoadReport, NodeReport, NodeTask
from plexrl.runtime.sim_jobs import GB, GRPO_ORDER, SeededCosts, SimCosts, SimJob, grpo_like_jobs, grpo_nodes


# -- the executor -------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Service:
    """One simulated service: when its work queue and its prefetch channel are free, where each of its jobs'
    states is, when each in-flight prefetch lands, and its statistics."""

    service_id: str
    fail_at: float = math.inf
    alive: bool = True
    free_at: float = 0.0
    prefetch_free_at: float = 0.0
    tier: dict[str, Tier] = field(default_factory=dict)
    landing: dict[str, float] = field(default_factory=dict)  # job -> end of its in-flight prefetch
    busy_seconds: float = 0.0
    blocking_seconds: float = 0.0
    prefetch_seconds: float = 0.0
    prefetch_wait_seconds: float = 0.0
    load_seconds: float = 0.0
    bytes_moved: int = 0
    moves: int = 0
    nodes: int = 0
    loads: int = 0
    per_tier: dict[str, int] = field(default_factory=dict)

    def move(self, job_id: str, src: Tier, dst: Tier, nbytes: int) -> str | None:
        """Record a move; the error of an inconsistent one (the job is not in `src`)."""
        where = self.tier.get(job_id)
        if where != src:
            return f"job {job_id}: the planner moves it from {src} but it is on {where} (service {self.service_id})"
        self.tier[job_id] = dst
        self.bytes_moved += nbytes
        self.moves += 1
        self.per_tier[dst] = self.per_tier.get(dst, 0) + nbytes
        return None

    def report(self) -> dict[str, Any]:
        return {
            "service": self.service_id,
            "device": "sim",
            "alive": self.alive,
            "busy_seconds": self.busy_seconds,
            "blocking_swap_seconds": self.blocking_seconds,
            "prefetch_seconds": self.prefetch_seconds,
            "prefetch_wait_seconds": self.prefetch_wait_seconds,
            "load_seconds": self.load_seconds,
            "bytes_moved": self.bytes_moved,
            "moves": self.moves,
            "bytes_to_tier": dict(self.per_tier),
            "nodes": self.nodes,
            "loads": self.loads,
        }


class SimExecutor:
    """An `Executor` on a virtual clock; see the module docstring. Services are `service-0`, `service-1`, ...
    (`services` of them); `failures` maps some of them to the virtual time at which they are lost."""

    poll = math.inf  # the runner's default wait: the clock moves only to the next event

    def __init__(
        self,
        services: int,
        costs: SimCosts,
        *,
        cpu_slots: int | None = None,
        failures: Mapping[str, float] | None = None,
        dispatch: tuple[float | Sequence[float], float | Sequence[float]] = (0.0, 0.0),
        seed: int = 0,
    ) -> None:
        if services < 1:
            raise ValueError(f"services={services}: a simulation needs at least one service")
        if cpu_slots is not None and cpu_slots < 1:
            raise ValueError(f"cpu_slots={cpu_slots}: give at least one slot, or None for unlimited")
        self.costs = costs
        self.now = 0.0
        self.clock: Callable[[], float] = self._clock
        self.services = {f"service-{i}": _Service(f"service-{i}") for i in range(services)}
        unknown = sorted(set(failures or {}) - set(self.services))
        if unknown:
            raise ValueError(f"failures name unknown services {unknown}; the services are service-0..{services - 1}")
        for sid, t in (failures or {}).items():
            self.services[sid].fail_at = t
        self._doomed = [self.services[sid] for sid in sorted(failures or {})]  # services that will fail
        self.cpu_slots = cpu_slots
        # (cpu, service) seconds from submit until a node can start: a real driver's round trip, constant or
        # drawn (seeded, in submission order) from observed samples. A service node sent ahead (lookahead) to
        # a busy service hides it: it starts when the service frees up
        self._dispatch = dispatch
        self._rng = random.Random(seed)
        self.specs: dict[str, SimJob] = {}
        self._slots: list[float] = [0.0] * cpu_slots if cpu_slots is not None else []
        self._heap: list[tuple[float, Handle, str, Finished]] = []  # (end, handle, lane, finished)
        self._lost: list[tuple[str, str]] = []
        self._ids = itertools.count()
        self._lane_free: dict[str, float] = {}  # job -> when its dedicated lane is free
        self.dedicated_busy: dict[str, float] = {}  # job -> seconds its dedicated nodes ran
        self._left: dict[tuple[str, int, str, int], float] = {}  # a paused sliced node -> its seconds left

    def _clock(self) -> float:
        return self.now

    # -- the Executor interface -------------------------------------------------------------------------
    def start(self) -> list[str]:
        return list(self.services)

    def ship(self, spec: Any) -> None:
        self.specs[spec.job_id] = spec

    def unship(self, job_id: str) -> None:
        self.specs.pop(job_id, None)
        self._lane_free.pop(job_id, None)

    def load(self, job_id: str, service_id: str, tier: Tier) -> Handle:
        handle = next(self._ids)
        svc = self.services[service_id]
        if not svc.alive:
            return handle  # lost with its service
        job = self.specs[job_id]
        start = max(self.now, svc.free_at)
        end = start + self.costs.load_seconds(job, job.state_bytes)
        svc.free_at = end
        svc.tier[job_id] = tier
        svc.loads += 1
        svc.load_seconds += end - start
        self._push(end, handle, service_id, LoadReport(job_id, service_id, job.state_bytes, start, end))
        return handle

    def submit(self, task: NodeTask) -> Handle:
        handle = next(self._ids)
        job = self.specs[task.job_id]
        if task.service_id is None and task.node in job.dedicated:
            start = max(self.now, self._lane_free.get(task.job_id, 0.0))
            end = start + self.costs.duration(job, task.iteration, task.node)
            self._lane_free[task.job_id] = end
            self.dedicated_busy[task.job_id] = self.dedicated_busy.get(task.job_id, 0.0) + (end - start)
            self._push(end, handle, "cpu", NodeReport(task.job_id, task.iteration, task.node, None, start, end))
            return handle
        if task.service_id is None:
            start = self.now + self._draw(0)
            if self.cpu_slots is not None:
                start = max(start, heapq.heappop(self._slots))
            end = start + self.costs.duration(job, task.iteration, task.node)
            if self.cpu_slots is not None:
                heapq.heappush(self._slots, end)
            self._push(end, handle, "cpu", NodeReport(task.job_id, task.iteration, task.node, None, start, end))
            return handle
        svc = self.services[task.service_id]
        if svc.alive:
            end, report = self._run_on(svc, task, job)
            self._push(end, handle, task.service_id, report)
        return handle

    def _run_on(self, svc: _Service, task: NodeTask, job: SimJob) -> tuple[float, NodeReport]:
        """Schedule one service node after the service's earlier work: swaps, then the node; its prefetch
        starts with it. Returns (end, report)."""
        swap_start = t = max(self.now + self._draw(1), svc.free_at)
        if task.swaps and svc.prefetch_free_at > t:  # blocking swaps follow the moves queued before them
            svc.prefetch_wait_seconds += svc.prefetch_free_at - t
            t = svc.prefetch_free_at
        moved, error = 0, None
        for m in task.swaps:
            t = self._wait_prefetch(svc, m.job_id, t)
            error = svc.move(m.job_id, m.src, m.dst, m.nbytes)
            if error is not None:
                break
            t += self.costs.swap_seconds(m.nbytes)
            moved += m.nbytes
        measured = {m.job_id: m.nbytes for m in task.swaps if m.src == "device"}
        if error is None:
            t = self._wait_prefetch(svc, task.job_id, t)
            if svc.tier.get(task.job_id) != "device":
                error = f"job {task.job_id} is on {svc.tier.get(task.job_id)}, not device, at run time"
        svc.blocking_seconds += t - swap_start
        if error is not None:
            svc.free_at = t
            report = NodeReport(task.job_id, task.iteration, task.node, f"swap failed: {error}", t, t,
                                   swap_start, t, moved, measured=measured)  # fmt: skip
            return t, report
        run = self.costs.duration(job, task.iteration, task.node) / task.chunks  # chunks share the node's time
        cap, paused = job.slice_s.get(task.node), False
        if cap is not None:  # a sliced node: what is left of it, at most `cap` seconds of it now
            key = (task.job_id, task.iteration, task.node, task.chunk)
            left = self._left.pop(key, run)
            run, paused = min(left, cap), left > cap * (1 + 1e-9)  # (no sliver of a slice at the end)
            if paused:
                self._left[key] = left - cap
        end = t + run
        svc.free_at = end
        svc.busy_seconds += end - t
        svc.nodes += 1
        if task.prefetch:
            self._prefetch(svc, task, t)
        report = NodeReport(task.job_id, task.iteration, task.node, None, t, end, swap_start, t, moved,
                               measured=measured, paused=paused)  # fmt: skip
        return end, report

    def _draw(self, which: int) -> float:
        d = self._dispatch[which]
        if isinstance(d, int | float):
            return float(d)
        return self._rng.choice(d) if d else 0.0

    def _wait_prefetch(self, svc: _Service, job_id: str, t: float) -> float:
        """When `job_id`'s in-flight prefetch (if any) has landed, from time `t`."""
        landing = svc.landing.pop(job_id, None)
        if landing is None or landing <= t:
            return t
        svc.prefetch_wait_seconds += landing - t
        return landing

    def _prefetch(self, svc: _Service, task: NodeTask, start: float) -> None:
        t = max(start, svc.prefetch_free_at)  # one batch after another (earlier batches have landed by then)
        t0 = t
        for m in task.prefetch:
            svc.landing.pop(m.job_id, None)
            if svc.move(m.job_id, m.src, m.dst, m.nbytes) is not None:
                break  # the real service's prefetch would raise; its node's swap check then fails the job
            t += self.costs.swap_seconds(m.nbytes)
        for m in task.prefetch:
            svc.landing[m.job_id] = t
        svc.prefetch_free_at = t
        svc.prefetch_seconds += t - t0

    def _push(self, end: float, handle: Handle, lane: str, report: Any) -> None:
        heapq.heappush(self._heap, (end, handle, lane, Finished(handle, report)))

    def wait(self, timeout: float) -> list[Finished]:
        """Advance the clock to the next event: the earliest completion, a service's failure before it, or
        `now + timeout` if that comes first (the runner passes a finite timeout only to wake for a job's
        arrival: `poll` is infinite). Raises when nothing is in flight and the timeout is infinite (the
        runner would otherwise wait forever)."""
        heap = self._heap
        while heap and not self._alive(heap[0][2]):
            heapq.heappop(heap)  # dropped with its service
        nxt = heap[0][0] if heap else math.inf
        wake = self.now + timeout
        doomed = self._doomed
        if wake < nxt and not any(s.alive and s.fail_at <= wake for s in doomed):
            self.now = wake
            return []
        failing = [s for s in doomed if s.alive and s.fail_at < nxt]
        if failing:
            first = min(s.fail_at for s in failing)
            self.now = max(self.now, first)
            for svc in failing:
                if svc.fail_at == first:
                    svc.alive = False
                    self._lost.append((svc.service_id, f"simulated failure at t={first:g}"))
            return []
        if not heap:
            raise RuntimeError("SimExecutor.wait: nothing is in flight, so nothing can ever finish (runner bug)")
        self.now = max(self.now, nxt)
        out = []
        while heap and heap[0][0] == nxt:
            _, _, lane, finished = heapq.heappop(heap)
            if self._alive(lane):
                out.append(finished)
        return out

    def _alive(self, lane: str) -> bool:
        return lane == "cpu" or self.services[lane].alive

    def lost(self) -> list[tuple[str, str]]:
        out, self._lost = self._lost, []
        return out

    def joined(self) -> list[str]:
        """No service joins a simulation after its start."""
        return []

    def save(self, job_id: str, service_id: str, path: Path) -> Path:
        """Writes nothing: a simulated job has no weights."""
        return path

    def checkpoint(self, job_id: str, service_id: str, path: Path, extra: dict[str, Any]) -> Handle:
        """Writes nothing: the service is busy for the time a write of the job's state at swap speed takes
        (after its earlier work, like a real checkpoint task); the report names `path`."""
        handle = next(self._ids)
        svc = self.services[service_id]
        if svc.alive:
            start = max(self.now, svc.free_at)
            end = svc.free_at = start + self.costs.swap_seconds(self.specs[job_id].state_bytes)
            self._push(end, handle, service_id, CheckpointReport(job_id, service_id, str(path), start, end))
        return handle

    def release(self, job_id: str, service_id: str) -> None:
        svc = self.services[service_id]
        svc.tier.pop(job_id, None)
        svc.landing.pop(job_id, None)
        for key in [k for k in self._left if k[0] == job_id]:
            del self._left[key]

    def forget(self, handles: Iterable[Handle]) -> None:
        """Nothing to drop: outputs are not kept."""

    def close(self) -> dict[str, dict[str, Any]]:
        self._heap.clear()
        return {sid: svc.report() for sid, svc in self.services.items()}


# the simulated jobs and their costs (`sim_jobs.py`), importable from here as before
__all__ = ["GB", "GRPO_ORDER", "SeededCosts", "SimCosts", "SimExecutor", "SimJob", "grpo_like_jobs", "grpo_nodes"]
