"""The `Executor` interface: the only way the `Runner` touches the world.

An executor starts (or connects to) services and a CPU pool, receives each job's spec once, loads a job's
state on a service, runs nodes, hands back what finished, and says when a service is lost. It makes NO
scheduling decision: which node runs where and when, which state moves where, which cpu node is small
enough to run inline, all come from the planner through the runner. Three implementations:

- `InlineExecutor` (`runtime/inline.py`): in-process and synchronous; `plexrl run JOB.yaml` and the tests.
- `DaskExecutor` (`runtime/dask.py`): services resident in Dask worker processes, a CPU pool of workers.
- `SimExecutor` (`runtime/sim.py`): a virtual clock and cost models; no torch, no Dask.

Data stays where it is made: a node's output never comes back through `wait`. Each submitted node gets a
`Handle`; a later node names its inputs by the handles of the nodes that produced them, and the executor
resolves them where the data lives (in-process: the object; Dask: a future passed worker to worker).
Only `NodeReport`s (timings, swap figures, the output's small metrics dict) reach the runner. State moves
travel with the node they precede (`NodeTask.swaps`, `NodeTask.prefetch`), so they cost no round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from plexrl.planner.state import Move, Tier
from plexrl.reports import CheckpointReport, Handle, LoadReport, NodeReport


@dataclass(frozen=True, slots=True)
class NodeTask:
    """One node to run. `service_id` None: on the CPU pool. `inputs`: input port -> handle of the node whose
    output feeds it. `swaps` run in order before the node; `prefetch` starts in the background once the node
    starts. `inline`: the planner predicts a cpu node tiny; an executor may run it next to its inputs."""

    job_id: str
    iteration: int
    node: str
    service_id: str | None
    inputs: Mapping[str, Handle] = field(default_factory=dict)
    swaps: tuple[Move, ...] = ()
    prefetch: tuple[Move, ...] = ()
    inline: bool = False
    # chunk `chunk` of `chunks` of a chunked service node (function-level preemption, `JobConfig.chunks`): the
    # service runs the chunk on its rows of the node's chunk input (`Service.run_node`). `parts`: with the LAST
    # chunk only, the handles of the earlier chunks' outputs, in order; the executor resolves them where they
    # were made (the same service) and the last chunk's output is their concatenation, the node's output
    chunk: int = 0
    chunks: int = 1
    parts: tuple[Handle, ...] = ()
    # a session's call (`plexrl.sessions.calls`, from the runner's `CallBoard`): the node runs it (`Service.run_node`)
    call: Any = None

    @property
    def lane(self) -> str:
        return self.service_id or "cpu"


@dataclass(slots=True)
class Finished:
    """A handle whose work ended, with its small report (`NodeReport`, `LoadReport` or `CheckpointReport`)."""

    handle: Handle
    report: NodeReport | LoadReport | CheckpointReport


class Executor(Protocol):
    """See the module docstring. Times in reports are on `clock`."""

    clock: Callable[[], float]

    def start(self) -> list[str]:
        """Bring up the services and the CPU pool; return the service ids, in a stable order."""
        ...

    def ship(self, spec: Any) -> None:
        """Make a job's frozen spec available where its nodes will run (once per job)."""
        ...

    def unship(self, job_id: str) -> None:
        """Drop a job's spec (the job ended and will send no more work; a long-running server's memory)."""
        ...

    def load(self, job_id: str, service_id: str, tier: Tier) -> Handle:
        """Create the job's engine on `service_id` and put its state in `tier` (strict affinity: it stays)."""
        ...

    def submit(self, task: NodeTask) -> Handle:
        """Start a node (after its swaps); its `Finished` comes back from `wait`."""
        ...

    def wait(self, timeout: float) -> list[Finished]:
        """What finished since the last call, in submission order; [] when nothing did within `timeout`."""
        ...

    def lost(self) -> list[tuple[str, str]]:
        """Services lost since the last call: (service id, reason). Their work in flight is gone."""
        ...

    def joined(self) -> list[str]:
        """Services started since the last call, beyond those `start` returned (a restarted or added worker)."""
        ...

    def save(self, job_id: str, service_id: str, path: Path) -> Path:
        """Save the job's current policy (HF format) to `path`; returns where it went."""
        ...

    def checkpoint(self, job_id: str, service_id: str, path: Path, extra: dict[str, Any]) -> Handle:
        """Save the job's state (weights, optimizer, reference, weight version) and `extra` to `path`, atomically;
        its `CheckpointReport` comes back from `wait`. It runs on the service after the work already sent there
        and before any node submitted after this call (so it holds the state as of the job's last finished
        node), from whichever tier holds the state, without moving it."""
        ...

    def release(self, job_id: str, service_id: str) -> None:
        """Forget the job on its service: engine, host copies, spill files."""
        ...

    def forget(self, handles: Iterable[Handle]) -> None:
        """Drop the outputs of these nodes (their iteration is over)."""
        ...

    def close(self) -> dict[str, dict[str, Any]]:
        """Stop what `start` started; return each service's report (swap statistics)."""
        ...


__all__ = ["CheckpointReport", "Executor", "Finished", "Handle", "LoadReport", "NodeReport", "NodeTask"]
