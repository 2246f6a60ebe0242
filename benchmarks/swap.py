"""Swap throughput of one job's state against the raw copy bandwidth of the same machine, in one run.

Builds a state of about `--mb` MiB of named fp32 tensors shaped like `TorchEngine.state_tensors()`: the
weights of a small llama-like transformer (embedding, q/k/v/o and gate/up/down matrices, norm vectors) plus
the two AdamW moments of every weight, under the same names the engine uses. Then, in one process:

* raw copy, one buffer: a single `copy_` of a contiguous buffer of the state's total size, into a fresh
  buffer each time (allocation and first-touch page faults included) and into a reused one (pure bandwidth);
* raw copy, per tensor: for every state tensor a fresh buffer (`torch.empty` + `copy_`), which is the least
  a swap has to do; this is the baseline the ratio is taken against. Also timed: dropping such a set of
  buffers, which a swap-out does inside (the old device storage) and the service after a swap-in (the host
  copy);
* swap-out `device_to_host` and swap-in `host_to_device` from `plexrl/services/swap.py`, the functions the
  service's moves call (one flat host buffer per state from a `HostPool`; after the first swap-in the state
  is one device buffer, so each later swap is one copy), each timed on its own; the per-tensor raw copies
  are interleaved with them in every repeat (raw-out just before swap-out from the same live tensors,
  raw-in just before swap-in from the same host copies), so drift or other load hits both sides alike;
* a disk spill round trip, `host_to_disk` into a temporary directory and `disk_to_host` back, followed by the
  swap-in the service does next. Nothing is fsynced, so the file is written to and read back from the page
  cache (and stays there): these numbers are an upper bound of what the disk itself gives (`--fsync` also
  times the write-back, `--spill-dir` picks the file system). `disk_to_host` reads the file straight into a
  host buffer of the service's pool (pinned on CUDA).

Every phase runs once untimed first (warm-up): the first touch of fresh memory costs page faults and glibc
only raises its mmap threshold after the first large free, which would otherwise dominate the first run.
Reported: best and median over `--repeats` (GB/s = 10^9 bytes / s), and the ratio swap / raw per-tensor copy
(the worse of swap-in and swap-out, goal >= 0.70; on CPU both are held to the faster of the two raw
per-tensor copies, which are the same memory-to-memory copy). The state's checksum is compared before and
after all the moves. On CPU the "device" tier is the engine's working copy, so both directions are
memory-to-memory copies; with `--device cuda` host buffers are pinned and every timer stops after a device
synchronize. Live buffers never exceed 2x the state (the state plus one copy); the process's RSS gets to
about 3x above torch's own, as glibc keeps freed blocks for reuse and the disk copy is mapped from the page
cache. Freed blocks are handed back to the OS between phases (`malloc_trim`), not within one, which would
change what is measured.

The "faults" column (minor page faults x 4 KiB / state size) tells where time goes on CPU: a copy into pages
the allocator already holds runs at memcpy speed, one into fresh pages from the kernel at a fraction of it,
and freeing a tensor above glibc's 32 MiB mmap ceiling unmaps it (the "free" rows; a swap-out pays that
inside). Which tensors land on recycled pages depends on the heap's layout, so the state is generated in
place: temporaries while building it left layouts that varied from run to run, and with them the ratio
(0.55 to 0.98 on the same machine). Run it with nothing else heavy running: when other processes hold
cores, each per-tensor `copy_` (one intra-op parallel region) waits for its preempted worker thread, and
per-tensor copies, raw and swap alike, drop far below the one-buffer copy (compare `--threads 1`).

    .venv/bin/python benchmarks/swap.py [--mb 300] [--repeats 5] [--device cpu|cuda] [--hidden 1024] [--smoke]

The last line also holds the swaps against the machine's plain memory bandwidth: one reused buffer of the
state's size filled by a single `copy_` (no allocation, no page faults, one parallel region), the fastest a
byte can move here. `--smoke`: an 8 MiB state, one repeat of everything (the test suite runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plexrl.services import swap as sw
from plexrl.services.host import HostPool
from plexrl.services.streams import stream_order

MiB = 1 << 20


def transformer_shapes(mb: float, hidden: int) -> dict[str, tuple[int, ...]]:
    """Weight shapes of a llama-like model (tied embedding) whose weights + two AdamW moments take about `mb`
    MiB: the layer count and then the vocabulary are chosen so that the weights take a third of the budget."""
    ffn = 4 * hidden
    params = int(mb * MiB) // 4 // 3
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden
    layers = max(1, params * 3 // 4 // per_layer)
    vocab = max(1, (params - layers * per_layer - hidden) // hidden)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{proj}.weight"] = (hidden, hidden)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (ffn, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (ffn, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, ffn)
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def transformer_state(shapes: dict[str, tuple[int, ...]], device: torch.device, seed: int = 0) -> dict[str, Tensor]:
    """Live tensors named like `TorchEngine.state_tensors()`: policy weights, then their AdamW moments."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        state[f"policy.{name}"] = torch.empty(shape, device=device).normal_(generator=gen)  # in place: no temporaries
    for pi, shape in enumerate(shapes.values()):  # what TorchEngine.state_tensors() names the AdamW state
        state[f"optimizer.0.{pi}.exp_avg"] = torch.empty(shape, device=device).normal_(0, 1e-3, generator=gen)
        state[f"optimizer.0.{pi}.exp_avg_sq"] = torch.empty(shape, device=device).uniform_(0, 1e-6, generator=gen)
    return state


