"""The base moves an OpenRL-style time-sliced LoRA job makes, counted into the time-slicing arm (a helper, not a
benchmark: no `main`).

On PlexRL's executor a LoRA job's base is the service's (`plexrl/engines/lora.py`: loaded once, shared by every
LoRA job of that model, never moved), so the `time-slicing` arm as run moves only adapters and their AdamW
moments at a hand-over. An OpenRL job is a process of its own with its own copy of the base: at each hand-over
the holder's whole GPU state, base included, goes to host and the next holder's comes in. That arm as run
therefore flatters time-slicing; `with_base_moves` adds what the peer pays on top:

- per hand-over, the outgoing job's base out (when it is a LoRA job) and the incoming job's base in (when it
  is one), at the seconds `measure` takes on this machine through the service's own swap path
  (`plexrl.services.swap.device_to_host` / `host_to_device`, one flat buffer, a reused host buffer and device
  cache: a steady move, the peer at its best on our path), median of `reps`;
- time-slicing holds the service through a hand-over and hides no move, so each such second lands on the
  service's critical path: the makespan grows by their sum, each job's completion by those of the hand-overs
  before its last span, each hand-over's switch and gap by its own.

The bound next to it: the same bytes at a plain copy's bandwidth between touched buffers
(`multiplex_real.copy_bandwidth`), per way.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class BaseMove:
    """One base's move seconds each way (measured on the swap path) and the copy bound per way."""

    nbytes: int
    out_s: float
    in_s: float
    bound_s: float


def lora_bases(cluster: Any) -> dict[str, int]:
    """job id -> the bytes of its base, for each LoRA job of `cluster` (`plexrl.sizes.model_bytes`)."""
    from plexrl.job.spec import prepare_job
    from plexrl.sizes import model_bytes

    out = {}
    for job in cluster.jobs:
        if job.config.model.lora is not None:
            spec = prepare_job(job)
            out[spec.job_id] = model_bytes(spec.model_path, job.config.model.dtype)
    return out


def measure(nbytes: int, reps: int = 3) -> BaseMove:
    """Move a flat `nbytes` state out and in through the service's swap functions (after one untimed round
    that makes and touches the buffers), `reps` times; the median of each way, and the copy bound."""
    import torch
    from multiplex_real import copy_bandwidth

    from plexrl.services.host import DeviceCache, HostPool
    from plexrl.services.streams import stream_order
    from plexrl.services.swap import device_to_host, host_to_device

    device = torch.device("cpu")
    live = {"base": torch.ones(max(nbytes // 4, 1), dtype=torch.float32)}
    pool, cache, order = HostPool(pin=False), DeviceCache(), stream_order(device)
    outs, ins = [], []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        host, _ = device_to_host("base", live, device, pool, order, cache)
        t1 = time.perf_counter()
        host_to_device("base", live, host, device, order, cache)
        t2 = time.perf_counter()
        pool.give(host.buffer)
        if i:
            outs.append(t1 - t0)
            ins.append(t2 - t1)
    return BaseMove(nbytes, statistics.median(outs), statistics.median(ins), nbytes / copy_bandwidth(nbytes))


def extra_seconds(
    switch: tuple[str, str, float], bases: Mapping[str, int], moves: Mapping[int, BaseMove], bound: bool
) -> float:
    """What hand-over `switch` (from, to, when) adds: the outgoing base out and the incoming base in."""
    src, dst, _ = switch
    out = 0.0
    if src in bases:
        m = moves[bases[src]]
        out += m.bound_s if bound else m.out_s
    if dst in bases:
        m = moves[bases[dst]]
        out += m.bound_s if bound else m.in_s
    return out


def with_base_moves(mux: Any, bases: Mapping[str, int], moves: Mapping[int, BaseMove], bound: bool = False) -> Any:
    """A copy of the time-slicing run `mux` (`multiplex.Mux`) with every hand-over's base moves added (see the
    module docstring); `bound`: at the copy bound instead of the measured seconds."""
    extra = [extra_seconds(s, bases, moves, bound) for s in mux.switches]
    total = sum(extra)
    nbytes = sum(bases[j] for s in mux.switches for j in s[:2] if j in bases)
    makespan = mux.makespan + total
    grow = makespan / mux.makespan if mux.makespan > 0 else float("nan")
    completion = {
        j: c + sum(e for s, e in zip(mux.switches, extra, strict=True) if s[2] <= mux.ends.get(j, float("inf")))
        for j, c in mux.completion.items()
    }
    blocking, background, hidden, moved = mux.swap
    before, swap_total = blocking + background, blocking + background + total
    return dataclasses.replace(
        mux,
        completion=completion,
        cps=mux.cps * grow,
        hand_overs=[(a + e, b + e) for (a, b), e in zip(mux.hand_overs, extra, strict=True)],
        duty=mux.duty / grow,
        swap=(blocking + total, background, hidden * before / swap_total if swap_total else hidden, moved + nbytes),
        makespan=makespan,
    )


def base_line(mux: Any, bases: Mapping[str, int], moves: Mapping[int, BaseMove]) -> str:
    """The modeled base moves of one time-slicing run, in words, next to their copy bound."""
    n_out = sum(1 for s in mux.switches if s[0] in bases)
    n_in = sum(1 for s in mux.switches if s[1] in bases)
    nbytes = sum(bases[j] for s in mux.switches for j in s[:2] if j in bases)
    measured = sum(extra_seconds(s, bases, moves, False) for s in mux.switches)
    bound = sum(extra_seconds(s, bases, moves, True) for s in mux.switches)
    per = ", ".join(f"{m.nbytes / 2**20:.0f} MiB: out {m.out_s:.3f} s, in {m.in_s:.3f} s, bound {m.bound_s:.3f} s"
                    for m in moves.values())  # fmt: skip
    ratio = measured / bound if bound else float("nan")
    return (f"base moves an OpenRL job would add (modeled, not run): {n_out} out + {n_in} in over "
            f"{len(mux.switches)} hand-overs, {nbytes / 2**30:.2f} GiB, {measured:.2f} s measured on the swap path "
            f"= {ratio:.2f}x its copy bound {bound:.2f} s (per move: {per})")  # fmt: skip


def base_moves(cluster: Any) -> tuple[dict[str, int], dict[int, BaseMove]]:
    """The LoRA jobs' base bytes and one measured `BaseMove` per distinct base size ({} when none)."""
    bases = lora_bases(cluster)
    return bases, {n: measure(n) for n in sorted(set(bases.values()))}


__all__ = ["BaseMove", "base_line", "base_moves", "extra_seconds", "lora_bases", "measure", "with_base_moves"]
