"""Flat host buffers for swapped-out states: one buffer per job state, its tensors as views (`Layout`), from a
per-service pool (`HostPool`) that counts the host bytes it really holds.

A state moves as ONE block: `Layout.of(tensors)` places every tensor at an aligned offset of one flat byte
buffer, and `Layout.views(flat)` gives the tensors back as typed views of it. A job swapped in gets one device
buffer with its tensors as views, so its next swap-out (and every one after) is one copy each way instead of
one per tensor (a SmolLM2 state with AdamW is ~900 tensors); before its first swap-in it takes one copy per
tensor into the one host buffer.

Pinned memory: a CUDA service's host buffers are page-locked so that copies run as DMA beside the compute.
PyTorch's pinned allocator (`pin_memory=True`) rounds every buffer up to a power of two and keeps freed blocks
for ever, so a host tier budgeted at N bytes could lock up to 2N and never give them back. The pool instead
allocates plain host memory and page-locks exactly that range (`cudaHostRegister`); `held_bytes` counts the
pages really held (in use plus kept for reuse), `pinned_bytes` the same when pinned. Freed buffers are kept
for the next swap-out of a state of about the same size (pinning costs time) as long as the pool stays within
`limit` (the service's host budget: page-locked bytes never exceed what the host tier was granted) and keeps
at most `keep` bytes idle; otherwise they are unpinned and freed.

The pinning decision is a constructor argument (`pin`): a CPU test runs the same code with `pin=False` and
checks the same byte counts (the pages a buffer covers). Nothing here decides what moves where.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

log = logging.getLogger(__name__)

ALIGN = 256  # bytes between slots: every view starts where a vectorised CUDA kernel may read it
PAGE = 4096  # the unit page-locking works in
HUGE_MIN = 64 << 20  # a host buffer this large is its own mapping (above glibc's largest mmap threshold)
MADV_HUGEPAGE = 14  # Linux


def _up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _fits(cap: int, nbytes: int) -> bool:
    """A kept buffer of `cap` bytes serves a request of `nbytes`: large enough, at most 1/8 (and a page) more."""
    return nbytes <= cap <= nbytes + nbytes // 8 + PAGE


def _take_fitting(idle: list[Tensor], nbytes: int) -> Tensor | None:
    """The smallest kept buffer of `idle` that serves `nbytes` (`_fits`), removed from `idle`; None when none does.
    (Kept buffers are whole uint8 storages: their length is their capacity.)"""
    fits = [b for b in idle if _fits(b.numel(), nbytes)]
    if not fits:
        return None
    buf = min(fits, key=lambda b: b.numel())
    idle[:] = [b for b in idle if b is not buf]
    return buf


@dataclass(slots=True)
class Tally:
    """What one move did, filled in as it goes (`plexrl.services.swap`; the service turns it into a
    `MoveRecord`): copy calls, buffers made vs reused, seconds copying and waiting, and why it was not one
    copy each way ("" when it was)."""

    copies: int = 0
    made: int = 0
    reused: int = 0
    copy: float = 0.0
    wait: float = 0.0
    why: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Slot:
    """One tensor's place in a flat buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each of a state's tensors sits in its flat byte buffer (`nbytes` long, slots `ALIGN`-aligned, in
    the order given). `data_bytes`: the tensors' own bytes (what the planner budgets)."""

    slots: tuple[Slot, ...]
    nbytes: int
    data_bytes: int

    @classmethod
    def of(cls, tensors: Mapping[str, Tensor]) -> Layout:
        slots, offset, data = [], 0, 0
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            slots.append(Slot(name, t.dtype, tuple(t.shape), offset, n))
            offset = _up(offset + n, ALIGN)
            data += n
        return cls(tuple(slots), offset, data)

    def names(self) -> set[str]:
        return {s.name for s in self.slots}

    def views(self, flat: Tensor) -> dict[str, Tensor]:
        """The tensors as views of `flat` (uint8 [nbytes], on any device)."""
        if flat.dtype != torch.uint8 or flat.numel() < self.nbytes:
            raise ValueError(f"a flat buffer of {self.nbytes} bytes is needed, got {flat.dtype} [{flat.numel()}]")
        return {s.name: flat[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.slots}

    def scatter(self, tensors: Mapping[str, Tensor]) -> str:
        """Why `tensors` are not one buffer at this layout's slots (`flat_of` gave None): how many buffers
        they lie in and the first tensor out of place."""
        storages = {t.untyped_storage().data_ptr() for t in tensors.values() if t.numel() > 0}
        first = self.slots[0].name if self.slots else ""
        for s in self.slots:
            t = tensors[s.name]
            if s.nbytes and (not t.is_contiguous() or t.storage_offset() * t.element_size() != s.offset):
                first = s.name
                break
        return f"state in {len(storages)} buffers, {len(self.slots)} tensors (first out of place: {first})"

    def flat_of(self, tensors: Mapping[str, Tensor]) -> Tensor | None:
        """The one buffer (uint8 [nbytes]) every tensor of `tensors` is a contiguous view of at its slot (a state
        swapped in by `views`), so that one copy moves them all; None when they lie elsewhere."""
        storage = None
        for s in self.slots:
            t = tensors[s.name]
            if s.nbytes == 0:
                continue
            st = t.untyped_storage()
            if storage is None:
                storage = st
                if not _fits(st.nbytes(), self.nbytes):
                    return None
            elif st.data_ptr() != storage.data_ptr():
                return None
            if not t.is_contiguous() or t.storage_offset() * t.element_size() != s.offset:
                return None
        if storage is None:
            return None
        flat = torch.empty(0, dtype=torch.uint8, device=tensors[self.slots[0].name].device).set_(storage)
        return flat[: self.nbytes]  # a reused buffer (`DeviceCache`) may be up to 1/8 longer than the state


@dataclass(slots=True)
class HostCopy:
    """A state in host memory: its flat buffer (from a `HostPool`) and where each tensor sits in it."""

    buffer: Tensor
    layout: Layout

    def tensors(self) -> dict[str, Tensor]:
        return self.layout.views(self.buffer)


def fresh(nbytes: int) -> Tensor:
    """A new flat uint8 buffer in host memory. One of `HUGE_MIN` bytes or more is advised for transparent huge
    pages (Linux `madvise(MADV_HUGEPAGE)`, before its first touch), so that the first copy into it takes a page
    fault per 2 MiB instead of per 4 KiB: measured here, a 2.15 GB copy into a fresh buffer took 0.91 s and
    525,449 faults, 0.30 s and 1,674 faults so advised, 0.24 s into a touched buffer. Where the kernel offers
    no huge pages the advice does nothing."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes >= HUGE_MIN and sys.platform == "linux":
        huge = 2 << 20
        start = -(-buf.data_ptr() // huge) * huge
        end = (buf.data_ptr() + nbytes) // huge * huge
        if end > start:
            _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)  # errors: ignored
    return buf


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def covered_bytes(ptr: int, nbytes: int) -> int:
    """The bytes of the pages that [ptr, ptr + nbytes) touches: what page-locking it holds."""
    if nbytes <= 0:
        return 0
    return _up(ptr + nbytes, PAGE) - (ptr // PAGE) * PAGE


class HostPool:
    """A service's host buffers (see the module docstring). Thread-safe. `pin`: page-lock them (CUDA);
    `limit`: the host bytes the pool may hold, kept buffers included (None: no limit beyond `keep`); `keep`:
    the most bytes kept idle for reuse (None: up to `limit`, the host tier's budget, which the planner would
    fill anyway; without a limit, two buffers the size of the largest state seen)."""

    def __init__(self, *, pin: bool, limit: int | None = None, keep: int | None = None) -> None:
        self.pin, self.limit, self.keep = pin, limit, keep
        self._lock = threading.Lock()
        self._idle: list[Tensor] = []  # freed buffers kept for reuse
        self._held: dict[int, int] = {}  # data_ptr -> bytes held for it (pages covered)
        self._largest = 0
        self._warned = False
        self.held_bytes = 0  # host bytes held: buffers in use + kept
        self.peak_bytes = 0
        self.made = 0  # buffers allocated (each one page-locking when pinned)
        self.reused = 0
        self._spare: DeviceCache | None = None  # a CPU service's device cache: its kept buffers serve here too

    @property
    def pinned_bytes(self) -> int:
        return self.held_bytes if self.pin else 0

    def take(self, nbytes: int, tally: Tally | None = None) -> Tensor:
        """A flat uint8 buffer of at least `nbytes` (exactly `nbytes` long; a kept one within 1/8 larger is
        reused). `tally`: counts the buffer as made or reused."""
        with self._lock:
            self._largest = max(self._largest, nbytes)
            buf = _take_fitting(self._idle, nbytes)
            if buf is not None:
                self.reused += 1
                if tally is not None:
                    tally.reused += 1
                return buf[:nbytes]
            while self._idle and self.limit is not None and self.held_bytes + nbytes > self.limit:
                self._free(self._idle.pop(0))  # make room under the limit: the oldest kept buffer goes first
        spare = self._spare.take_idle(nbytes) if self._spare is not None else None  # outside our lock
        buf = spare if spare is not None else fresh(nbytes)
        held = covered_bytes(buf.data_ptr(), int(buf.untyped_storage().nbytes()))
        if self.pin and nbytes > 0:
            _register(buf)
        with self._lock:
            self._held[buf.data_ptr()] = held
            self.held_bytes += held
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            self.made += spare is None
            self.reused += spare is not None
            if tally is not None:
                tally.made += spare is None
                tally.reused += spare is not None
            if self.limit is not None and self.held_bytes > self.limit and not self._warned:
                self._warned = True  # once: the planner budgets data bytes, the pool holds pages and padding
                log.warning("host buffers hold %d bytes, over the host budget of %d (alignment padding or a "
                            "state larger than planned)", self.held_bytes, self.limit)  # fmt: skip
        return buf[:nbytes]

    def take_idle(self, nbytes: int) -> Tensor | None:
        """A kept buffer that fits `nbytes` (its whole storage), leaving the pool (no longer counted in
        `held_bytes`), or None: how a CPU service's `DeviceCache` takes a host buffer before making one."""
        if self.pin:
            return None  # page-locked: a host buffer only
        with self._lock:
            buf = _take_fitting(self._idle, nbytes)
            if buf is not None:
                self.held_bytes -= self._held.pop(buf.untyped_storage().data_ptr(), 0)
        return buf

    def give(self, buf: Tensor) -> None:
        """Hand back a buffer from `take` (its copies done): kept for reuse within `keep` and `limit`, else
        freed."""
        with self._lock:
            base = self._base(buf)
            if base is None:
                return  # not ours (already freed, or a view of a read-only spill): nothing to do
            keep = self.keep if self.keep is not None else self.limit if self.limit is not None else 2 * self._largest
            idle = sum(self._cap(b) for b in self._idle)
            if idle + self._cap(base) <= keep and (self.limit is None or self.held_bytes <= self.limit):
                self._idle.append(base)
            else:
                self._free(base)

    def clear(self) -> None:
        """Free every kept buffer (buffers in use stay theirs' until handed back)."""
        with self._lock:
            while self._idle:
                self._free(self._idle.pop())

    def _cap(self, buf: Tensor) -> int:
        return int(buf.untyped_storage().nbytes())

    def _base(self, buf: Tensor) -> Tensor | None:
        ptr = buf.untyped_storage().data_ptr()
        if ptr not in self._held:
            return None
        return torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage())

    def _free(self, buf: Tensor) -> None:
        ptr = buf.untyped_storage().data_ptr()
        self.held_bytes -= self._held.pop(ptr, 0)
        if self.pin and buf.numel() > 0:
            _unregister(ptr)