class Recorder:
    """Times calls: wall-clock seconds (after a device synchronize on both ends on CUDA) and the process's
    minor page faults during the call, kept per key while `on` (off for the warm-up)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else None
        self.on = False
        self.seconds: dict[str, list[float]] = {}
        self.faults: dict[str, list[int]] = {}

    def __call__(self, key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        if self.on:
            self.seconds.setdefault(key, []).append(seconds)
            self.faults.setdefault(key, []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        return result


def raw_copy(src: dict[str, Tensor], device: torch.device, pin: bool, non_blocking: bool) -> dict[str, Tensor]:
    """What a swap must do at least: a fresh buffer per tensor (pinned if `pin`), filled by one `copy_`."""
    out = {}
    for name, t in src.items():
        buf = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
        buf.copy_(t, non_blocking=non_blocking)
        out[name] = buf
    return out


def copy_into_fresh(src: Tensor, device: torch.device, pin: bool, non_blocking: bool) -> Tensor:
    dst = torch.empty(src.shape, dtype=src.dtype, device=device, pin_memory=pin)
    return dst.copy_(src, non_blocking=non_blocking)


def big_copy(rec: Recorder, tag: str, nbytes: int, src_dev: torch.device, dst_dev: torch.device, repeats: int) -> None:
    """One contiguous buffer of `nbytes` copied by a single `copy_`: into a fresh buffer each time, and into
    one reused buffer (keys `big_fresh{tag}`, `big_reused{tag}`)."""
    cuda = "cuda" in (src_dev.type, dst_dev.type)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=src_dev, pin_memory=cuda and src_dev.type == "cpu")
    src.fill_(1.0)  # touch every page
    pin_dst = cuda and dst_dev.type == "cpu"
    for i in range(repeats + 1):
        rec.on = i > 0
        rec(f"big_fresh{tag}", copy_into_fresh, src, dst_dev, pin_dst, cuda)  # freed at once
    dst = torch.empty(src.shape, dtype=src.dtype, device=dst_dev, pin_memory=pin_dst)
    for i in range(repeats + 1):
        rec.on = i > 0
        rec(f"big_reused{tag}", dst.copy_, src, non_blocking=cuda)
    rec.on = False


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=300.0, help="state size in MiB (policy weights + 2 AdamW moments)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats of every phase (after one warm-up)")
    ap.add_argument("--disk-repeats", type=int, default=2, help="timed disk round trips (after one warm-up)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--hidden", type=int, default=1024, help="model width; matrices are hidden x hidden and x 4*hidden")
    ap.add_argument("--spill-dir", default=None, help="directory of the disk spill file (default: system temp)")
    ap.add_argument("--fsync", action="store_true", help="also time an fsync of the spill file (real write-back)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--smoke", action="store_true", help="8 MiB state, hidden 64, one repeat (for the tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.mb, args.hidden, args.repeats, args.disk_repeats = 8.0, 64, 1, 1
    if args.repeats < 1 or args.disk_repeats < 1:
        ap.error("--repeats and --disk-repeats must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    host = torch.device("cpu")
    rec = Recorder(device)
    run_start = time.perf_counter()
    shapes = transformer_shapes(args.mb, args.hidden)
    size = 3 * 4 * sum(math.prod(s) for s in shapes.values())

    # -- raw copy, one contiguous buffer (before the state exists: with it, memory would reach 3x) -------------
    big_copy(rec, "", size, device, host, args.repeats)
    if cuda:
        big_copy(rec, "_in", size, host, device, args.repeats)
    release_freed_memory()

    # -- the state ---------------------------------------------------------------------------------------------
    live = transformer_state(shapes, device)
    assert sw.nbytes(live) == size
    before = sw.checksum(live)
    largest = max(live.values(), key=Tensor.numel)
    pool, order = HostPool(pin=cuda), stream_order(device)  # the service's host buffers and stream order

    # -- swaps, interleaved with the per-tensor raw copies they are compared with ------------------------------
    for i in range(args.repeats + 1):  # i == 0 is the warm-up
        rec.on = i > 0
        copies = rec("raw_out", raw_copy, live, host, cuda, cuda)
        rec("free_host", copies.clear)  # what the service pays when it drops a host copy after a swap-in
        parked, _ = rec("swap_out", sw.device_to_host, "job", live, device, pool, order)
        copies = rec("raw_in", raw_copy, parked.tensors(), device, False, cuda)
        rec("free_device", copies.clear)  # what device_to_host pays inside, for the storage it drops
        rec("swap_in", sw.host_to_device, "job", live, parked, device, order)
        pool.give(parked.buffer)  # kept for the next swap-out, as the service's pool does
        del parked, copies
    release_freed_memory()

    # -- disk spill round trip (the service's host -> disk -> host -> device path) -----------------------------
    with tempfile.TemporaryDirectory(prefix="plexrl-swapbench-", dir=args.spill_dir) as tmp:
        path = Path(tmp) / "job.spill"
        for i in range(args.disk_repeats + 1):
            rec.on = i > 0
            parked, _ = sw.device_to_host("job", live, device, pool, order)
            rec("spill", sw.host_to_disk, parked, path)
            pool.give(parked.buffer)
            if args.fsync:
                rec("fsync", _fsync, path)
            loaded = rec("load", sw.disk_to_host, path, parked.layout, pool)
            rec("load_in", sw.host_to_device, "job", live, loaded, device, order)
            pool.give(loaded.buffer)
            del loaded, parked
    rec.on = False
    after = sw.checksum(live)

    # -- report ------------------------------------------------------------------------------------------------
    sec, flt = rec.seconds, rec.faults
    legs = [k for k in ("spill", "fsync", "load", "load_in") if k in sec]
    sec["round_trip"] = [sum(x) for x in zip(*(sec[k] for k in legs), strict=True)]
    flt["round_trip"] = [sum(x) for x in zip(*(flt[k] for k in legs), strict=True)]
    best = {k: size / min(v) / 1e9 for k, v in sec.items()}
    median = {k: size / statistics.median(v) / 1e9 for k, v in sec.items()}

    def row(label: str, key: str, ref: str | None = None, rate: bool = True) -> None:
        vs = f"{best[key] / best[ref]:8.2f}" if ref else ""
        pages = statistics.median(flt[key]) * 4096 / size  # share of the state's 4 KiB pages first-touched
        gbs = f"{best[key]:9.2f}{median[key]:9.2f}" if rate else f"{'-':>9}{'-':>9}"
        print(f"{label:<50}{gbs}{min(sec[key]) * 1000:9.1f}{statistics.median(sec[key]) * 1000:9.1f}{pages:8.2f}{vs}")

    print(
        f"state: {size / MiB:.1f} MiB in {len(live)} fp32 tensors ({len(shapes)} weights + 2 AdamW moments each; "
        f"largest {tuple(largest.shape)}), device {device}, torch threads {torch.get_num_threads()}, "
        f"repeats {args.repeats} (+1 warm-up)"
    )
    print("GB/s = state bytes / 10^9 / s; ms = per run; faults = median minor page faults x 4 KiB / state bytes")
    print(f"{'':<50}{'GB/s':>9}{'median':>9}{'ms':>9}{'median':>9}{'faults':>8}{'vs raw':>8}")
    if cuda:
        row("raw copy, one buffer, fresh dst, device->host", "big_fresh")
        row("raw copy, one buffer, reused dst, device->host", "big_reused")
        row("raw copy, one buffer, fresh dst, host->device", "big_fresh_in")
        row("raw copy, one buffer, reused dst, host->device", "big_reused_in")
    else:
        row("raw copy, one buffer, fresh dst", "big_fresh")
        row("raw copy, one buffer, reused dst", "big_reused")
    row("raw copy, per tensor, fresh dst, device->host", "raw_out")
    row("raw copy, per tensor, fresh dst, host->device", "raw_in")
    row("free, per tensor, device storage (in swap-out)", "free_device", rate=False)
    row("free, per tensor, host copy (after swap-in)", "free_host", rate=False)
    # Baselines: on CUDA each direction against the raw copy of that direction. On CPU both raw copies are the
    # same memory-to-memory copy, and which of them lands on recycled pages and which on fresh ones depends on
    # the order of the frees before them (the faults column): both directions are held to the faster one.
    base = {"out": "raw_out", "in": "raw_in"}
    if not cuda:
        base["out"] = base["in"] = max(("raw_out", "raw_in"), key=best.__getitem__)
    row("swap-out  device_to_host", "swap_out", base["out"])
    row("swap-in   host_to_device", "swap_in", base["in"])
    row("disk spill  host_to_disk (page cache)", "spill")
    if args.fsync:
        row("disk fsync  (write-back to the device)", "fsync")
    row("disk load   disk_to_host (read into the pool's buffer)", "load")
    row("disk swap-in host_to_device from the loaded copy", "load_in")
    row("disk round trip, spill + load + swap-in", "round_trip")

    out_ratio, in_ratio = best["swap_out"] / best[base["out"]], best["swap_in"] / best[base["in"]]
    ratio = min(out_ratio, in_ratio)
    med_base = {d: median[k] for d, k in base.items()}
    if not cuda:
        med_base["out"] = med_base["in"] = max(median["raw_out"], median["raw_in"])
    med_ratio = min(median["swap_out"] / med_base["out"], median["swap_in"] / med_base["in"])
    big_in = "big_reused_in" if cuda else "big_reused"
    vs_big = min(best["swap_out"] / best["big_reused"], best["swap_in"] / best[big_in])
    print(f"ratio swap / raw per-tensor copy: out {out_ratio:.2f}, in {in_ratio:.2f} (best-of), "
          f"{med_ratio:.2f} (medians); swap / one reused buffer: {vs_big:.2f}")  # fmt: skip
    verdict = "unchanged" if after == before else "CHANGED"
    print(f"state checksum after {args.repeats + 1} swap cycles and {args.disk_repeats + 1} disk round trips: "
          f"{verdict}; whole run {time.perf_counter() - run_start:.1f} s")  # fmt: skip
    goal = "ok" if ratio >= 0.70 else "BELOW GOAL"
    raw = f"in {best['raw_in']:.1f} / out {best['raw_out']:.1f}" if cuda else f"{best[base['out']]:.1f}"
    print(
        f"swap-in {best['swap_in']:.1f} GB/s, swap-out {best['swap_out']:.1f} GB/s, raw copy {raw} GB/s "
        f"-> ratio {ratio:.2f} (goal >= 0.70, {goal})"
    )
    bandwidth = f"{best['big_reused']:.1f}" + (f" / in {best[big_in]:.1f}" if cuda else "")
    print(f"memory bandwidth (one reused buffer, copy_) {bandwidth} GB/s -> swap / bandwidth {vs_big:.2f}")
    if after != before:
        raise SystemExit("state changed across swaps")


def release_freed_memory() -> None:
    """Give the blocks freed so far back to the OS (glibc keeps them otherwise; the process would hold about
    3.5x the state by the disk phase). Between phases only: the next phase's warm-up takes the faults."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL(None).malloc_trim(0)


def _fsync(path: Path) -> None:
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
