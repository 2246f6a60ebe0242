"""How a `DaskExecutor`'s services sit on its workers: one worker each (`OneWorker`) or a worker group each
(`GroupTopology`, `ranks > 1`: one task per rank, `runtime/group.py`). The executor picks one at
construction and hands it every task that touches a service: the start, a job's load, a service node with
its ordering dependency, a cohort of co-scheduled rollouts (`cohort`), a save, a checkpoint, a release and the
stop. Each keeps the order of its services' tasks (a task runs after the service's latest one, in the order
the runner sent them).

Nothing here decides what runs where or when (that is the planner's); this only carries it out. A topology
sees its executor only through `Host` (what of the executor it uses), and the executor's record of each
task it sent (`Work`) lives here, below both: this module never imports the executor.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from plexrl.runtime.dask_tasks import (
    _checkpoint,
    _load_job,
    _member,
    _release,
    _run_service_cohort,
    _run_service_node,
    _save_model,
    _start_service,
    _start_swaps,
    _stop_service,
)
from plexrl.runtime.executor import NodeTask

if TYPE_CHECKING:
    from plexrl.planner.state import Tier
    from plexrl.runtime.group import WorkerGroups

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Work:
    """What the executor sent: a load, a node, a checkpoint (its future and what it was for)."""

    future: Any  # a load's future (its small LoadReport is fetched), or a node's NodeResult future
    is_node: bool
    lane: str
    job_id: str
    iteration: int = 0
    node: str = ""
    reported: bool = False  # its report reached the runner; a node's future stays as its output
    checkpoint: str = ""  # a checkpoint's path (then its future's value is a CheckpointReport)
    ranks: list[Any] = dataclasses.field(default_factory=list)  # a group node: every rank's future, rank 0 first


class Host(Protocol):
    """What a topology uses of its executor (`DaskExecutor`): the Dask client (after `start`), where each
    service's worker is, the settings of a worker group, the topic the workers publish reports to, the
    jobs' scattered specs and load futures, the services whose worker is gone, a service's key inside its
    workers and its start arguments, a task pinned to a service's worker (`on`), and a result fetched and
    counted (`fetch`)."""

    client: Any
    worker_of: dict[str, str]
    ranks: int
    device: str
    group_timeout: float
    topic: str
    specs: dict[str, Any]
    loaded: dict[str, Any]
    gone: set[str]

    def key(self, service_id: str) -> str: ...

    def start_args(self) -> tuple[Any, ...]: ...

    def on(self, service_id: str, fn: Any, *args: Any, **kwargs: Any) -> Any: ...

    def fetch(self, fut: Any, timeout: float | None = None, job_id: str = "") -> Any: ...


class Topology(Protocol):
    """The executor's service part (see the module docstring). `after`: futures a task must follow (the
    loads of the jobs it touches); the topology adds the service's own previous task."""

    groups: WorkerGroups | None  # the worker groups, when services span several ranks
    joins: bool  # a GPU worker that joins late can become a service of its own

    def form(self, gpu: list[tuple[str, str]]) -> None: ...

    def load(self, service_id: str, job_id: str, tier: Tier, key: str) -> Any: ...

    def node(
        self, task: NodeTask, handle: int, inputs: dict[str, Work], parts: list[Work], after: list[Any], key: str
    ) -> tuple[Any, list[Any]]: ...

    def cohort(
        self, tasks: Sequence[NodeTask], handles: list[int], inputs: list[dict[str, Work]], after: list[Any], key: str
    ) -> list[Any]: ...

    def save(self, service_id: str, job_id: str, path: Path, key: str) -> Any: ...

    def checkpoint(
        self, service_id: str, job_id: str, path: Path, extra: dict[str, Any], after: list[Any], key: str
    ) -> Any: ...

    def release(self, service_id: str, job_id: str, key: str) -> None: ...

    def stop(self, alive: set[str]) -> dict[str, dict[str, Any]]: ...

    def why_cancelled(self, fut: Any) -> str: ...


