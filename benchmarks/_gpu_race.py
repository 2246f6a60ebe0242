"""The race part of the GPU check (`benchmarks/gpu_check.py race`): the rounds that set the service's copy stream
against its compute stream, and the tools they compare with. It imports nothing of the check's script: the
script builds the service and its jobs, and hands in its train step.

Two jobs' engines on one CUDA service. Repeated: a train step of job a and a tail of device work that writes a's
state after the step's last host sync (10 passes of +1/-1 over the 1.6 GB: a node whose kernels outlive its
return), a reference copy of a's state enqueued on the compute stream after them (ordered by the stream
itself), the service's node end, then AT ONCE a background eviction of a and a background swap-in of b on the
copy stream (the allocator may hand b a's freed blocks); then a full synchronize and two comparisons: a's host
copy against the reference (a torn copy: the race's first effect) and b's swapped-in state against its state
when it left the device (an overwritten block: its second). Then the swaps back. The control (`Unordered`) runs
the same rounds with the ordering switched off (the code before the fix: no event wait, no record_stream, no
wait at the node's end): it shows that the comparison can see the race on this machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch


class Unordered:
    """The stream order before the fix (the control): copies on the copy stream, nothing else."""

    def __init__(self, order: Any) -> None:
        self.inner = order

    def node_end(self, job_ids: Any) -> None:
        return None

    def background(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.background()  # type: ignore[no-any-return]

    def before_copy(self, job_id: str) -> None:
        return None

    def allocated(self, t: torch.Tensor) -> None:
        return None

    def copy(self, job_id: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.inner.copy(job_id, dst, src)

    def synchronize(self) -> None:
        self.inner.synchronize()


def flat_copy(live: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    """A copy of `live` in one flat device buffer, in the layout a swap-out would use, enqueued on the
    current stream (so: ordered after every kernel queued before it there)."""
    from plexrl.services.host import Layout

    layout = Layout.of(live)
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8, device=next(iter(live.values())).device)
    views = layout.views(flat)
    for k, t in live.items():
        views[k].copy_(t.detach())
    return layout, flat


def differing(layout: Any, a: torch.Tensor, b: torch.Tensor) -> list[str]:
    va, vb = layout.views(a), layout.views(b)
    return [k for k in va if not torch.equal(va[k], vb[k])]


def tail(live: dict[str, torch.Tensor], passes: int) -> None:
    """Device work that writes the state after the node's last host sync (a node whose kernels outlive it:
    `TorchEngine.train_step` itself ends on a `.item()` that waits for its optimizer step, so the tail is made
    explicit): `passes` times +1 then -1 over every tensor, values kept bounded."""
    tensors = [t.detach() for t in live.values() if t.is_floating_point()]
    for _ in range(passes):
        torch._foreach_add_(tensors, 1.0)
        torch._foreach_add_(tensors, -1.0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def race_rounds(
    svc: Any, rounds: int, b_ref: tuple[Any, torch.Tensor], passes: int, train: Callable[[Any, int], object]
) -> tuple[int, int]:
    """`rounds` of: `train(engine of a, round)` and its tail, a reference copy (stream-ordered after both), the
    node's end, then at once a background eviction of a and swap-in of b; after a full synchronize, a's host copy
    against the reference and b's state against `b_ref` (its state when it left the device). Returns (torn
    copies of a, rounds where b's state changed)."""
    from plexrl.planner.state import Move

    device = svc.device
    ea = svc.engines["a"]
    torn = clobbered = 0
    b_layout, b_flat = b_ref
    for r in range(rounds):
        train(ea, r)
        tail(ea.state_tensors(), passes)  # still running on CUDA when the node "returns"
        layout, ref = flat_copy(ea.state_tensors())  # compute stream: after the step and the tail
        svc.node_end(["a"], None)  # what run_node does when the node returns
        svc.background.queue([Move("a", "device", "host", 0), Move("b", "host", "device", 0)]).result()
        synchronize(device)
        host = svc.states["a"].host
        assert host is not None and host.layout == layout
        torn += bool(differing(layout, host.buffer.to(device), ref))
        live_b = svc.engines["b"].state_tensors()
        clobbered += bool(differing(b_layout, flat_copy(live_b)[1], b_flat))
        svc.background.queue([Move("b", "device", "host", 0), Move("a", "host", "device", 0)]).result()
        synchronize(device)
    return torn, clobbered
