"""What the first touch of memory costs on this machine: the bound a CPU service's move into a fresh buffer meets.

A state move copies every byte into a buffer. Into a buffer the process touched before, the copy runs at
memory bandwidth; into fresh memory each page is faulted in on its first touch. On bare metal that costs the
kernel zeroing a page; in a virtual machine whose memory balloon reports freed memory back to its host
(virtio-balloon free page reporting), memory the process frees is handed back within moments, and its next
first touch also costs the host a page fault per page. This times one copy of `--gb` GB, in one process:

* into a buffer touched before (the memory-copy bound of a move into a kept buffer);
* into a fresh buffer (`plexrl.services.host.fresh`: huge pages advised, as the service's buffers are);
* into a fresh buffer right after freeing one of the same size (the allocator and the kernel may hand the
  same pages back before anything reclaims them);
* into a fresh buffer `--wait` seconds after freeing one (time for the guest to report the freed pages).

On the machine of docs/benchmarks.md the last three show whether a CPU service must keep its buffers
(`DeviceCache`, `HostPool`): when "after a wait" is far below "just after freeing", freed memory leaves the
machine's reach and every fresh buffer pays for it again.

    .venv/bin/python benchmarks/fresh_memory.py [--gb 2.15] [--wait 3] [--threads 1]
    .venv/bin/python benchmarks/fresh_memory.py --smoke      # 16 MB, no wait (the tests run it)
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence

import torch

from plexrl.services.host import fresh


def timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.15, help="bytes copied, in GB (default: a SmolLM2-135M state)")
    ap.add_argument("--wait", type=float, default=3.0, help="seconds between freeing a buffer and the next one")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the copy (a service's: 1)")
    ap.add_argument("--smoke", action="store_true", help="16 MB, no wait (for the tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.gb, args.wait = 0.016, 0.0
    torch.set_num_threads(args.threads)
    n = int(args.gb * 1e9)
    src = torch.ones(n, dtype=torch.uint8)
    rows: list[tuple[str, float]] = []

    buf = fresh(n)
    first = timed_copy(buf, src)
    touched = min(timed_copy(buf, src) for _ in range(3))
    rows += [("into a buffer touched before (the bound)", touched), ("into a fresh buffer", first)]
    del buf
    gc.collect()
    buf = fresh(n)
    rows.append(("into a fresh buffer right after freeing one", timed_copy(buf, src)))
    del buf
    gc.collect()
    time.sleep(args.wait)
    buf = fresh(n)
    rows.append((f"into a fresh buffer {args.wait:g} s after freeing one", timed_copy(buf, src)))
    del buf

    print(f"one copy of {n / 1e9:.2f} GB on {args.threads} torch thread(s):")
    for label, seconds in rows:
        print(f"  {label:<48} {seconds:7.3f} s  {n / seconds / 1e9:6.2f} GB/s  {seconds / touched:6.1f}x the bound")
    print(f"fresh / touched: {rows[1][1] / touched:.1f}x; after a wait / just after freeing: "
          f"{rows[3][1] / rows[2][1]:.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
