"""Moving one job's state tensors between tiers: device (the engine's working tensors), host (one flat buffer
per job, pinned on CUDA: `plexrl.services.host`) and disk (one raw file per job, its bytes in the host
buffer's layout). The service calls these to carry out the StateManager's moves; nothing here decides
anything.

A move swaps tensor *storage* in place (`t.data = ...`): the engine, its modules and its optimizer keep
their tensor objects, so nothing needs rebuilding and the optimizer's per-parameter state stays attached.
A swap-in gives the job ONE device buffer with every tensor a view of it, so a swap-out of a state that was
swapped in before is one copy (`Layout.flat_of`), and a swap-in always is. Every copy goes through the
service's `StreamOrder` (`plexrl.services.streams`): after the job's last node event, buffers made on a copy
stream marked for the compute stream, host buffers handed back only once their copies are done.
On CPU the device tier is the engine's working copy: a move still copies every byte into a fresh buffer
and frees the old one, so budgets, accounting and bandwidth mean the same as on CUDA.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plexrl.services.host import DeviceCache, HostCopy, HostPool, Layout, Tally, fresh
from plexrl.services.streams import StreamOrder


class StateCorrupted(RuntimeError):
    """A job's state read back from host or disk differs from what was written (validate mode)."""


@dataclass(slots=True)
class StateLocation:
    """Where one job's state is now, with its host copy or spill file (and the layout of its bytes) when it
    is off device."""

    tier: str = "device"
    host: HostCopy | None = None
    disk: Path | None = None
    layout: Layout | None = None  # of the spill file (disk tier)
    checksum: str | None = None
    nbytes: int = 0


