"""Planner inputs (events) and outputs (instructions): slotted, immutable records.

The planner never performs I/O; a driver turns instructions into work and reports back with events.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from plexrl.planner.state import Move, Tier

RunsOn = Literal["service", "cpu"]  # where a node runs (a job's place is `PlaceJob`)


@dataclass(frozen=True, slots=True)
class NodePlan:
    """What the planner needs to know of one pipeline node."""

    runs_on: RunsOn
    deps: tuple[str, ...] = ()
    every: int | None = None
    # a cpu node that may run next to its inputs, outside the CPU pool, when it is predicted to be tiny
    # (the planner decides, see `Planner(inline_below=...)`); False for tool calls and untrusted code
    inline: bool = True
    # a service node run as this many resumable chunks: after each, the service may run another job's node
    # (function-level preemption); the cost model then learns the time of one chunk
    chunks: int = 1
    # a rollout that runs whole (neither chunked nor sliced) and whose operator has a batched form: with
    # `Planner(batch_rollouts=True)` it may share one engine call with other jobs' (`batches.py`)
    batchable: bool = False
    # a session's call that changes the trained weights (an open plan's `checkpoint_every` counts these)
    commits: bool = False

    def active(self, iteration: int, iterations: int) -> bool:
        return self.every is None or (iteration + 1) % self.every == 0 or iteration == iterations - 1


@dataclass(frozen=True, slots=True)
class RetryPlan:
    """How often a job's failing cpu node runs (`attempts`, the first run included) and how long the planner
    waits after its k-th failed run before the next one (`delays[k - 1]`). Service nodes are not retried."""

    attempts: int = 1
    delays: tuple[float, ...] = ()

    def delay(self, failures: int) -> float:
        """Seconds after the `failures`-th failed run (1-based); the last delay repeats past the tuple's end."""
        if not self.delays:
            return 0.0
        return self.delays[min(failures, len(self.delays)) - 1]


@dataclass(frozen=True, slots=True)
class JobPlan:
    """A job as the planner sees it: nodes of one iteration (in a deterministic topological order), and
    `baseline` nodes that also run once, alone, before the first iteration (as iteration -1). Iterations carry
    their real numbers: the job's are `0 .. iterations - 1`, and this run does `first_iteration .. iterations
    - 1` (a job resumed from the checkpoint after iteration k starts at k + 1, with no baseline pass)."""

    nodes: dict[str, NodePlan]
    iterations: int
    order: tuple[str, ...] = ()
    baseline: tuple[str, ...] = ()
    state_bytes: int = 0  # policy + optimizer (+ reference) bytes: what the StateManager moves
    # (key, device bytes) of a generation engine the job shares with same-key jobs on its service (vLLM)
    engine: tuple[str, int] | None = None
    user: str = ""  # who the job belongs to (fair-share ordering, `policies.FairShare`)
    # node -> predicted seconds learned by an earlier attempt (a job resumed from a checkpoint): the cost
    # model starts from them instead of the priors
    costs: tuple[tuple[str, float], ...] = ()
    retry: RetryPlan | None = None  # failing cpu nodes run again after a backoff (None: a failure ends the job)
    first_iteration: int = 0  # the first iteration this run does (0, or the one after a checkpoint)
    # the most jobs whose batchable nodes its engine runs in one call (a LoRA job on vLLM: the adapters one
    # engine step mixes); 0 or 1: its nodes always run alone (`batches.py`)
    batch: int = 0
    # checkpoint the job on its service after every k-th iteration but its last (0: never; `checkpoints.py`)
    checkpoint_every: int = 0
    # placements: this is its `attempt`-th (1: the first); a job whose service is lost is placed again (resumed
    # from its latest checkpoint) while attempt < `attempts` (`FailJob.again`: the planner's decision)
    attempt: int = 1
    attempts: int = 1
    # a session (`sessions.py`): its nodes are the call kinds its client may send, every one a service node
    # without edges; an iteration runs the one call that came (`CallArrived`), `iterations` bounds the numbering
    open: bool = False

    @classmethod
    def of(
        cls, nodes: Mapping[str, NodePlan], iterations: int, *, order: tuple[str, ...] = (),
        baseline: tuple[str, ...] = (), first_iteration: int = 0, state_bytes: int = 0,
        engine: tuple[str, int] | None = None, user: str = "", costs: Mapping[str, float] | None = None,
        retry: RetryPlan | None = None, batch: int = 0, checkpoint_every: int = 0, attempt: int = 1,
        attempts: int = 1,
    ) -> JobPlan:  # fmt: skip
        """THE construction of a job's plan, for every kind of spec (a prepared job's `JobSpec.plan`, a simulated
        one's `SimJob.plan`): a job resumed at `first_iteration` > 0 has no baseline pass (its periodic nodes stay
        in phase), and `costs` (node -> seconds an earlier attempt learned) are kept in node order."""
        return cls(
            dict(nodes), iterations, tuple(order), () if first_iteration else tuple(baseline), state_bytes, engine,
            user, tuple(sorted((costs or {}).items())), retry, first_iteration, batch, checkpoint_every, attempt,
            attempts,
        )  # fmt: skip


# -- events -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ServiceJoined:
    """A service is up. Budgets in bytes per tier (None = unlimited); `copy_engine`: its state moves run beside
    its compute (a GPU's copy stream), so a prefetch costs it no service time (`StateManager.prefetch`)."""

    service_id: str
    device_bytes: int | None = None
    host_bytes: int | None = None
    disk_bytes: int | None = None
    copy_engine: bool = False


@dataclass(frozen=True, slots=True)
class ServiceLost:
    service_id: str
    reason: str = "worker lost"


