"""Decode-step preemption on a service: a generation that runs as SLICES of at most K decode steps each, paused
between two slices with its state kept on the service (`slices: {rollout: K}` in a job config).

The service gives a sliced node a `SliceSlot` (`OpContext.slice`) that lives as long as the node: the first
slice begins the generation on the job's engine (`begin_generation`) and runs K steps (`resume`); if the
generation is not finished, `generate_slice` raises `SlicePaused` and the service keeps the slot, reports the
node `paused` and the planner queues its next slice, which finds the slot and resumes the same generation. The
slice that finishes it returns its output. Between two slices the service may run any other job's node.

Engines that pause: the torch engine (`plexrl/engines/decoding.py`: the rows' KV cache stays on the device,
finished rows leave the batch; tokens and log-probs equal an unpaused run's), the LoRA engines built on it
(their adapter is made active again before each slice), and vLLM (`plexrl/engines/partial.py`: partial
rollouts, unfinished rows resubmitted with their generated prefix). Each slice records the job's weight
version; token t of every row was sampled in slice t // K (every slice adds exactly K tokens to each row
still running), so `token_versions` gives each token's version.

What it does NOT do: move a paused generation between tiers (the planner keeps its job resident instead,
`plexrl/planner/slices.py`), or slice anything but a generation.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

    from plexrl.engines.base import GenerationOutput


class SlicePaused(Exception):  # (a signal, not an error: the service reports the node paused)
    """The slice ran its decode steps and the generation is not finished: the node pauses here (raised out of
    the operator; `Service.run_node` keeps the slot and reports the node `paused`)."""


@dataclass(slots=True)
class SliceSlot:
    """Where a sliced node's generation waits between two slices: `steps` decode steps per slice, the paused
    generation (None before the first slice), the arguments it began with (later slices must pass the same),
    and the weight version of each slice run so far. Kept by the service, per job."""

    steps: int
    key: Hashable = None  # what node the slot belongs to (the service's: job, iteration, node, chunk)
    generation: Any = None
    args: Any = None
    versions: list[int] = field(default_factory=list)

    @property
    def slices(self) -> int:
        """Slices run so far."""
        return len(self.versions)


def pausable(engine: Any) -> bool:
    """Whether `engine` can pause a generation between decode steps (`begin_generation` and `resume` of its own
    class: a delegating `__getattr__` does not count)."""
    kind = type(engine)
    return callable(getattr(kind, "begin_generation", None)) and callable(getattr(kind, "resume", None))


def generate_slice(engine: Any, slot: SliceSlot, prompts: list[list[int]], **kwargs: Any) -> GenerationOutput:
    """Run the next slice of the generation `engine.generate(prompts, **kwargs)` would run: at most
    `slot.steps` decode steps. Returns the output once the generation is finished; raises `SlicePaused` after
    a slice that did not finish it (the slot keeps it). `kwargs` as `Engine.generate`."""
    if not pausable(engine):
        raise TypeError(
            f"the {type(engine).__name__} of this job cannot pause a generation between decode steps; remove "
            "the node from the job's `slices` (or use `chunks`)"
        )
    args = (prompts, sorted(kwargs.items()))
    if slot.generation is None:
        slot.args = args
    elif slot.args != args:
        raise ValueError("a later slice of a sliced generation was called with other arguments than its first")
    activate = getattr(getattr(engine, "shared", None), "activate", None)
    if activate is not None and hasattr(engine, "adapter"):
        activate(engine.adapter)  # a LoRA job: another job's adapter may have run since the last slice
    if slot.generation is None:
        slot.generation = engine.begin_generation(prompts, **kwargs)
    slot.versions.append(int(engine.weight_version))
    engine.resume(slot.generation, slot.steps)
    if not slot.generation.finished:
        raise SlicePaused(f"paused after {slot.slices} slice(s) of {slot.steps} decode steps")
    return slot.generation.output()


def token_versions(slot: SliceSlot, response_mask: Tensor) -> Tensor:
    """[N, T] long: the weight version each response token was sampled at (token t: slice t // steps), -1 on
    padding (`response_mask` [N, T] 0)."""
    import torch

    T = response_mask.shape[1]
    per_slice = torch.tensor(slot.versions, dtype=torch.long)
    cols = per_slice[torch.clamp(torch.arange(T) // slot.steps, max=len(slot.versions) - 1)]
    out = cols.expand(response_mask.shape[0], T).clone()
    out[response_mask.cpu() == 0] = -1
    return out


__all__ = ["SlicePaused", "SliceSlot", "generate_slice", "pausable", "token_versions"]
