"""The real-size mix: SmolLM2-135M jobs of two users, full fine-tunes (~2.2 GB states: fp32
weights, two AdamW moments, the KL term's reference weights) and a LoRA job, on ONE service whose device budget
holds two full states (`configs/multiplex_smollm2.yaml`), so that whole 2.2 GB states swap; side by side in one
run: each job alone (the dedicated baseline), exclusive time-slicing (the llm-d / OpenRL design on our
executor) and PlexRL (the config's ordering, fair share between the users).

Printed, besides benchmarks/multiplex.py's llm-d / OpenRL figures for both arms (cost against dedicated and
one-after-another, slowdowns, switch and queue wait, duty cycle, learning curves identical to each job alone):
per arm, the state bytes moved and the swap seconds (blocking + in the background) next to the memory-copy
bound measured here first (a plain copy of the largest state's bytes between touched buffers on the torch threads
the service may use, best of 3: bytes moved / that bandwidth),
and the share of swap time hidden from the nodes; then the arm's move records, with the moves into kept buffers
against that bound and the moves that made a buffer against a copy into a fresh buffer measured here (the
first touch of memory: on this VM a host page fault per page). Goals: swap time <= 1.5x its bound, >= 90%
hidden; PlexRL's cost <= 0.8x time-slicing's with no job slower than under it.

    .venv/bin/python benchmarks/real_model.py --write-data runs/data/addition   # once
    .venv/bin/python benchmarks/multiplex_real.py [--iterations 3] [--driver dask]
    .venv/bin/python benchmarks/multiplex_real.py --smoke      # tiny jobs, local driver (the tests run it)

About 20 minutes on 2 cores, ~15 GB of memory at its peak: run it alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' helpers, run from anywhere

from multiplex import SLICING, Mux, against_slicing, run_alone, run_mux, with_iterations

from plexrl.cluster import load_cluster
from plexrl.services.records import format_summary

ROOT = Path(__file__).resolve().parents[1]


def copy_bandwidth(nbytes: int, reps: int = 3) -> float:
    """Bytes per second of a plain copy of `nbytes` between two buffers on this machine (best of `reps`, after a
    warm-up that touches both): the memory-copy bound of a state move of that size."""
    import torch

    n = max(nbytes // 4, 1)
    src, dst = torch.ones(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 4 * n / best


def first_touch_bandwidth(nbytes: int) -> float:
    """Bytes per second of one copy of `nbytes` into a fresh buffer (`plexrl.services.host.fresh`, as a service
    makes one), measured before anything else here touches that much memory: the bound of a move that makes a
    buffer. On this VM memory not touched before costs a host page fault per page (`benchmarks/fresh_memory.py`)."""
    import torch

    from plexrl.services.host import fresh

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = fresh(nbytes)
    t0 = time.perf_counter()
    dst.copy_(src)
    return nbytes / (time.perf_counter() - t0)


def copy_beside_compute(nbytes: int, threads: int, reps: int = 3) -> float:
    """Bytes per second of the same plain copy while another thread streams through memory on `threads` torch
    threads (an in-place add over 256 MiB, as an optimizer step or a backward pass streams the weights), as a
    node does while a move runs in the background beside it: on a CPU the two share the cores and the memory bus,
    so this, not `copy_bandwidth`, is the rate a background move can reach on this machine (beside matrix
    products alone, which stay in cache, a copy keeps its plain rate). On a GPU a copy engine moves the bytes
    beside the SMs and the plain bound holds for both kinds of move."""
    import threading

    import torch

    a, b = torch.ones(32 << 20), torch.ones(32 << 20)
    stop, started = threading.Event(), threading.Event()

    def compute() -> None:
        torch.set_num_threads(threads)
        while not stop.is_set():
            a.add_(b)
            started.set()

    worker = threading.Thread(target=compute, daemon=True)
    worker.start()
    try:
        if not started.wait(60):
            raise RuntimeError("the compute thread did not start within 60 s")
        return copy_bandwidth(nbytes, reps)
    finally:
        stop.set()
        worker.join(60)


def swap_line(label: str, mux: Mux, bandwidth: float, beside: float) -> str:
    """One arm's moves against the plain-copy bound, and its background seconds against the bound of a copy
    beside compute (`copy_beside_compute`)."""
    blocking, background, hidden, moved = mux.swap
    bound = moved / bandwidth if moved else float("nan")
    total = blocking + background
    moved_bg = mux.moves.get("background_bytes", 0)
    bg = ""
    if moved_bg:
        rate = moved_bg / max(mux.moves.get("background_copy_s", 0.0), 1e-9)  # (the records' copy seconds)
        bg = (f"; {moved_bg / 2**30:.2f} GiB in the background, copied at {rate / 1e9:.2f} GB/s against "
              f"{beside / 1e9:.2f} GB/s for a copy beside compute")  # fmt: skip
    return (f"  {label}: {moved / 2**30:.2f} GiB moved; swap {total:.2f}s (blocking {blocking:.2f}s, in the "
            f"background {background:.2f}s) = {total / bound:.2f}x its memory-copy bound {bound:.2f}s (goal <= 1.5x); "
            f"hidden {hidden:.0%} (goal >= 90%){bg}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "multiplex_smollm2.yaml"))
    ap.add_argument("--iterations", type=int, default=3, help="iterations per job (default 3)")
    ap.add_argument("--driver", choices=["dask", "local"], help="the multiplexed arms' driver (default: config's)")
    ap.add_argument("--smoke", action="store_true", help="two tiny jobs, 2 iterations, local driver (tests)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    tmp = tempfile.TemporaryDirectory(prefix="plexrl-multiplex-real-") if args.smoke else None
    if tmp is not None:
        from _tiny import tiny_cluster_file

        args.config = str(tiny_cluster_file(tmp.name, driver="local"))
        args.iterations, args.driver = 2, "local"
    else:
        data = ROOT / "runs" / "data" / "addition"
        if not (data / "train.parquet").is_file():
            from real_model import write_data

            write_data(data)
    cluster = with_iterations(load_cluster(args.config), args.iterations)
    if args.driver is not None:
        cluster = dataclasses.replace(cluster, config=cluster.config.model_copy(update={"driver": args.driver}))
    from plexrl.job.spec import prepare_job
    from plexrl.runtime.jobs import configure_torch

    specs = [prepare_job(job) for job in cluster.jobs]
    largest = max(s.state_bytes() for s in specs)
    first_touch = first_touch_bandwidth(largest)  # first: before the copies below touch this much memory
    machine = copy_bandwidth(largest)  # every core (torch's default threads)
    threads = cluster.config.services.threads or 1
    configure_torch(threads)  # the bound: a copy with the threads the service may use, as its moves copy
    bandwidth = copy_bandwidth(largest)
    print(
        f"memory copy: {bandwidth / 1e9:.2f} GB/s on the service's {threads} torch thread(s), the bound "
        f"({machine / 1e9:.2f} GB/s on every core; {largest / 2**30:.2f} GiB, the largest state, best of 3)"
    )
    print(f"the same copy into a fresh buffer (first touch): {first_touch / 1e9:.2f} GB/s, the bound of a move that "
          "makes a buffer")  # fmt: skip
    beside = copy_beside_compute(largest, threads)
    print(f"the same copy beside compute ({threads} torch threads streaming through memory): "
          f"{beside / 1e9:.2f} GB/s, the bound of a background move on these cores")  # fmt: skip
    lean = run_alone(cluster, "local", "alone")
    arms = {o: [run_mux(cluster, o)] for o in (SLICING, cluster.config.ordering)}
    print("\nstate moves against the memory-copy bound")
    for arm, runs in arms.items():
        print(swap_line(arm, runs[0], bandwidth, beside))
        if runs[0].moves:  # where the moves' seconds went, against the same bound
            print(f"    records: {format_summary(runs[0].moves, bandwidth / 1e9, first_touch / 1e9)}")
    against_slicing([lean], arms)
    if tmp is not None:
        tmp.cleanup()
    bad = [s for runs in arms.values() for s in runs[0].statuses] + [a.status for a in lean.values()]
    if any(s != "done" for s in bad):
        raise SystemExit("a job did not finish; the figures above are not comparable")


if __name__ == "__main__":
    main()
