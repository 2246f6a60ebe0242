"""One rank of a service that spans a worker group, and the tasks each rank runs (inside its Dask worker).

`RankService` is a `Service` whose engines are `FSDPEngine`s over the group's process group and whose state
moves are this rank's own: every rank moves its own shard (rank 0 also its full generation copy and the
reference), so a switch-out on an N-rank service is N moves in parallel, one per worker. A move frees
and restores tensor *storage* (`untyped_storage().resize_`), not `t.data`: FSDP2's sharded parameters are
views of a padded flat buffer, so the views must keep their storage object. The storages' bytes go into one
flat host buffer per job from the service's `HostPool` (pinned on CUDA, one copy per storage, through the
service's `StreamOrder` like a single service's moves). host -> disk writes the buffer's views with
`torch.distributed.checkpoint` (no collective: one directory per rank and job) and disk -> host reads them
back into a pool buffer, so a prefetch in the background never meets a collective of the node in the
foreground. A state on host or disk is read in place (`save_model`) through views of its bytes shaped like
the live tensors.

Every service task of a group runs on every rank (SPMD: the same operator, the same collectives, in the
same order); rank 0 publishes the report. At the end of a node the ranks exchange their errors (`agree`),
so a failure on any rank fails the node. A failure of the process group itself breaks it: see
`plexrl.runtime.group`.

A checkpoint of a group job is one part per rank (its shards; rank 0's also the full copy) and, once every
part is written, the file at the checkpoint's path naming them (`rank_checkpoint`); a resume on a group of
the same size loads rank r's part on rank r.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from plexrl.planner.state import Move
from plexrl.ranks import GroupBroken, GroupSpec, RankState, agree, join, leave, member, publish_broken
from plexrl.reports import CheckpointReport, LoadReport, NodeReport
from plexrl.services import swap as sw
from plexrl.services.host import HostCopy, Layout, Tally
from plexrl.services.records import recorded
from plexrl.services.registry import SERVICES, publish
from plexrl.services.service import NodeResult, Service
from plexrl.sizes import uses_reference

if TYPE_CHECKING:
    from plexrl.job.spec import JobSpec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ShardLocation(sw.StateLocation):
    """Where this rank's share of a job's state is: the storages it frees and restores (by the name of a
    tensor that owns each), the storage each live tensor lies in (`owner`), their bytes on the host tier
    (`host`, one view per storage), or the DCP directory on the disk tier."""

    storages: dict[str, Any] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)
    dcp_dir: Path | None = None


def _storages(live: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, str]]:
    """One entry per distinct storage behind `live` (tied weights and views of one buffer count once), by the
    name of its first tensor, and for every tensor the name its storage goes by."""
    out: dict[str, Any] = {}
    owner: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, t in live.items():
        s = t.untyped_storage()
        if s.nbytes() == 0:
            continue
        key = first.setdefault(s.data_ptr(), name)
        owner[name] = key
        if key == name:
            out[name] = s
    return out, owner


def _bytes_of(storage: Any, device: torch.device) -> Tensor:
    """A flat uint8 view [nbytes] of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP warns that it assumes one process when told `no_dist`: that is the intent here (one rank's files)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class RankService(Service):
    """This rank's part of a group service (see the module docstring)."""

    def __init__(self, service_id: str, group: RankState, device: str = "cpu", **kwargs: Any) -> None:
        super().__init__(service_id, device, **kwargs)
        self.group = group
        self.rank = group.rank

    def load_job(self, job: JobSpec, tier: str = "device") -> int:
        """This rank's engine of `job` (FSDP2 shards; rank 0 also the full generation copy). Returns this
        rank's state bytes (rank 0's is the largest: it is what the planner budgets per rank)."""
        from plexrl.engines.fsdp_engine import FSDPEngine

        if job.generation == "vllm":
            raise NotImplementedError("vLLM rollouts on a worker group are not built; set engine: torch")
        tok = job.tokenizer
        engine = FSDPEngine(job.model_path, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, group=self.group,
                            device=str(self.device), with_reference=uses_reference(job.graph),
                            attention=job.config.model.attention)  # fmt: skip
        engine.init_optimizer_state()  # the moments exist from the load: the size reported below is the size kept
        if job.resume_state is not None:  # this rank's part of a group checkpoint (`checkpoint`)
            part = rank_part(job.resume_state, self.rank)
            if not part.is_file():
                raise FileNotFoundError(f"{job.resume_state} has no part for rank {self.rank} ({part.name}): resume "
                                        "a group job from a checkpoint that a group of its size wrote")  # fmt: skip
            engine.load_state(sw.load_checkpoint(part)["engine"])
        self.jobs[job.job_id], self.engines[job.job_id] = job, engine
        live, _ = _storages(engine.state_tensors())
        self.states[job.job_id] = ShardLocation("device", nbytes=sum(s.nbytes() for s in live.values()))
        self.order.node_end([job.job_id])
        if tier != "device":
            self._move(Move(job.job_id, "device", tier, 0))  # type: ignore[arg-type]
        return self.states[job.job_id].nbytes

    def save_model(self, job_id: str, path: Path) -> Path:
        """Rank 0 writes the full copy (current after every weight sync); other ranks leave their shards."""
        return super().save_model(job_id, path) if self.rank == 0 else path

    @contextlib.contextmanager
    def _state_in_place(self, job_id: str) -> Iterator[None]:
        """Point the job's live tensors at views of its bytes on host (or read back from its DCP directory),
        each shaped like the tensor it stands for (dtype, size, stride and offset in its storage), then back;
        a no-op on device. Not thread-safe with a node or a move of the same job."""
        state = self.states[job_id]
        assert isinstance(state, ShardLocation)
        if state.tier == "device":
            yield
            return
        if state.host is not None:
            raw = state.host.tensors()
        else:
            assert state.dcp_dir is not None
            import torch.distributed.checkpoint as dcp

            raw = {k: torch.empty(n, dtype=torch.uint8) for k, n in state.sizes.items()}
            with _quiet_dcp():
                dcp.load(raw, storage_reader=dcp.FileSystemReader(str(state.dcp_dir)), no_dist=True)
        live = self.engines[job_id].state_tensors()
        views = {}
        for k, t in live.items():
            if k in state.owner:  # as_strided's offset counts from the start of the buffer's storage
                v = raw[state.owner[k]].view(t.dtype)
                views[k] = v.as_strided(t.shape, t.stride(), v.storage_offset() + t.storage_offset())
        with sw.pointed_at(live, views):
            yield

    def checkpoint(self, job_id: str, path: Path, extra: dict[str, Any]) -> Path:
        """Write THIS rank's part of the job's checkpoint (`rank_part(path, rank)`: its shards; rank 0's also
        the full copy and reference), atomically; `rank_checkpoint` writes the checkpoint itself at `path`
        once every rank's part is written. Only from the device tier: a state swapped out is refused (its
        bytes on host or disk are raw storage, not the engine state a resume reads)."""
        self._wait_for(job_id, count=False)
        tier = self.states[job_id].tier
        if tier != "device":
            raise NotImplementedError(f"job {job_id}: a checkpoint of a group job's state on {tier} is not built "
                                      "(take it while the state is on device)")  # fmt: skip
        return sw.save_checkpoint({"engine": self.engines[job_id].export_state()}, rank_part(path, self.rank))

    def release(self, job_id: str) -> None:
        self._wait_for(job_id)
        state = self.states.get(job_id)
        if isinstance(state, ShardLocation) and state.host is not None:
            self.host_pool.give(state.host.buffer)
            state.host = None
        if isinstance(state, ShardLocation) and state.dcp_dir is not None:
            shutil.rmtree(state.dcp_dir, ignore_errors=True)
            state.dcp_dir = None
        super().release(job_id)

    def _move(self, move: Move) -> int:
        """Move this rank's share of a job's state: device -> host frees the storages after copying their
        bytes, host -> disk writes them with DCP, and back. Bit-exact; checksummed in validate mode."""
        state = self.states[move.job_id]
        assert isinstance(state, ShardLocation)
        if state.tier != move.src:
            raise sw.StateCorrupted(f"job {move.job_id}: the planner moves it from {move.src} but it is on "
                                    f"{state.tier} (service {self.service_id}, rank {self.rank})")  # fmt: skip
        if move.src == move.dst:
            return 0
        rec = recorded(move.job_id, move.src, move.dst, lambda tally: self._carry(move, state, tally), clock=self.clock)
        return self._counted(rec)

    def _carry(self, move: Move, state: ShardLocation, tally: Tally) -> int:
        """`_move`'s work; `tally`: its figures (a DCP write or read counts as one copy; every second copying)."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        pool, order, copies = self.host_pool, self.order, 0
        if move.src == "device":
            state.storages, state.owner = _storages(self.engines[move.job_id].state_tensors())
            state.sizes = {k: s.nbytes() for k, s in state.storages.items()}
            state.nbytes = sum(state.sizes.values())
            layout = Layout.of({k: _bytes_of(s, self.device) for k, s in state.storages.items()})
            state.host = HostCopy(pool.take(layout.nbytes, tally), layout)
            host = state.host.tensors()
            order.before_copy(move.job_id)
            for k, s in state.storages.items():
                order.copy(move.job_id, host[k], _bytes_of(s, self.device))
            copies += len(state.storages)
            order.synchronize()  # the bytes are on the host before the storages are freed
            if self.validate:
                state.checksum = sw.checksum(host)
            for s in state.storages.values():
                s.resize_(0)
        elif move.src == "disk":
            assert state.dcp_dir is not None
            layout = Layout.of({k: torch.empty(n, dtype=torch.uint8, device="meta") for k, n in state.sizes.items()})
            state.host = HostCopy(pool.take(layout.nbytes, tally), layout)
            copies += 1
            with _quiet_dcp():  # straight into the (pinned) pool buffer's views
                dcp.load(state.host.tensors(), storage_reader=dcp.FileSystemReader(str(state.dcp_dir)), no_dist=True)
            shutil.rmtree(state.dcp_dir, ignore_errors=True)
            state.dcp_dir = None
        assert state.host is not None
        if move.dst == "disk":
            where = self.spill_dir / f"{move.job_id}-rank{self.rank}"
            with _quiet_dcp():
                dcp.save(state.host.tensors(), storage_writer=dcp.FileSystemWriter(str(where)), no_dist=True)
            state.dcp_dir = where
            copies += 1
            pool.give(state.host.buffer)
            state.host = None
        elif move.dst == "device":
            host = state.host.tensors()
            order.before_copy(move.job_id)
            for k, s in state.storages.items():
                s.resize_(state.sizes[k])  # allocated on the current stream (the copy stream in the background)
                dst = _bytes_of(s, self.device)
                order.allocated(dst)
                order.copy(move.job_id, dst, host[k])
            copies += len(state.storages)
            tally.made += len(state.storages)  # each storage re-allocated on the device
            order.synchronize()
            pool.give(state.host.buffer)
            state.host = None
            if self.validate and state.checksum is not None:
                # a copy: `checksum` goes through numpy, which pins a storage's size (no more swaps)
                now = {k: _bytes_of(s, self.device).clone() for k, s in state.storages.items()}
                if sw.checksum(now) != state.checksum:
                    raise sw.StateCorrupted(f"job {move.job_id}: rank {self.rank}'s shard changed between swap-out "
                                            "and swap-in")  # fmt: skip
        state.tier = move.dst
        tally.copies, tally.copy = copies, time.perf_counter() - t0
        if copies > 1:
            tally.why.append(f"a rank's shard moves storage by storage ({len(state.storages)} storages)")
        return state.nbytes


# -- what each rank's worker runs ------------------------------------------------------------------------
def _registry() -> dict[str, Service]:
    return SERVICES


def _rank_service(key: str) -> RankService:
    svc = _registry().get(key)
    if not isinstance(svc, RankService):
        raise GroupBroken(f"service {key} has no rank in this worker (restarted?); the group must be re-formed")
    return svc


def start_rank(
    key: str,
    rank: int,
    spec: GroupSpec,
    device: str,
    validate: bool,
    spill_dir: str | None,
    threads: int | None,
    host_memory: int | None = None,
) -> int:
    """Join the group (`spec`) and create this rank's service, dropping an earlier one and its jobs (their
    shards belong to the old process group). Raises `GroupBroken` when the group does not form in time."""
    if threads:
        torch.set_num_threads(threads)
    old = _registry().pop(key, None)
    if old is not None:
        lost = sorted(old.jobs)
        old.close()
        if lost:
            log.warning("group %s re-formed: the state of jobs %s on it is gone", key, lost)
    state = join(spec, rank, device)
    service_id = key.rpartition("/")[2]
    _registry()[key] = RankService(
        service_id, state, device, spill_dir=spill_dir, validate=validate, clock=time.time, host_memory=host_memory
    )
    return os.getpid()


def group_topic(topic: str) -> str:
    """The Dask event topic where ranks report a broken group (beside the executor's report topic)."""
    return f"{topic}-groups"


def _checked(key: str, epoch: int, topic: str) -> tuple[RankService, RankState]:
    try:
        return _rank_service(key), member(key, epoch)
    except GroupBroken:
        publish_broken(group_topic(topic), key, epoch)
        raise


def _agree(state: RankState, error: str | None, topic: str) -> str | None:
    """Exchange errors across ranks (`agree`), unless this rank's error may have left its peers inside a
    collective (a broken group, a failed swap of this rank's shard): then the group is broken, and the client
    is told, so that it re-forms the group before the next task."""
    if state.broken is None and error is not None and error.startswith(("GroupBroken", "swap failed")):
        state.broken = error
    out = agree(state, error) if state.broken is None else f"rank {state.rank}: {error}"
    if state.broken is not None:
        publish_broken(group_topic(topic), state.spec.key, state.spec.epoch)
    return out


def rank_load(topic: str, key: str, rank: int, job: JobSpec, tier: Any, epoch: int, *after: Any) -> LoadReport:
    start = time.time()
    service_id = key.rpartition("/")[2]
    error, nbytes = None, 0
    try:
        svc, state = _checked(key, epoch, topic)
        try:
            nbytes = svc.load_job(job, tier)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        error = _agree(state, error, topic)
    except Exception as exc:  # never raise: a failed task would read as a dead worker
        error = f"{type(exc).__name__}: {exc}"
    return LoadReport(job.job_id, service_id, nbytes, start, time.time(), error)


def rank_node(
    topic: str, handle: int, key: str, rank: int, job_id: str, iteration: int, node: str,
    inputs: dict[str, NodeResult], swaps: tuple[Move, ...], prefetch: tuple[Move, ...], chunk: int, chunks: int,
    parts: list[NodeResult], epoch: int, *after: Any,
) -> NodeResult:  # fmt: skip
    """Run a service node (or chunk `chunk` of `chunks` of one, `parts`: this rank's earlier chunks) on this
    rank (every rank runs it); rank 0 publishes the report. `inputs`: this rank's outputs of earlier service
    nodes, or the cpu nodes' (one copy each)."""
    try:
        svc, state = _checked(key, epoch, topic)
        gone = [j for j in {job_id} | {m.job_id for m in (*swaps, *prefetch)} if j not in svc.jobs]
        if gone:  # before any collective: every rank finds the same
            raise LookupError(f"the state of job(s) {sorted(gone)} on this group is gone: the group was re-formed "
                              f"after a failure (now epoch {epoch})")  # fmt: skip
        outputs: dict[str, Any] = {p: r.output for p, r in inputs.items()}
        outs = [r.output for r in parts if r.output is not None]
        result = svc.run_node(job_id, iteration, node, outputs, swaps, prefetch, chunk, chunks, outs)
        error = _agree(state, result.report.error, topic)
        if error != result.report.error:
            result = NodeResult(result.report, None)
            result.report.error = error
    except Exception as exc:  # never raise: a failed task would read as a dead worker
        now = time.time()
        result = NodeResult(NodeReport(job_id, iteration, node, f"{type(exc).__name__}: {exc}", now, now))
    if rank == 0:
        publish(topic, handle, result.report)
    return result


def rank_part(path: str | Path, rank: int) -> Path:
    """Where rank `rank` writes its part of the group checkpoint at `path`."""
    path = Path(path)
    return path.with_name(f"{path.name}.rank{rank}")


def rank_checkpoint(
    topic: str, key: str, rank: int, job_id: str, path: str, extra: dict[str, Any], epoch: int, *after: Any
) -> CheckpointReport:
    """Every rank writes its part (`RankService.checkpoint`), the ranks agree that all did, then rank 0
    writes `path` itself: `extra` and the parts' names and count (`{"ranks": N, "parts": [...]}`), so a
    checkpoint at `path` always has every part. A resume on a group of the same size reads rank r's part on
    rank r. Rank 0's report stands for the task."""
    start, service_id, error = time.time(), key.rpartition("/")[2], None
    try:
        svc, state = _checked(key, epoch, topic)
        try:
            svc.checkpoint(job_id, Path(path), extra)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        error = _agree(state, error, topic)
        if error is None and rank == 0:
            world = state.spec.world
            parts = [rank_part(path, r).name for r in range(world)]
            sw.save_checkpoint({**extra, "ranks": world, "parts": parts}, Path(path))
    except Exception as exc:  # never raise: a failed task would read as a dead worker
        error = f"{type(exc).__name__}: {exc}"
    return CheckpointReport(job_id, service_id, path, start, time.time(), error)


def rank_save(key: str, rank: int, job_id: str, path: str, epoch: int, *after: Any) -> str:
    return str(_rank_service(key).save_model(job_id, Path(path)))


def rank_release(key: str, rank: int, job_id: str, epoch: int, *after: Any) -> None:
    svc = _registry().get(key)
    if svc is not None:
        svc.release(job_id)


def stop_rank(key: str) -> dict[str, Any]:
    """Close this rank's service and leave the group; rank 0's report stands for the service."""
    svc = _registry().pop(key, None)
    report = svc.report() if svc is not None else {}
    if svc is not None:
        svc.close()
    leave(key)
    return report
