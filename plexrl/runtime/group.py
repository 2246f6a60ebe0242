"""Worker groups, client side: one service spread over N Dask workers (one per accelerator) that form ONE
`torch.distributed` process group. The planner sees one service; this module only carries its work out.

`WorkerGroups` (used by `DaskExecutor` when `ranks > 1`) knows which workers make each service's group,
submits one task per rank (rank r's task reads rank r's outputs of earlier service nodes, so each rank
keeps its own data), keeps the order of each rank's tasks, and recovers: a rank that reports a broken group
(a Dask event) or whose task died makes the next submission to that service re-form the group first, on a
fresh port, with the workers found again by name (a killed worker comes back under its nanny with a new
address). Re-forming drops every job engine of the group (their shards are bound to the dead process
group): those jobs' next nodes fail with a clear error, new jobs run.

The rank side (what runs in each worker: `join`, `leave`, `agree`, `guarded`) is `plexrl.ranks`,
re-exported here. Nothing here decides what runs where or when: that is the planner's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from plexrl.ranks import (
    GroupBroken,
    GroupSpec,
    RankState,
    agree,
    free_port,
    guarded,
    join,
    leave,
    member,
    publish_broken,
    reset_distributed,
)

log = logging.getLogger(__name__)


# -- client side ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Group:
    """One service's workers (rank order, by worker name), its current spec, and each rank's last task."""

    service_id: str
    names: list[str]
    addrs: list[str]
    spec: GroupSpec | None = None
    last: list[Any] = field(default_factory=list)
    reforms: int = 0


class WorkerGroups:
    """The client half: forms, feeds and re-forms the groups of a `DaskExecutor` (see the module docstring).
    `start_rank(key, rank, spec, *start_args)` creates a rank's service in its worker (after joining)."""

    def __init__(
        self,
        client: Any,
        groups: dict[str, Group],
        *,
        key_of: Callable[[str], str],
        start_rank: Callable[..., Any],
        start_args: Sequence[Any] = (),
        backend: str,
        timeout_s: float,
        topic: str,
    ) -> None:
        self.client, self.groups, self.key_of = client, groups, key_of
        self.start_rank, self.start_args = start_rank, tuple(start_args)
        self.backend, self.timeout_s = backend, timeout_s
        self.topic = topic  # ranks publish {"key": ..., "epoch": ...} here when their group breaks
        self._broken: set[tuple[str, int]] = set()
        self.dropped: set[str] = set()  # keys of tasks cancelled because their group was re-formed
        client.subscribe_topic(topic, lambda event: self._broken.add((event[1]["key"], event[1]["epoch"])))

    def form(self, service_id: str) -> list[Any]:
        """Form the service's group (at start, or again after a failure): a fresh port on rank 0's host, then
        one start task per rank, submitted together. Returns the start futures (each rank's pid)."""
        g = self.groups[service_id]
        for fut in g.last:  # a task of the old group still queued for a worker that died never runs
            if not fut.done():
                self.dropped.add(fut.key)
                fut.cancel()
        deadline = time.monotonic() + self.timeout_s  # a killed worker comes back under its nanny
        while True:
            named = {w.get("name"): a for a, w in self.client.scheduler_info(n_workers=-1)["workers"].items()}
            missing = [n for n in g.names if n not in named]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise GroupBroken(f"service {service_id}: workers {missing} of its group are not connected")
            time.sleep(0.1)
        g.addrs = [named[n] for n in g.names]
        host, port = self.client.submit(free_port, workers=[g.addrs[0]], pure=False).result(timeout=60)
        epoch = 0 if g.spec is None else g.spec.epoch + 1
        g.spec = GroupSpec(self.key_of(service_id), len(g.names), host, port, self.backend, self.timeout_s, epoch)
        g.last = [
            self.client.submit(
                self.start_rank, self.key_of(service_id), rank, g.spec, *self.start_args,
                workers=[addr], allow_other_workers=False, pure=False, resources={"GPU": 1},
                key=f"group-{self.key_of(service_id)}-{epoch}-{rank}",
            )
            for rank, addr in enumerate(g.addrs)
        ]  # fmt: skip
        return list(g.last)

    def needs_reform(self, service_id: str) -> bool:
        """A rank said its group broke at the current epoch, or one of its last tasks died with its worker."""
        g = self.groups[service_id]
        if g.spec is None:
            return False
        if (g.spec.key, g.spec.epoch) in self._broken:
            return True
        return any(f.status in ("error", "cancelled") for f in g.last)

    def submit(
        self, service_id: str, fn: Callable[..., Any], args: Callable[[int], Sequence[Any]], after: Sequence[Any],
        key: str,
    ) -> list[Any]:  # fmt: skip
        """One task per rank: `fn(*args(rank), *after_r)`, pinned to the rank's worker and holding its GPU
        slot, ordered after that rank's previous task (and after `after`, e.g. the job's load). Re-forms a
        broken group first (its start tasks come first on every rank). Returns the futures, rank 0 first."""
        g = self.groups[service_id]
        if self.needs_reform(service_id):
            g.reforms += 1
            log.warning(
                "service %s: re-forming its worker group (epoch %d broke)", service_id, g.spec.epoch if g.spec else -1
            )
            self.form(service_id)
        assert g.spec is not None
        futs = []
        for rank, addr in enumerate(g.addrs):
            prev = [g.last[rank]] if rank < len(g.last) and not g.last[rank].done() else []
            futs.append(
                self.client.submit(
                    fn, *args(rank), g.spec.epoch, *after, *prev, workers=[addr], allow_other_workers=False,
                    pure=False, resources={"GPU": 1}, key=f"{key}-r{rank}",
                )
            )  # fmt: skip
        g.last = futs
        return futs


__all__ = [
    "Group", "GroupBroken", "GroupSpec", "RankState", "WorkerGroups", "agree", "free_port", "guarded", "join",
    "leave", "member", "publish_broken", "reset_distributed",
]  # fmt: skip
