"""Worker groups, rank side: what runs inside each worker of a service spread over N Dask workers (one per
accelerator) that form ONE `torch.distributed` process group. The client side (which workers make each
group, the submission of one task per rank, re-forming) is `plexrl.runtime.group`.

`join` forms the process group (gloo on CPU, nccl on CUDA: the same code) with an explicit rendezvous and
collective timeout (gloo's default is 30 minutes: always pass one), plus a gloo SIDE group over the same
ranks for the control plane: `agree` (the error exchange at the end of every group task) and the object
broadcasts of `FSDPEngine` run there, so they never need the GPU, never stage objects on a CUDA device, and
still answer when the NCCL communicator is wedged. `leave` tears the groups down and resets
torch.distributed's module state, so that the next `join` in the same process starts clean. A rank whose
node failed, or whose collective timed out or lost its peer, marks its group `broken`: every later group
task on it fails at once until the group is re-formed.

The watchdog is the collective timeout itself: gloo raises on a collective that does not complete within
`timeout_s`, and at once when a peer's socket closes (a killed rank); `join` raises when a rank never
joins. Either becomes a failed node with the rank and the cause in its error. On nccl (`group_plan`, the
one place these choices are made): `TORCH_NCCL_ASYNC_ERROR_HANDLING=2` is set before the group is made, so
torch's NCCL watchdog, at `timeout_s`, ABORTS the communicator instead of tearing the worker process down
(torch's default, 3, would kill the Dask worker and every job on the service with it): the kernels waiting
on a lost peer return, the next NCCL call raises in the rank's thread, `guarded` turns that into
`GroupBroken`, the error exchange over the gloo side group tells every rank, and the client re-forms the
group (`plexrl.runtime.group`). A broken NCCL group is aborted, not destroyed (a graceful destroy waits on
the wedged communicator). None of the nccl path has run on a GPU yet (docs/gpu.md says what has).

This module sits below the engines, the services and the runtime, which all use it (`FSDPEngine` trains in a
group, `RankService` joins one, `plexrl.runtime.group` forms them), and it imports nothing of plexrl. Nothing
here decides what runs where or when: that is the planner's.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

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
    """This process's membership: its spec and rank, the 1-D device mesh over the group, the gloo side group
    of its control plane (`agree`, object broadcasts), and why it broke."""

    spec: GroupSpec
    rank: int
    mesh: Any = None
    broken: str | None = None
    side: Any = None


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """How a group on one backend is run (see the module docstring): the environment set before the process
    group is made, the backend of the side group (control plane), and how a BROKEN group is torn down
    (a healthy one is always destroyed)."""

    env: Mapping[str, str] = field(default_factory=dict)
    side: str = "gloo"
    broken_teardown: Literal["abort", "destroy"] = "destroy"
    bind_device: bool = False  # init_process_group(device_id=...): the communicator made at once, on this GPU


def group_plan(backend: str) -> GroupPlan:
    """The choices a worker group makes for `backend` (a plain function: a CPU test checks what an NCCL group
    would get)."""
    if backend == "nccl":
        return GroupPlan(env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, broken_teardown="abort", bind_device=True)
    return GroupPlan()


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


def reset_distributed(abort: bool = False) -> None:
    """Leave torch.distributed as a fresh process has it: destroy (`abort`: abort, for a broken NCCL group)
    every group if there is one, which also resets torch's group counter; else clear the counter a failed
    `init_process_group` leaves behind (the next init would hang for its whole timeout; torch has no public
    way to reset it)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized():
        aborting = abort and hasattr(c10d, "_abort_process_group")
        with contextlib.suppress(Exception):
            c10d._abort_process_group() if aborting else dist.destroy_process_group()
        if not dist.is_initialized():
            return
    if c10d._world.group_count:
        c10d._world.group_count = 0


def rank_device(device: str) -> Any:
    """The CUDA device a rank binds its communicator to: `device`'s index, else the current one (a rank's
    worker sees one GPU, `CUDA_VISIBLE_DEVICES`: cuda:0)."""
    import torch

    d = torch.device(device)
    return d if d.index is not None else torch.device(d.type, torch.cuda.current_device())


def join(spec: GroupSpec, rank: int, device: str) -> RankState:
    """Form (this rank's side of) the group: blocks until all `spec.world` ranks joined, or raises
    `GroupBroken` after `spec.timeout_s`. Any earlier membership of this process is left first."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    for key in list(_RANK):
        leave(key)
    reset_distributed()
    plan = group_plan(spec.backend)
    os.environ.update(plan.env)  # read when the process group is made
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    start = time.monotonic()
    bound: dict[str, Any] = {"device_id": rank_device(device)} if plan.bind_device else {}
    try:
        dist.init_process_group(
            spec.backend, init_method=f"tcp://{spec.host}:{spec.port}", rank=rank, world_size=spec.world,
            timeout=timeout, **bound,
        )  # fmt: skip
        side = dist.new_group(backend=plan.side, timeout=timeout)  # every rank makes it, in the same order
        mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (spec.world,))
    except Exception as exc:
        reset_distributed(abort=plan.broken_teardown == "abort")
        raise GroupBroken(
            f"group {spec.key} (epoch {spec.epoch}): rank {rank} could not form the process group within "
            f"{spec.timeout_s:g} s ({time.monotonic() - start:.1f} s): {type(exc).__name__}: {exc}"
        ) from exc
    state = RankState(spec, rank, mesh, side=side)
    _RANK[spec.key] = state
    return state


def leave(key: str) -> None:
    """Tear down this process's group `key` (if any: aborted when broken on a backend whose plan says so,
    else destroyed) and reset torch.distributed."""
    state = _RANK.pop(key, None)
    if state is not None:
        abort = state.broken is not None and group_plan(state.spec.backend).broken_teardown == "abort"
        reset_distributed(abort=abort)


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
    """End of a group task: every rank learns every rank's error (one small all-gather within the timeout,
    over the gloo side group: no GPU, and it answers when an NCCL communicator is wedged).
    Call it only when every rank got here in step: without an error, or with an error of the operator itself,
    which SPMD ranks raise alike (same code, same inputs; the engines' collectives are `guarded` and break the
    group instead). Returns the first error, prefixed by its rank, or None; a rank whose peers are gone or
    late gets a `GroupBroken` error and its group is marked broken."""
    import torch.distributed as dist

    errors: list[str | None] = [None] * state.spec.world
    start = time.monotonic()
    try:
        dist.all_gather_object(errors, error, group=state.side)
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


def publish_broken(topic: str, key: str, epoch: int) -> None:
    """Tell the client (a Dask event) that this rank's group `key` broke at `epoch`."""
    from distributed import get_worker

    get_worker().log_event(topic, {"key": key, "epoch": epoch})
