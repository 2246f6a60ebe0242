"""How much of a state swap the service's copy stream hides behind another job's compute, in one run.

A job's state (`--mb` MiB of fp32 tensors) is swapped out to pinned host memory and back in by the
service's own background mover (`plexrl.services.moves.BackgroundMoves` with a CUDA copy stream, the
functions `plexrl.services.swap.device_to_host` / `host_to_device`), while a second job computes on the
default stream (bf16 matrix products sized to take about as long as the swap). Timed, each after a warm-up
and a device synchronize:

* the swap round trip alone, on the copy stream (GB/s = 2 x state bytes / 10^9 / s);
* a plain device-to-host copy of the same bytes (`tensor.cpu()` of one buffer into pageable memory: what a
  loop that just calls `.cpu()` would get), the reference the swap's GB/s is held to;
* the compute alone, and compute + swap started together.

hidden = (compute alone + swap alone - both together) / swap alone, clipped to [0, 1]: 1.0 when the swap costs
the computing job nothing, 0.0 when the two run one after the other. The state's checksum is compared after the moves.

    .venv/bin/python benchmarks/gpu_overlap.py [--device cuda] [--mb 1024] [--repeats 3] [--smoke]

On CPU (`--device cpu`, the fallback `benchmarks/gpu_check.sh --cpu` uses) there is no copy stream: the
mover's thread and the compute share the cores, and the figures only show that the path runs.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import torch

from plexrl.planner.state import Move
from plexrl.services import swap as sw
from plexrl.services.host import HostCopy, HostPool
from plexrl.services.moves import BackgroundMoves, SwapStats
from plexrl.services.streams import stream_order

MiB = 1 << 20


def timed(device: torch.device, fn: Callable[[], object]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda[:N] (or cpu: only checks that the path runs)")
    ap.add_argument("--mb", type=float, default=1024.0, help="the swapped state's size in MiB")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (after one warm-up); best is reported")
    ap.add_argument("--smoke", action="store_true", help="cpu, a 4 MiB state, one repeat (for the tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.mb, args.repeats = "cpu", 4.0, 1
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu")
    n = max(1, int(args.mb * MiB) // 4 // 16)
    gen = torch.Generator(device=device).manual_seed(0)
    live = {f"w{i}": torch.empty(n, device=device).normal_(generator=gen) for i in range(16)}
    size = sw.nbytes(live)
    before = sw.checksum(live)
    parked: dict[str, HostCopy] = {}
    pool, order = HostPool(pin=cuda), stream_order(device)  # the service's host buffers and stream order

    def move(m: Move) -> int:  # what Service._move does for the two tiers used here
        if m.dst == "host":
            parked["x"], _ = sw.device_to_host("b", live, device, pool, order)
        else:
            host = parked.pop("x")
            sw.host_to_device("b", live, host, device, order)
            pool.give(host.buffer)
        return m.nbytes

    mover = BackgroundMoves("bench", move, SwapStats(), threading.Lock(), order)
    trip = [Move("b", "device", "host", size), Move("b", "host", "device", size)]

    def swap() -> None:
        mover.queue(trip).result()

    side = 8192 if cuda else 256
    a = torch.randn(side, side, device=device, dtype=torch.bfloat16 if cuda else torch.float32)

    def products(k: int) -> Callable[[], None]:
        def run() -> None:
            x = a
            for _ in range(k):
                x = (x @ a).clamp_(-1, 1)
            if cuda:
                torch.cuda.current_stream(device).synchronize()

        return run

    t_swap = min(timed(device, swap) for _ in range(args.repeats + 1))
    unit = timed(device, products(4)) / 4
    k = max(4, round(t_swap / max(unit, 1e-6)))  # compute about as long as the swap
    compute = products(k)

    def both() -> None:
        fut = mover.queue(trip)
        compute()
        fut.result()

    plain_src = torch.empty(size // 4, device=device).fill_(1.0)
    s_plain: list[float] = []
    s_swap: list[float] = []
    s_comp: list[float] = []
    s_both: list[float] = []
    plain = plain_src.cpu if cuda else plain_src.clone  # on CPU .cpu() is the tensor itself
    for i in range(args.repeats + 1):  # i == 0: warm-up
        for times, fn in ((s_plain, plain), (s_swap, swap), (s_comp, compute), (s_both, both)):
            t = timed(device, fn)
            if i:
                times.append(t)
    mover.shutdown()
    after = sw.checksum(live)
    hidden = [min(max((c + s - b) / s, 0.0), 1.0) for c, s, b in zip(s_comp, s_swap, s_both, strict=True)]
    plain_gbs = size / min(s_plain) / 1e9
    swap_gbs = 2 * size / min(s_swap) / 1e9
    print(f"state {size / MiB:.0f} MiB on {device}; copy stream {'yes' if cuda else 'no (cpu)'}; "
          f"{args.repeats} repeats (+1 warm-up), best of each")  # fmt: skip
    print(f"plain device-to-host copy (.cpu(), pageable): {plain_gbs:.1f} GB/s")
    print(f"swap round trip on the copy stream (pinned):  {swap_gbs:.1f} GB/s -> {swap_gbs / plain_gbs:.2f}x plain")
    print(f"compute alone {min(s_comp) * 1e3:.1f} ms ({k} {a.dtype} products), swap alone {min(s_swap) * 1e3:.1f} ms, "
          f"both {min(s_both) * 1e3:.1f} ms")  # fmt: skip
    print(f"share of the swap hidden behind compute: {max(hidden):.2f} best, {statistics.median(hidden):.2f} median")
    print(f"state checksum after the swaps: {'unchanged' if after == before else 'CHANGED'}")
    if after != before:
        raise SystemExit("state changed across swaps")


if __name__ == "__main__":
    main()
