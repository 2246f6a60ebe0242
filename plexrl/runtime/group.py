"""Worker groups: one service spread over N Dask workers (one per accelerator) that form ONE
`torch.distributed` process group. The planner sees one service; this module only carries its work out.

Two halves:

- **rank side** (runs inside each worker): `join` forms the process group (gloo on CPU, nccl on CUDA: the
  same code) with an explicit rendezvous and collective timeout (gloo's default is 30 minutes: always pass
  one); `leave` destroys it and resets torch.distributed's module state, so that the next `join` in the
  same process starts clean (a failed init leaves an internal group counter set and the next init would
  hang for its whole timeout). A rank whose node failed, or whose collective timed out or lost its peer,
  marks its group `broken`: every later group task on it fails at once until the group is re-formed.
- **client side** (`WorkerGroups`, used by `DaskExecutor` when `ranks > 1`): which workers make each
  service's group, the submission of one task per rank (rank r's task reads rank r's outputs of earlier
  service nodes, so each rank keeps its own data), the order of each rank's tasks, and recovery: a rank
  that reports a broken group (a Dask event) or whose task died makes the next submission to that service
  re-form the group first, on a fresh port, with the workers found again by name (a killed worker comes
  back under its nanny with a new address). Re-forming drops every job engine of the group (their shards
  are bound to the dead process group): those jobs' next nodes fail with a clear error, new jobs run.

The watchdog is the collective timeout itself: gloo raises on a collective that does not complete within
`timeout_s`, and at once when a peer's socket closes (a killed rank); `join` raises when a rank never
joins. Either becomes a failed node with the rank and the cause in its error. On nccl the same timeout
is enforced by torch's NCCL watchdog, which aborts the process (untested here: no GPU).

Nothing here decides what runs where or when: that is the planner's.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class GroupBroken(RuntimeError):
    """A worker group's process group failed (a rank never joined, a collective timed out or lost a peer);
    it must be re-formed before it runs anything again."""


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """How the ranks of one service meet: rank 0's host and a free port there (the TCP rendezvous),
    `world` ranks, the backend, and the timeout (seconds) of the rendezvous and of every collective.
    `epoch` counts re-formations: a task sent for an older epoch fails instead of joining a new group."""

    key: str
    world: int
    host: str
    port: int
    backend: str = "gloo"
    timeout_s: float = 60.0
    epoch: int = 0


@dataclass(slots=True)
class RankState:
    """This process's membership: its spec and rank, the 1-D device mesh over the group, and why it broke."""

    spec: GroupSpec
    rank: int
    mesh: Any = None
    broken: str | None = None


_RANK: dict[str, RankState] = {}  # group key -> this process's membership (one group per worker in practice)


# -- rank side ------------------------------------------------------------------------------------------
def free_port() -> tuple[str, int]:
    """A free TCP port on this host, with the host address the other ranks reach it by."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    from distributed import get_worker

    host = get_worker().address.split("://")[-1].rsplit(":", 1)[0]
    return host, int(port)


def reset_distributed() -> None:
    """Leave torch.distributed as a fresh process has it: destroy the default group if there is one, else
    clear the group counter a failed `init_process_group` leaves behind (the next init would hang)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    c10d._world.group_count = 0


def join(spec: GroupSpec, rank: int, device: str) -> RankState:
    """Form (this rank's side of) the group: blocks until all `spec.world` ranks joined, or raises
    `GroupBroken` after `spec.timeout_s`. Any earlier membership of this process is left first."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    for key in list(_RANK):
        leave(key)
    reset_distributed()
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    start = time.monotonic()
    try:
        dist.init_process_group(
            spec.backend, init_method=f"tcp://{spec.host}:{spec.port}", rank=rank, world_size=spec.world,
            timeout=timeout,
        )  # fmt: skip
        mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (spec.world,))
    except Exception as exc:
        reset_distributed()
        raise GroupBroken(
            f"group {spec.key} (epoch {spec.epoch}): rank {rank} could not form the process group within "
            f"{spec.timeout_s:g} s ({time.monotonic() - start:.1f} s): {type(exc).__name__}: {exc}"
        ) from exc
    state = RankState(spec, rank, mesh)
    _RANK[spec.key] = state
    return state


def leave(key: str) -> None:
    """Destroy this process's group `key` (if any) and reset torch.distributed."""
    if _RANK.pop(key, None) is not None:
        reset_distributed()


def member(key: str, epoch: int) -> RankState:
    """This process's healthy membership of group `key` at `epoch`, else `GroupBroken` saying why."""
    state = _RANK.get(key)
    if state is None:
        raise GroupBroken(f"group {key}: this worker is not a member (restarted?); the group must be re-formed")
    if state.spec.epoch != epoch:
        raise GroupBroken(f"group {key}: task for epoch {epoch} but the group is at epoch {state.spec.epoch}")
    if state.broken is not None:
        raise GroupBroken(f"group {key} is broken ({state.broken}); it is being re-formed")
    return state


def agree(state: RankState, error: str | None) -> str | None:
    """End of a group task: every rank learns every rank's error (one small all-gather within the timeout).
    Call it only when every rank got here in step: without an error, or with an error of the operator itself,
    which SPMD ranks raise alike (same code, same inputs; the engines' collectives are `guarded` and break the
    group instead). Returns the first error, prefixed by its rank, or None; a rank whose peers are gone or
    late gets a `GroupBroken` error and its group is marked broken."""
    import torch.distributed as dist

    errors: list[str | None] = [None] * state.spec.world
    start = time.monotonic()
    try:
        dist.all_gather_object(errors, error)
    except Exception as exc:
        state.broken = f"rank {state.rank}: {type(exc).__name__}: {exc}"
        return (
            f"GroupBroken: rank {state.rank} of group {state.spec.key}: a peer failed or did not answer within "
            f"{state.spec.timeout_s:g} s ({time.monotonic() - start:.1f} s): {type(exc).__name__}: {exc}"
        )
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)


def guarded(state: RankState, what: str, fn: Callable[[], Any]) -> Any:
    """Run `fn` (a collective step of `what`); a failure breaks the group and is re-raised as `GroupBroken`
    with the rank, the cause and the time it took (bounded by the collective timeout)."""
    start = time.monotonic()
    try:
        return fn()
    except Exception as exc:
        state.broken = f"{what}: {type(exc).__name__}: {exc}"
        raise GroupBroken(
            f"{what} failed on rank {state.rank} of group {state.spec.key} after {time.monotonic() - start:.1f} s "
            f"(timeout {state.spec.timeout_s:g} s): {type(exc).__name__}: {exc}"
        ) from exc


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
        client.subscribe_topic(topic, lambda event: self._broken.add((event[1]["key"], event[1]["epoch"])))

    def form(self, service_id: str) -> list[Any]:
        """Form the service's group (at start, or again after a failure): a fresh port on rank 0's host, then
        one start task per rank, submitted together. Returns the start futures (each rank's pid)."""
        g = self.groups[service_id]
        for fut in g.last:  # a task of the old group still queued for a worker that died never runs
            if not fut.done():
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


def publish_broken(topic: str, key: str, epoch: int) -> None:
    """Tell the client (a Dask event) that this rank's group `key` broke at `epoch`."""
    from distributed import get_worker

    get_worker().log_event(topic, {"key": key, "epoch": epoch})
