"""Sessions as planner work: a job whose plan is OPEN (`JobPlan.open`; docs/architecture.md, "Names"). Its nodes are the
kinds of call its client may send (every one a service node, no edges); its iterations are its calls, numbered
in the order they run: an iteration holds only the node of the call that came (`CallArrived`), and between two
calls the job is idle (no node at all, no `IterationDone`). The runtime announces one call at a time, the next
only after the previous call's node finished, so the calls of a session run in the order sent.

While idle the job counts as away on its CPU, the client (`CLIENT` in `JobRecord.cpu_started`): eviction,
prefetch and the ordering's due times see its predicted return (the cost model learns the client's time between
a call's end and the next call's arrival), and that time adds to the work it did at its own pace
(`work_done`: slowdowns compare like a DAG job's). Its predicted busy fraction is a call's time over a call's
plus the client's (`CALL`: every call kind together).

`SessionClosing` ends it (done) once no call runs: at once when idle (a call announced before is run first).
An open plan's `checkpoint_every = k` counts the calls that change the trained weights (`NodePlan.commits`): a
checkpoint after every k-th. Pure."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from plexrl.planner.costs import CostModel
from plexrl.planner.events import CallArrived, Instruction, SessionClosing
from plexrl.planner.records import CLIENT, TERMINAL, InvalidTransition, JobRecord

if TYPE_CHECKING:
    from plexrl.planner.core import Planner

CALL = "<call>"  # pseudo node: a call's time, every kind together


def handlers(p: Planner) -> dict[type, Callable[[Any, list[Instruction]], None]]:
    """The planner's handlers of the session events (`Planner.handle`)."""
    return {
        CallArrived: lambda ev, out: on_call_arrived(p, ev, out),
        SessionClosing: lambda ev, out: on_closing(p, ev, out),
    }


def on_call_arrived(p: Planner, ev: CallArrived, out: list[Instruction]) -> None:
    """A session's next call came: it starts at once when the session is idle (placed, no checkpoint held)."""
    job = p.jobs.get(ev.job_id)
    if job is None or job.status in TERMINAL:
        return  # a late call of a session that already ended (the runtime fails it)
    problem = call_arrived(job, ev.node, p.costs, p.clock())
    if problem is not None:
        raise InvalidTransition(p._history(problem))
    if job.status == "running" and job.checkpoint is None:  # (queued, or held: it starts when that ends)
        job.start_iteration(p.clock())
        p._advance(job, out)


def on_closing(p: Planner, ev: SessionClosing, out: list[Instruction]) -> None:
    """A session's client is gone: it ends now if idle, else after its running (or announced) call."""
    job = p.jobs.get(ev.job_id)
    if job is None or job.status in TERMINAL:
        return
    if not job.plan.open:
        raise InvalidTransition(p._history(f"{ev.job_id} is not a session; it cannot close"))
    job.closing = True
    if job.status == "queued":
        p._end_job(job.job_id, "cancelled", "the session closed before it was placed", out)
    elif idle(job):
        p._end_job(job.job_id, "done", "", out)


def call_arrived(job: JobRecord, node: str, costs: CostModel, now: float) -> str | None:
    """Record a session's next call (its kind `node`); a problem, described, if it cannot come now."""
    if not job.plan.open:
        return f"a call arrived for {job.job_id}, which is not a session"
    if node not in job.plan.nodes:
        return f"{job.job_id} has no call kind {node!r} (its plan: {sorted(job.plan.nodes)})"
    if job.call is not None or job.nodes:
        return f"a call {node!r} arrived for {job.job_id} while another is pending or running"
    away = job.cpu_started.pop(CLIENT, None)
    if away is not None:
        costs.observe(job.job_id, CLIENT, now - away)
        job.work_done += now - away
    job.call = node
    return None


def observe_call(job: JobRecord, costs: CostModel, seconds: float) -> None:
    """A job's node ended well: a session's learns its time among all its calls (`CALL`)."""
    if job.plan.open:
        costs.observe(job.job_id, CALL, seconds)


def checkpoint_due(job: JobRecord) -> bool:
    """A session's call is done: whether a checkpoint is due after it (it changed the trained weights and was
    the k-th such call, `checkpoint_every = k`)."""
    node = next(iter(job.nodes))
    if not job.plan.nodes[node].commits:
        return False
    job.commits += 1
    k = job.plan.checkpoint_every
    return k > 0 and job.commits % k == 0


def idle(job: JobRecord) -> bool:
    """A session between two calls: nothing running, announced or being checkpointed."""
    return job.plan.open and not job.nodes and job.call is None and job.checkpoint is None


def only_idle_left(jobs: Iterable[JobRecord]) -> bool:
    """Whether the only jobs left are idle sessions waiting for their clients' calls (and queued jobs)."""
    left = [j for j in jobs if j.status not in TERMINAL]
    waiting = [j for j in left if j.status == "running" and idle(j)]
    return bool(waiting) and all(j.status == "queued" or j in waiting for j in left)


def busy_fraction(job: JobRecord, predict: Callable[[str, str], float]) -> float:
    """A session's predicted busy fraction: a call's time over a call's plus the client's."""
    call, client = predict(job.job_id, CALL), predict(job.job_id, CLIENT)
    return call / (call + client) if call + client > 0 else 0.0


__all__ = [
    "CALL",
    "CLIENT",
    "busy_fraction",
    "call_arrived",
    "checkpoint_due",
    "handlers",
    "idle",
    "observe_call",
    "on_call_arrived",
    "on_closing",
    "only_idle_left",
]