class DeviceCache:
    """A CPU service's freed "device" buffers, kept for the next swap-in, as CUDA's caching allocator keeps freed
    device blocks (a CUDA service has no `DeviceCache`: the allocator does this). On a CPU the device is host
    memory, and a fresh buffer pays a page fault per page on first touch: measured here, a copy of 2.2 GB into
    a fresh buffer ran at 0.27 GB/s against 4.95 GB/s into a touched one (one thread), so without reuse every
    swap-in of a real-size state cost seconds of page faults, not a copy.

    `give` keeps a swapped-out state's flat buffer only when nothing else uses its storage any more (no view
    of it left anywhere: reusing it can never overwrite what a tensor still reads); at most `keep` bytes idle
    (None: two buffers the size of the largest state seen: a planner often swaps two states out before the
    next swap-in). `take` hands back a kept buffer within 1/8 of the
    size, else one the service's host `pool` keeps (on a CPU both are the same memory: a swap-out's host buffer
    may serve the next swap-in and a swapped-out state's device buffer the next swap-out, and the pool takes
    this cache's kept buffers likewise), else a fresh one. Fresh memory costs more than its page faults in a
    virtual machine that hands freed guest memory back to its host (free page reporting): measured here, a
    swap into a fresh 2.15 GB buffer took 4.7-7.9 s (0.3-0.45 GB/s) against 0.2 s into a kept one. Thread-safe."""

    def __init__(self, keep: int | None = None, pool: HostPool | None = None) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._idle: list[Tensor] = []
        self._largest = 0
        self.made = 0
        self.reused = 0
        self.pool = pool if pool is not None and not pool.pin else None
        if self.pool is not None:
            self.pool._spare = self

    def take(self, nbytes: int, tally: Tally | None = None) -> Tensor:
        with self._lock:
            self._largest = max(self._largest, nbytes)
            buf = _take_fitting(self._idle, nbytes)
            if buf is not None:
                self.reused += 1
                if tally is not None:
                    tally.reused += 1
                return buf[:nbytes]
        spare = self.pool.take_idle(nbytes) if self.pool is not None else None  # outside our lock
        with self._lock:
            self.made += spare is None
            self.reused += spare is not None
            if tally is not None:
                tally.made += spare is None
                tally.reused += spare is not None
        return spare[:nbytes] if spare is not None else fresh(nbytes)

    def take_idle(self, nbytes: int) -> Tensor | None:
        """A kept buffer that fits `nbytes` (its whole storage), leaving the cache, or None: how the host pool
        takes one before making one."""
        with self._lock:
            return _take_fitting(self._idle, nbytes)

    def give(self, flat: Tensor) -> bool:
        """Keep `flat`'s whole storage for reuse if `flat` is its only user (True), else leave it (False)."""
        storage = flat.untyped_storage()
        if flat.device.type != "cpu" or not _sole_user(flat, storage):
            return False
        base = torch.empty(0, dtype=torch.uint8).set_(storage)
        with self._lock:
            keep = self.keep if self.keep is not None else 2 * self._largest
            if sum(b.numel() for b in self._idle) + base.numel() > keep:
                return False
            self._idle.append(base)
        return True

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()


def _sole_user(flat: Tensor, storage: torch.UntypedStorage) -> bool:
    """True when `flat` (and the base tensor a view keeps alive) is all that holds `storage`, besides the
    Python object asking: no other tensor views it. Without torch's use count: False (never reused)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    own = 2 + (flat._base is not None)
    return count is not None and int(count(storage._cdata)) <= own


def _register(buf: Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel()} host bytes failed (error {int(err)}): the host "
                           "may be out of lockable memory (ulimit -l) or services.host_memory too large")  # fmt: skip


def _unregister(ptr: int) -> None:
    err = torch.cuda.cudart().cudaHostUnregister(ptr)
    if int(err) != 0:
        log.warning("cudaHostUnregister failed (error %d)", int(err))


__all__ = ["ALIGN", "PAGE", "DeviceCache", "HostCopy", "HostPool", "Layout", "Slot", "Tally", "covered_bytes", "fresh"]