@dataclass(frozen=True, slots=True)
class JobSubmitted:
    job_id: str
    plan: JobPlan


@dataclass(frozen=True, slots=True)
class NodeFinished:
    job_id: str
    iteration: int
    node: str
    ok: bool = True
    error: str | None = None
    duration: float = 0.0  # the node's own run time (swaps excluded): what the cost model learns
    swap_bytes: int = 0  # state bytes moved before the node ran (blocking part)
    swap_seconds: float = 0.0
    # a slice of a sliced service node ended before the node did (decode-step preemption): its generation
    # waits, paused, on the service, and the planner queues the node's next slice there
    paused: bool = False


@dataclass(frozen=True, slots=True)
class StateMeasured:
    """A service measured a job's state while moving it off device (its real size, which replaces the
    estimate the job was admitted with: optimizer moments appear after the first step, tied weights count
    once)."""

    service_id: str
    job_id: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class JobCancelled:
    job_id: str
    reason: str = "cancelled by user"


@dataclass(frozen=True, slots=True)
class JobFailed:
    """The driver could not carry out work of this job outside a node (loading it, reading its metrics)."""

    job_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class CheckpointFinished:
    """The checkpoint after `iteration` (`RunCheckpoint`) ended on the job's service; `ok=False`: it failed
    (the job goes on; the driver logged why). `duration`: the service seconds it took."""

    job_id: str
    iteration: int
    ok: bool = True
    error: str | None = None
    duration: float = 0.0


@dataclass(frozen=True, slots=True)
class CallArrived:
    """A session's next call is waiting: `node`, its kind (a node of the job's open plan). One at a time: the next
    comes only after the previous call's node finished (`sessions.py`). `at`: when it came, on the planner's
    clock, where that is earlier than the planner hears of it (a runner busy running a node in-process); the
    client's time is learnt up to then."""

    job_id: str
    node: str
    at: float | None = None


@dataclass(frozen=True, slots=True)
class SessionClosing:
    """A session gets no more calls: it ends (done) once no call runs (an announced one runs first)."""

    job_id: str


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: the driver sends it once the clock reaches `Planner.wake_at` (a node's backoff ended)."""


Event = (
    ServiceJoined
    | ServiceLost
    | JobSubmitted
    | NodeFinished
    | StateMeasured
    | JobCancelled
    | JobFailed
    | CheckpointFinished
    | CallArrived
    | SessionClosing
    | Tick
)


# -- instructions -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PlaceJob:
    """Load the job on the service and materialise its state in `tier`."""

    job_id: str
    service_id: str
    tier: Tier = "device"


@dataclass(frozen=True, slots=True)
class RunNode:
    job_id: str
    iteration: int
    node: str
    runs_on: RunsOn
    service_id: str | None = None
    swaps: tuple[Move, ...] = ()  # carry out in order before the node (they make the job resident)
    prefetch: tuple[Move, ...] = ()  # start in the background while the node runs (the next job's state)
    inline: bool = False  # cpu node predicted tiny: an executor may run it next to its inputs, off the pool
    chunk: int = 0  # which chunk of a chunked service node this is (of `chunks`)
    chunks: int = 1
    slice: int = 0  # which slice of a sliced service node this is (> 0: it resumes the paused generation)
    attempt: int = 1  # which run of the node this is (> 1: after failed runs and their backoff, `RetryPlan`)
    # co-scheduled rollouts (`batches.py`): the other members (job, iteration, node) run in the same engine
    # call as this node; `swaps` make every member resident
    cohort: tuple[tuple[str, int, str], ...] = ()


@dataclass(frozen=True, slots=True)
class RetryNode:
    """A cpu node failed with runs left (`JobPlan.retry`): it waits `delay` seconds in `backoff`, then the
    planner sends it again (`RunNode(attempt=attempt + 1)`) at the first event at or after that time."""

    job_id: str
    iteration: int
    node: str
    attempt: int  # the run that failed
    attempts: int
    delay: float
    error: str


@dataclass(frozen=True, slots=True)
class IterationDone:
    job_id: str
    iteration: int


@dataclass(frozen=True, slots=True)
class RunCheckpoint:
    """Save the job's state after `iteration` on its service, from whichever tier holds it, without moving it
    (`JobPlan.checkpoint_every`). The service runs nothing else until `CheckpointFinished` comes back, and the
    job's next iteration waits for it."""

    job_id: str
    iteration: int
    service_id: str


@dataclass(frozen=True, slots=True)
class JobDone:
    job_id: str
    service_id: str | None = None


@dataclass(frozen=True, slots=True)
class FailJob:
    job_id: str
    reason: str
    service_id: str | None = None
    cancelled: bool = False  # ended by the user (JobCancelled), not by an error
    service_lost: bool = False  # failed because its service was lost (its state there is gone)
    # the planner's decision for a job of a lost service: it is placed again (`JobPlan.attempt` < `attempts`),
    # resumed from its latest checkpoint by whoever submitted it (a server), as attempt + 1
    again: bool = False


@dataclass(frozen=True, slots=True)
class JobHeld:
    """A queued job's admission changed (`admission.py`): why it waits for its user's limit or quota, or ""
    once it no longer does (it is weighed for a service like any queued job)."""

    job_id: str
    reason: str


Instruction = PlaceJob | RunNode | RetryNode | IterationDone | RunCheckpoint | JobDone | FailJob | JobHeld


@dataclass(slots=True)
class Transition:
    """One entry of the planner's bounded log."""

    time: float
    event: Event
    instructions: list[Instruction] = field(default_factory=list)
