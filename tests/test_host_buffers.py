"""Flat per-job host buffers (docs/gpu.md, "Pinned memory"), on CPU with the pinning decision off (`pin=False`:
the same code path a CUDA service takes with it on):

- a state moves as one block: its first swap-out copies each tensor into ONE host buffer, its swap-in is one
  copy into ONE device buffer whose views the tensors become, and every swap after that is one copy each way;
- the host bytes held are counted as the pages the buffers cover (what page-locking them holds), never a
  power-of-two rounding; a freed buffer is reused by the next swap-out of a state of about its size, and the
  pool stays within its host budget;
- a spilled state is read straight into a pool buffer (no second copy), bit-exact.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY

from plexrl.job.load import load_job
from plexrl.job.spec import JobSpec, prepare_job
from plexrl.planner.state import Move
from plexrl.services.host import ALIGN, PAGE, DeviceCache, HostPool, Layout, covered_bytes
from plexrl.services.service import Service


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> JobSpec:
    cfg: dict[str, Any] = copy.deepcopy(TINY)
    cfg["run_dir"] = str(tmp_path_factory.mktemp("host") / "runs")
    cfg["tracking"]["mlflow"] = False
    return prepare_job(load_job(cfg))


def test_a_layout_places_every_tensor_aligned_and_its_views_round_trip() -> None:
    tensors = {"a": torch.arange(5, dtype=torch.float32), "b": torch.ones(3, 2, dtype=torch.bfloat16),
               "c": torch.tensor([7], dtype=torch.int64)}  # fmt: skip
    layout = Layout.of(tensors)
    assert [s.offset for s in layout.slots] == [0, ALIGN, 2 * ALIGN]
    assert layout.data_bytes == 20 + 12 + 8 and layout.nbytes == 3 * ALIGN
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(flat)
    for name, t in tensors.items():
        views[name].copy_(t)
    assert all(torch.equal(layout.views(flat)[k], v) for k, v in tensors.items())
    assert layout.flat_of(views) is not None  # views of one buffer at their slots: one copy moves them
    assert layout.flat_of(tensors) is None  # separate tensors: one copy each


def test_the_pool_counts_the_pages_it_holds_reuses_a_freed_buffer_and_keeps_to_its_limit() -> None:
    pool = HostPool(pin=False, limit=3 * 2**20)
    a = pool.take(2**20 + 1)  # just over a power of two: the pinned allocator would hold 2 MiB for it
    assert pool.held_bytes == covered_bytes(a.data_ptr(), 2**20 + 1) <= 2**20 + 2 * PAGE
    assert pool.pinned_bytes == 0  # not pinned (CPU)
    pool.give(a)
    assert pool.held_bytes > 0  # kept for the next swap-out
    b = pool.take(2**20)  # about the same size: the kept buffer again
    assert b.data_ptr() == a.data_ptr() and (pool.made, pool.reused) == (1, 1)
    pool.give(b)
    c = pool.take(2 * 2**20 + 2**19)  # far larger: a new one, and the kept one goes to stay under the limit
    assert pool.made == 2 and pool.held_bytes == covered_bytes(c.data_ptr(), c.numel()) <= 3 * 2**20
    pool.give(c)
    pool.clear()
    assert pool.held_bytes == 0
    assert HostPool(pin=True).pinned_bytes == 0  # the decision is the caller's: nothing held yet
    # a CPU service's device cache shares the unpinned pool's kept buffers; a pinned (CUDA) pool's stay its own
    assert DeviceCache(pool=HostPool(pin=True)).pool is None and DeviceCache(pool=pool).pool is pool


def test_a_state_moves_as_one_block_and_the_host_bytes_are_its_pages(job: JobSpec, tmp_path: Path) -> None:
    svc = Service("s0", spill_dir=tmp_path / "spill", validate=True)
    j = job.job_id
    svc.load_job(job)
    live = svc.engines[j].state_tensors()
    want = {k: v.detach().clone() for k, v in live.items()}
    n = len(live)
    assert n > 10  # weights, reference-free AdamW moments: many tensors

    svc.apply([Move(j, "device", "host", 0)])
    state = svc.states[j]
    assert state.host is not None
    layout = state.host.layout
    assert layout.data_bytes == state.nbytes and layout.nbytes - state.nbytes < ALIGN * n
    report = svc.report()
    assert report["copies"] == 1  # one flat buffer since its load (`swap.flatten`): one copy into ONE buffer
    assert report["host_bytes_held"] == covered_bytes(state.host.buffer.data_ptr(), layout.nbytes)
    assert report["pinned_bytes"] == 0

    svc.apply([Move(j, "host", "device", 0)])
    assert svc.report()["copies"] == 2  # swap-in: one copy, the tensors are views of one device buffer
    assert len({t.untyped_storage().data_ptr() for t in live.values()}) == 1
    assert all(torch.equal(live[k], want[k]) for k in want)

    svc.apply([Move(j, "device", "host", 0), Move(j, "host", "device", 0)])
    assert svc.report()["copies"] == 4  # one copy each way
    assert svc.host_pool.made == 1 and svc.host_pool.reused == 1  # the kept buffer served the second swap-out

    # a spill: the bytes go to disk as they lie, and come back into a pool buffer, bit-exact
    svc.apply([Move(j, "device", "host", 0), Move(j, "host", "disk", 0)])
    assert svc.states[j].host is None and (tmp_path / "spill" / f"{j}.spill").stat().st_size == layout.nbytes
    svc.apply([Move(j, "disk", "host", 0), Move(j, "host", "device", 0)])
    assert all(torch.equal(live[k], want[k]) for k in want)
    assert svc.host_pool.made == 1  # the disk read went into the kept buffer too
    svc.release(j)
    assert svc.host_pool.held_bytes <= covered_bytes(0, layout.nbytes) + PAGE  # at most the one kept buffer
    svc.close()
    assert svc.host_pool.held_bytes == 0


def test_two_jobs_share_the_pool_within_the_host_budget(job: JobSpec) -> None:
    a, b = (dataclasses.replace(job, job_id=name) for name in ("a", "b"))
    probe = Service("probe")
    size = probe.load_job(a)
    probe.close()
    budget = 2 * size + 2**20  # two states and their alignment padding
    svc = Service("s0", host_memory=budget)
    svc.load_job(a)
    svc.load_job(b)
    for _ in range(3):
        svc.apply([Move("a", "device", "host", 0), Move("b", "device", "host", 0)])
        assert svc.host_pool.held_bytes <= budget
        svc.apply([Move("a", "host", "device", 0), Move("b", "host", "device", 0)])
    assert svc.host_pool.peak_bytes <= budget
    # on a CPU the pool and the device cache are one memory: the two loads' buffers and ONE more serve every
    # swap after (each swap-out's host buffer is the buffer the previous swap left), none made twice
    assert svc.device_cache is not None and (svc.device_cache.made, svc.host_pool.made) == (2, 1)
    svc.close()


def test_a_cpu_service_hands_a_finished_jobs_buffer_to_the_next_load_not_to_the_system(job: JobSpec) -> None:
    """Fresh memory costs page faults (in a virtual machine that returns freed memory to its host, seconds per
    GB): a released job's one device buffer is kept and the next job's load lays its state out in it."""
    a, b = (dataclasses.replace(job, job_id=name) for name in ("a", "b"))
    probe = Service("probe")
    probe.load_job(b)
    want = {k: v.detach().clone() for k, v in probe.engines["b"].state_tensors().items()}
    probe.close()
    svc = Service("s0")
    assert svc.device_cache is not None
    svc.load_job(a)
    a_live = svc.engines["a"].state_tensors()
    with torch.no_grad():
        for t in a_live.values():
            t.fill_(7)  # what a's training left: none of it may show through b's state
    a_ptr = next(iter(a_live.values())).untyped_storage().data_ptr()
    svc.release("a")
    svc.load_job(b)
    live = svc.engines["b"].state_tensors()
    assert next(iter(live.values())).untyped_storage().data_ptr() == a_ptr and svc.device_cache.reused == 1
    assert all(torch.equal(live[k], want[k]) for k in want)
    svc.apply([Move("b", "device", "host", 0), Move("b", "host", "device", 0)])
    assert all(torch.equal(svc.engines["b"].state_tensors()[k], want[k]) for k in want)
    svc.close()


def test_a_cpu_service_reuses_a_freed_device_buffer_only_when_no_tensor_still_views_it(job: JobSpec) -> None:
    """A CPU "device" is host memory, where a fresh buffer pays a page fault per page on first touch (a 2.2 GB
    state's swap-in took ~1.5 s instead of ~0.25 s): the buffer a swapped-out state leaves is kept for the next
    swap-in, as CUDA's caching allocator would keep it; never while any tensor still views it."""
    a, b = (dataclasses.replace(job, job_id=name) for name in ("a", "b"))
    svc = Service("s0")
    assert svc.device_cache is not None  # a CUDA service has none: its allocator caches (tested in test_gpu)
    svc.load_job(a)
    svc.load_job(b)
    want = {j: {k: v.detach().clone() for k, v in svc.engines[j].state_tensors().items()} for j in "ab"}
    svc.apply([Move("b", "device", "host", 0), Move("b", "host", "device", 0)])  # b: one flat device buffer
    svc.apply([Move("a", "device", "host", 0), Move("a", "host", "device", 0)])  # a: its own flat buffer
    made, reused = svc.device_cache.made, svc.device_cache.reused

    # hand-overs b -> a -> b: each swap-in takes the buffer the other's swap-out left
    svc.apply([Move("b", "device", "host", 0)])
    assert svc.device_cache.reused == reused
    svc.apply([Move("a", "device", "host", 0), Move("b", "host", "device", 0)])
    assert svc.device_cache.made == made and svc.device_cache.reused == reused + 1
    assert all(torch.equal(svc.engines[j].state_tensors()[k], want[j][k]) for j in "b" for k in want[j])

    # a stray view of b's buffer (something outside the state still reading it): b's swap-out must not hand
    # that buffer to a's swap-in, which would overwrite what the view reads
    stray = next(iter(svc.engines["b"].state_tensors().values())).detach()[:4]
    seen = stray.clone()
    stray_ptr = stray.untyped_storage().data_ptr()
    svc.apply([Move("b", "device", "host", 0), Move("a", "host", "device", 0)])
    a_ptr = next(iter(svc.engines["a"].state_tensors().values())).untyped_storage().data_ptr()
    assert a_ptr != stray_ptr and torch.equal(stray, seen)
    svc.apply([Move("a", "device", "host", 0), Move("b", "host", "device", 0)])
    assert all(torch.equal(svc.engines[j].state_tensors()[k], want[j][k]) for j in "b" for k in want[j])
    svc.apply([Move("a", "host", "device", 0)])
    assert all(torch.equal(svc.engines["a"].state_tensors()[k], want["a"][k]) for k in want["a"])
    svc.close()