class OneWorker:
    """Each service in one worker process: its tasks pinned there, each after the service's latest one when
    that one is still running (`last_on`), numbered in the order they were sent (`seq`)."""

    groups: WorkerGroups | None = None
    joins = True

    def __init__(self, ex: Host) -> None:
        self.ex = ex
        self.last_on: dict[str, Any] = {}  # service -> its latest task: the next one runs after it (order)
        self.seq: dict[str, int] = {}  # service -> number of the latest task sent in that order (`next_seq`)

    def form(self, gpu: list[tuple[str, str]]) -> None:
        ex = self.ex
        for i, (_, addr) in enumerate(gpu):
            ex.worker_of[f"service-{i}"] = addr
        futs = [
            ex.client.submit(
                _start_service, ex.key(sid), *ex.start_args(),
                workers=[addr], allow_other_workers=False, pure=False, key=f"start-{ex.key(sid)}",
            )
            for sid, addr in ex.worker_of.items()
        ]  # fmt: skip
        ex.client.gather(futs)

    def next_seq(self, service_id: str) -> int:
        """Number the service's ordered tasks (nodes, checkpoints) in the order they are sent."""
        self.seq[service_id] = seq = self.seq.get(service_id, -1) + 1
        return seq

    def _ordered(self, service_id: str, after: list[Any]) -> bool:
        """Add the service's latest task to `after` while it still runs; whether it did."""
        previous = self.last_on.get(service_id)
        ahead = previous is not None and not previous.done()
        if ahead:
            after.append(previous)
        return ahead

    def load(self, service_id: str, job_id: str, tier: Tier, key: str) -> Any:
        ex = self.ex
        return ex.on(service_id, _load_job, ex.key(service_id), ex.specs[job_id], tier, key=key)

    def node(
        self, task: NodeTask, handle: int, inputs: dict[str, Work], parts: list[Work], after: list[Any], key: str
    ) -> tuple[Any, list[Any]]:
        ex, sid = self.ex, task.service_id
        assert sid is not None
        ahead = self._ordered(sid, after)  # with lookahead, a service runs its nodes in the order they were sent
        seq = self.next_seq(sid)
        fut = ex.on(
            sid, _run_service_node, ex.topic, handle, ex.key(sid), task.job_id, task.iteration, task.node,
            {p: w.future for p, w in inputs.items()}, task.swaps, task.prefetch, task.chunk, task.chunks,
            [w.future for w in parts], seq, task.call, *after, key=key,
        )  # fmt: skip
        self.last_on[sid] = fut
        if ahead and task.swaps and sid not in ex.gone:
            self._start_early(sid, seq, task, key)
        return fut, []

    def cohort(
        self, tasks: Sequence[NodeTask], handles: list[int], inputs: list[dict[str, Work]], after: list[Any], key: str
    ) -> list[Any]:
        """Co-scheduled rollouts: ONE task on the service worker (`_run_service_cohort`, one place in the
        service's order; sent ahead, its swaps start early as a node's do) and, per member, a small task there
        that picks the member's result out (no GPU slot): that member's future, its output kept on the worker."""
        ex, sid = self.ex, tasks[0].service_id
        assert sid is not None
        ahead = self._ordered(sid, after)
        seq = self.next_seq(sid)
        members = [(t.job_id, t.iteration, t.node, {p: w.future for p, w in ins.items()}, t.call)
                   for t, ins in zip(tasks, inputs, strict=True)]  # fmt: skip
        loads = {t.job_id: ex.loaded[t.job_id] for t in tasks if t.job_id in ex.loaded}
        fut = ex.on(
            sid, _run_service_cohort, ex.topic, handles, ex.key(sid), members, loads, tasks[0].swaps,
            tasks[0].prefetch, seq, *after, key=key,
        )  # fmt: skip
        self.last_on[sid] = fut
        if ahead and tasks[0].swaps and sid not in ex.gone:
            self._start_early(sid, seq, tasks[0], key)
        where = [ex.worker_of[sid]]
        return [
            ex.client.submit(_member, fut, i, workers=where, allow_other_workers=False, pure=False, key=f"{key}-{i}")
            for i in range(len(tasks))
        ]

    def _start_early(self, service_id: str, seq: int, task: NodeTask, key: str) -> None:
        """The swaps of a node sent while the service runs another: a small task on the service worker, not
        chained after the running node and holding no GPU slot (the worker's second thread), hands them to
        the service's background thread (`Service.start_early`), which starts them once the node before
        this one has applied its own swaps. If it runs late or fails, the node applies its swaps itself;
        nothing waits on it (fire and forget: a lost worker takes it along)."""
        from distributed import fire_and_forget

        ex = self.ex
        loads = [ex.loaded[j] for j in sorted({m.job_id for m in task.swaps}) if j in ex.loaded]
        fut = ex.client.submit(
            _start_swaps, ex.key(service_id), seq, task.swaps, *loads,
            workers=[ex.worker_of[service_id]], allow_other_workers=False, pure=False, key=f"early-{key}",
        )  # fmt: skip
        fire_and_forget(fut)

    def save(self, service_id: str, job_id: str, path: Path, key: str) -> Any:
        ex = self.ex
        return ex.on(service_id, _save_model, ex.key(service_id), job_id, str(path), key=key)

    def checkpoint(
        self, service_id: str, job_id: str, path: Path, extra: dict[str, Any], after: list[Any], key: str
    ) -> Any:
        ex = self.ex
        self._ordered(service_id, after)
        seq = self.next_seq(service_id)
        fut = ex.on(service_id, _checkpoint, ex.key(service_id), job_id, str(path), extra, seq, *after, key=key)
        self.last_on[service_id] = fut
        return fut

    def release(self, service_id: str, job_id: str, key: str) -> None:
        self.ex.on(service_id, _release, self.ex.key(service_id), job_id, key=key)

    def stop(self, alive: set[str]) -> dict[str, dict[str, Any]]:
        ex = self.ex
        futs = {sid: ex.on(sid, _stop_service, ex.key(sid)) for sid, a in ex.worker_of.items() if a in alive}
        reports: dict[str, dict[str, Any]] = {}
        for sid, fut in futs.items():
            try:
                reports[sid] = ex.fetch(fut, timeout=60)
            except Exception:
                log.exception("could not stop service %s cleanly", sid)
        return reports

    def why_cancelled(self, fut: Any) -> str:
        return "task cancelled"