def nbytes(tensors: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def checksum(tensors: dict[str, Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(name.encode())
        h.update(t.to("cpu").contiguous().view(torch.uint8).numpy().data)  # the buffer itself, no extra copy
    return h.hexdigest()


def device_to_host(
    job_id: str, live: dict[str, Tensor], device: torch.device, pool: HostPool, order: StreamOrder,
    cache: DeviceCache | None = None, tally: Tally | None = None,
) -> tuple[HostCopy, int]:  # fmt: skip
    """Copy every live tensor into one host buffer (one copy when they are views of one device buffer, else
    one per tensor, and `tally.why` says so), then free the device storage (a CPU service: into `cache` for the
    next swap-in, when nothing else uses it). Returns the host copy and the number of copies."""
    tally = tally if tally is not None else Tally()
    layout = Layout.of(live)
    buf = pool.take(layout.nbytes, tally)
    try:
        t0 = time.perf_counter()
        order.before_copy(job_id)
        t1 = time.perf_counter()
        flat = layout.flat_of(live)
        if flat is not None:
            order.copy(job_id, buf, flat)
            copies = 1
        else:
            tally.why.append(layout.scatter(live))
            views = layout.views(buf)
            for name, t in live.items():
                order.copy(job_id, views[name], t.detach())
            copies = len(live)
        order.synchronize()  # the bytes are on the host before the device storage goes
        tally.wait += t1 - t0
        tally.copy += time.perf_counter() - t1
    except BaseException:
        pool.give(buf)
        raise
    for t in live.values():
        t.data = torch.empty(0, dtype=t.dtype, device=device)
    if cache is not None and flat is not None:
        cache.give(flat)
    tally.copies += copies
    return HostCopy(buf, layout), copies


def host_to_device(
    job_id: str, live: dict[str, Tensor], host: HostCopy, device: torch.device, order: StreamOrder,
    cache: DeviceCache | None = None, tally: Tally | None = None,
) -> int:  # fmt: skip
    """Give every live tensor a view of ONE device buffer (from `cache` on a CPU service, else fresh) filled
    from the host copy in one copy; the host buffer is free once this returns. Returns the number of copies
    (1)."""
    tally = tally if tally is not None else Tally()
    layout = host.layout
    missing = set(live) - layout.names()
    if missing:
        raise StateCorrupted(f"host copy lacks {sorted(missing)[:3]}")
    t0 = time.perf_counter()
    order.before_copy(job_id)
    t1 = time.perf_counter()
    if cache is not None:
        flat = cache.take(layout.nbytes, tally)
    else:
        flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        tally.made += 1  # from the caching allocator (CUDA): not counted apart
    order.allocated(flat)  # made on the copy stream in the background: the compute stream uses it next
    order.copy(job_id, flat, host.buffer)
    views = layout.views(flat)
    for name, t in live.items():
        t.data = views[name]
    order.synchronize()  # the host buffer may be reused once this returns
    tally.wait += t1 - t0
    tally.copy += time.perf_counter() - t1
    tally.copies += 1
    return 1


def flatten(
    job_id: str, live: dict[str, Tensor], device: torch.device, pool: HostPool, order: StreamOrder,
    cache: DeviceCache | None = None,
) -> bool:  # fmt: skip
    """Lay a job's live tensors out as views of ONE device buffer (at its load), so that its every move is one
    copy each way (`Layout.flat_of`). On CPU a direct copy (the state twice, briefly) into a buffer from
    `cache` when given (a kept one before a fresh one); on CUDA through a host buffer (the device never holds
    the state twice). Returns False when it already was one buffer."""
    layout = Layout.of(live)
    if not live or layout.flat_of(live) is not None:
        return False
    if device.type == "cuda":
        host, _ = device_to_host(job_id, live, device, pool, order)
        host_to_device(job_id, live, host, device, order)
        pool.give(host.buffer)
        return True
    n = layout.nbytes
    if device.type == "cpu":
        flat = cache.take(n) if cache is not None else fresh(n)  # huge pages when fresh
    else:
        flat = torch.empty(n, dtype=torch.uint8, device=device)
    views = layout.views(flat)
    with torch.no_grad():
        for name, t in live.items():
            views[name].copy_(t.detach())
            t.data = views[name]
    return True


def recycle(live: dict[str, Tensor], cache: DeviceCache) -> bool:
    """A CPU service forgetting a job whose state is on the device: its one buffer goes to `cache` (when nothing
    else views it) for the next move to reuse, instead of back to the operating system, and its tensors are
    left empty. Returns whether the cache kept it."""
    layout = Layout.of(live)
    flat = layout.flat_of(live) if live else None
    if flat is None:
        return False
    for t in live.values():
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return cache.give(flat)


def host_to_disk(host: HostCopy, path: Path) -> None:
    """Write the host buffer's bytes as they are (the layout stays with the `StateLocation`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(host.buffer.numpy().data)


def _read_into(path: Path, buf: Tensor) -> None:
    with open(path, "rb") as f:
        got = f.readinto(buf.numpy().data)
        if got != buf.numel() or f.read(1):
            raise StateCorrupted(f"spill file {path} holds {path.stat().st_size} bytes, not {buf.numel()}")


def disk_to_host(path: Path, layout: Layout, pool: HostPool, tally: Tally | None = None) -> HostCopy:
    """Read a spilled state straight into a host buffer from `pool` (pinned on CUDA: no pageable copy on the
    way), then remove the file."""
    buf = pool.take(layout.nbytes, tally)
    try:
        _read_into(path, buf)
    except BaseException:
        pool.give(buf)
        raise
    path.unlink()
    return HostCopy(buf, layout)


def read_spill(path: Path | None, layout: Layout | None) -> dict[str, Tensor]:
    """A spilled state's tensors, read without consuming the file (a checkpoint of a job on disk)."""
    if path is None or layout is None:
        raise StateCorrupted("the job is on disk but has no spill file")
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    _read_into(path, buf)
    return layout.views(buf)


@contextlib.contextmanager
def pointed_at(live: dict[str, Tensor], tensors: dict[str, Tensor]) -> Iterator[None]:
    """Point each live tensor named in `tensors` at that tensor's storage (same shape and dtype) while the body
    runs, then back: a state read where it lies (a checkpoint, a save) without moving it. Not thread-safe with
    a node or a move of the same job."""
    kept = {k: live[k].data for k in tensors}
    try:
        for k, t in tensors.items():
            live[k].data = t
        yield
    finally:
        for k, t in kept.items():
            live[k].data = t


def carry_out(
    job_id: str, src: str, dst: str, state: StateLocation, live: dict[str, Tensor], *, device: torch.device,
    pool: HostPool, order: StreamOrder, spill_dir: Path, validate: bool, cache: DeviceCache | None = None,
    tally: Tally | None = None,
) -> int:  # fmt: skip
    """Move one job's state from tier `src` to `dst` (the caller checked that it is on `src`), updating
    `state`; in validate mode checksum it at swap-out and check it at swap-in. Returns the copy calls made;
    `tally` gets the move's figures (a disk write or read counts as one copy)."""
    tally = tally if tally is not None else Tally()
    if {src, dst} == {"device", "disk"}:
        tally.why.append(f"{src} -> {dst} goes through a host buffer: two copies")
    if src == "device":
        state.nbytes = nbytes(live)  # grows once the optimizer has state
        state.host, _ = device_to_host(job_id, live, device, pool, order, cache, tally)
        if validate:
            state.checksum = checksum(state.host.tensors())
    elif src == "disk":
        assert state.disk is not None and state.layout is not None
        t0 = time.perf_counter()
        state.host, state.disk = disk_to_host(state.disk, state.layout, pool, tally), None
        tally.copy += time.perf_counter() - t0
        tally.copies += 1
    assert state.host is not None
    if dst == "disk":
        path = spill_dir / f"{job_id}.spill"
        t0 = time.perf_counter()
        host_to_disk(state.host, path)
        tally.copy += time.perf_counter() - t0
        tally.copies += 1
        state.disk, state.layout = path, state.host.layout
        pool.give(state.host.buffer)
        state.host = None
    elif dst == "device":
        host_to_device(job_id, live, state.host, device, order, cache, tally)
        pool.give(state.host.buffer)
        state.host = None
        if validate and state.checksum is not None and checksum(live) != state.checksum:
            raise StateCorrupted(f"job {job_id}: state checksum changed between swap-out and swap-in")
    state.tier = dst
    return tally.copies


def save_checkpoint(obj: dict[str, object], path: Path) -> Path:
    """`torch.save` `obj` to `path` atomically: a temp file in the same directory, fsynced, renamed over
    `path`, the directory fsynced. On any error the temp file is removed and `path` is left as it was."""
    import os

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    """What `save_checkpoint` wrote (tensors and plain data only: `weights_only=True`)."""
    out: dict[str, Any] = torch.load(str(path), map_location="cpu", weights_only=True)
    return out