class GroupTopology:
    """Each service over `ranks` workers (consecutive by name) that form one process group: every task runs
    on every rank, each after that rank's previous task (`WorkerGroups.submit`); rank 0's future stands for
    it. A worker group needs all its ranks, so a worker that joins late does not become a service."""

    joins = False

    def __init__(self, ex: Host) -> None:
        self.ex = ex
        self.groups: WorkerGroups | None = None  # made by `form`

    def form(self, gpu: list[tuple[str, str]]) -> None:
        from plexrl.runtime.group import Group, WorkerGroups
        from plexrl.services.group import group_topic, start_rank

        ex, n = self.ex, self.ex.ranks
        if len(gpu) < n:
            raise RuntimeError(f"services of {n} ranks need {n} GPU workers; the cluster has {len(gpu)}")
        groups = {}
        for i in range(len(gpu) // n):
            ranks = gpu[i * n : (i + 1) * n]
            groups[f"service-{i}"] = Group(f"service-{i}", [name for name, _ in ranks], [a for _, a in ranks])
            ex.worker_of[f"service-{i}"] = ranks[0][1]
        self.groups = WorkerGroups(
            ex.client, groups, key_of=ex.key, start_rank=start_rank, start_args=ex.start_args(),
            backend="nccl" if ex.device == "cuda" else "gloo", timeout_s=ex.group_timeout,
            topic=group_topic(ex.topic),
        )  # fmt: skip
        ex.client.gather([f for sid in groups for f in self.groups.form(sid)])

    def _each(self, service_id: str, fn: Any, args: Callable[[int], Sequence[Any]], after: Sequence[Any],
              key: str) -> list[Any]:  # fmt: skip
        """The task on every rank of the group service (rank 0's future first)."""
        assert self.groups is not None, "the worker groups are formed at start"
        futs: list[Any] = self.groups.submit(service_id, fn, args, after, key)
        return futs

    def load(self, service_id: str, job_id: str, tier: Tier, key: str) -> Any:
        from plexrl.services.group import rank_load

        ex = self.ex
        spec, skey = ex.specs[job_id], ex.key(service_id)
        return self._each(service_id, rank_load, lambda r: (ex.topic, skey, r, spec, tier), [], key)[0]

    def node(
        self, task: NodeTask, handle: int, inputs: dict[str, Work], parts: list[Work], after: list[Any], key: str
    ) -> tuple[Any, list[Any]]:
        """Every rank runs it; rank r reads rank r's outputs of service nodes (a cpu node's: its one copy)."""
        from plexrl.services.group import rank_node

        ex, sid = self.ex, task.service_id
        assert sid is not None
        if task.call is not None:
            raise NotImplementedError("sessions (the Tinker API) do not run on worker groups (services.ranks > 1): "
                                      "serve them from a server with services.ranks: 1")  # fmt: skip
        futs = self._each(sid, rank_node, lambda r: (
            ex.topic, handle, ex.key(sid), r, task.job_id, task.iteration, task.node,
            {p: w.ranks[r] if w.ranks else w.future for p, w in inputs.items()}, task.swaps, task.prefetch,
            task.chunk, task.chunks, [w.ranks[r] if w.ranks else w.future for w in parts],
        ), after, key)  # fmt: skip
        return futs[0], futs

    def cohort(
        self, tasks: Sequence[NodeTask], handles: list[int], inputs: list[dict[str, Work]], after: list[Any], key: str
    ) -> list[Any]:
        raise NotImplementedError(
            "co-scheduled rollouts (batch_rollouts) do not run on worker groups (services.ranks > 1): set "
            "batch_rollouts: false or services.ranks: 1"
        )

    def save(self, service_id: str, job_id: str, path: Path, key: str) -> Any:
        from plexrl.services.group import rank_save

        skey = self.ex.key(service_id)
        return self._each(service_id, rank_save, lambda r: (skey, r, job_id, str(path)), [], key)[0]

    def checkpoint(
        self, service_id: str, job_id: str, path: Path, extra: dict[str, Any], after: list[Any], key: str
    ) -> Any:
        """On every rank after that rank's latest task (and the job's load): each writes its part, rank 0 the
        checkpoint that names them (`services.group.rank_checkpoint`)."""
        from plexrl.services.group import rank_checkpoint

        ex, skey, where = self.ex, self.ex.key(service_id), str(path)
        return self._each(service_id, rank_checkpoint, lambda r: (ex.topic, skey, r, job_id, where, extra), after,
                          key)[0]  # fmt: skip

    def release(self, service_id: str, job_id: str, key: str) -> None:
        from plexrl.services.group import rank_release

        skey = self.ex.key(service_id)
        self._each(service_id, rank_release, lambda r: (skey, r, job_id), [], key)

    def stop(self, alive: set[str]) -> dict[str, dict[str, Any]]:
        from plexrl.services.group import stop_rank

        ex, reports = self.ex, {}
        for sid, g in (self.groups.groups if self.groups is not None else {}).items():
            # a rank whose worker died is not asked: a task pinned to a gone address would wait for ever
            stops = [(r, ex.client.submit(stop_rank, ex.key(sid), workers=[a], pure=False))
                     for r, a in enumerate(g.addrs) if a in alive]  # fmt: skip
            for rank, fut in stops:
                try:
                    report = ex.fetch(fut, timeout=60)
                except Exception:
                    log.exception("could not stop rank %d of service %s cleanly", rank, sid)
                    continue
                if rank == 0:
                    reports[sid] = report
        return reports

    def why_cancelled(self, fut: Any) -> str:
        """A rank's task still queued when its group was re-formed was cancelled (`WorkerGroups.form`)."""
        if self.groups is not None and fut.key in self.groups.dropped:
            return "task cancelled: its worker group was re-formed after a failure (the job's state on it is gone)"
        return "task cancelled"


def topology_for(ex: Host) -> Topology:
    """`GroupTopology` when the executor's services span several ranks, else `OneWorker`."""
    return GroupTopology(ex) if ex.ranks > 1 else OneWorker(ex)
