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
from dataclasses import dataclass
from typing import Any

from plexrl.planner.costs import CostModel
from plexrl.planner.events import CallArrived, Instruction, SessionClosing
from plexrl.planner.records import CLIENT, TERMINAL, InvalidTransition, JobRecord, JobStatus

CALL = "<call>"  # pseudo node: a call's time, every kind together


@dataclass(slots=True)
class Sessions:
    """The session events' part of `core.Planner`, like `dispatch.Dispatcher`: the planner's jobs and cost model
    (shared, not copied), its clock, and the three steps of the planner it calls back: `advance` a job's nodes
    (`Planner._advance`), `end` a job with a status and a reason (`Planner._end_job`), and `history` for an
    error. It changes only the records it is given and appends instructions through those steps."""

    jobs: dict[str, JobRecord]
    costs: CostModel
    clock: Callable[[], float]
    advance: Callable[[JobRecord, list[Instruction]], None]
    end: Callable[[str, JobStatus, str, list[Instruction]], None]
    history: Callable[[str], str]

    def handlers(self) -> dict[type, Callable[[Any, list[Instruction]], None]]:
        """Its handlers, by event type (`Planner.handle`)."""
        return {CallArrived: self.call_arrived, SessionClosing: self.closing}

    def call_arrived(self, ev: CallArrived, out: list[Instruction]) -> None:
        """A session's next call came: it starts at once when the session is idle (placed, no checkpoint held)."""
        job = self.jobs.get(ev.job_id)
        if job is None or job.status in TERMINAL:
            return  # a late call of a session that already ended (the runtime fails it)
        now = self.clock()
        problem = call_arrived(job, ev.node, self.costs, min(ev.at, now) if ev.at is not None else now)
        if problem is not None:
            raise InvalidTransition(self.history(problem))
        if job.status == "running" and job.checkpoint is None:  # (queued, or held: it starts when that ends)
            job.start_iteration(now)
            self.advance(job, out)

    def closing(self, ev: SessionClosing, out: list[Instruction]) -> None:
        """A session's client is gone: it ends now if idle, else after its running (or announced) call."""
        job = self.jobs.get(ev.job_id)
        if job is None or job.status in TERMINAL:
            return
        if not job.plan.open:
            raise InvalidTransition(self.history(f"{ev.job_id} is not a session; it cannot close"))
        job.closing = True
        if job.status == "queued":
            self.end(job.job_id, "cancelled", "the session closed before it was placed", out)
        elif idle(job):
            self.end(job.job_id, "done", "", out)


def call_arrived(job: JobRecord, node: str, costs: CostModel, now: float) -> str | None:
    """Record a session's next call (its kind `node`) that came at `now`; a problem, described, if it cannot
    come now."""
    if not job.plan.open:
        return f"a call arrived for {job.job_id}, which is not a session"
    if node not in job.plan.nodes:
        return f"{job.job_id} has no call kind {node!r} (its plan: {sorted(job.plan.nodes)})"
    if job.call is not None or job.nodes:
        return f"a call {node!r} arrived for {job.job_id} while another is pending or running"
    away = job.cpu_started.pop(CLIENT, None)
    if away is not None:
        away = max(now - away, 0.0)  # (a call that came as the previous one's end was being reported: none)
        costs.observe(job.job_id, CLIENT, away)
        job.work_done += away
    if job.last_call is not None:  # (what its client sends after each kind: `batches.gather_until`)
        job.follows.setdefault(job.last_call, set()).add(node)
    job.call = job.last_call = node
    return None


def observe_call(job: JobRecord, costs: CostModel, seconds: float) -> None:
    """A job's node ended well: a session's learns its time among all its calls (`CALL`)."""
    if job.plan.open:
        costs.observe(job.job_id, CALL, seconds)


def checkpoint_due(job: JobRecord) -> bool:
    """A session's call is done: whether a checkpoint is due after it (it changed the trained weights and was
    the first or a k-th such call, `checkpoint_every = k`: a session with no checkpoint then has no change
    its client was told of, and resumes from scratch)."""
    node = next(iter(job.nodes))
    if not job.plan.nodes[node].commits:
        return False
    job.commits += 1
    k = job.plan.checkpoint_every
    return k > 0 and (job.commits == 1 or job.commits % k == 0)


def idle(job: JobRecord) -> bool:
    """A session between two calls: nothing running, announced or being checkpointed."""
    return job.plan.open and not job.nodes and job.call is None and job.checkpoint is None


def comes_to(job: JobRecord, kind: str) -> bool:
    """Whether `job`'s client was seen to come to a call of `kind` from the kind of its latest call, at once or
    through calls of other kinds (`JobRecord.follows`): a loop that samples, trains, steps and saves comes back
    to sampling from each; a client that only trains after its first sample does not.

    >>> from plexrl.planner.events import JobPlan, NodePlan
    >>> s = JobRecord("s", JobPlan({k: NodePlan("service") for k in "abc"}, 10, tuple("abc"), open=True))
    >>> s.follows, s.last_call = {"a": {"b"}, "b": {"c"}, "c": {"b"}}, "c"
    >>> comes_to(s, "c"), comes_to(s, "a")
    (True, False)
    """
    seen, todo = set(), [job.last_call] if job.last_call is not None else []
    while todo:
        for nxt in job.follows.get(todo.pop(), ()):
            if nxt == kind:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def away(job: JobRecord) -> bool:
    """An idle session whose client is away (its load falls with time: `busy_fraction`)."""
    return idle(job) and CLIENT in job.cpu_started


def only_idle_left(jobs: Iterable[JobRecord]) -> bool:
    """Whether the only jobs left are idle sessions waiting for their clients' calls (and queued jobs)."""
    left = [j for j in jobs if j.status not in TERMINAL]
    waiting = [j for j in left if j.status == "running" and idle(j)]
    return bool(waiting) and all(j.status == "queued" or j in waiting for j in left)


def busy_fraction(job: JobRecord, predict: Callable[[str, str], float], now: float | None = None) -> float:
    """A session's predicted busy fraction: a call's time over a call's plus the client's. While its client is
    away (idle) at `now`, the client's time is at least how long it has been away: an idle session's load falls
    the longer it stays idle, so sessions whose clients went quiet (or never came back after a restart) do not
    keep a service full for good (`admission.room_at` says when a queued job fits).

    >>> from plexrl.planner.events import JobPlan, NodePlan
    >>> s = JobRecord("s", JobPlan({"sample": NodePlan("service")}, 10, ("sample",), open=True))
    >>> s.cpu_started[CLIENT] = 0.0  # idle since 0, a call predicted 1 s, the client 1 s
    >>> busy_fraction(s, lambda job, node: 1.0, now=0.5), busy_fraction(s, lambda job, node: 1.0, now=9.0)
    (0.5, 0.1)
    """
    call, client = predict(job.job_id, CALL), predict(job.job_id, CLIENT)
    since = job.cpu_started.get(CLIENT)
    if now is not None and since is not None:
        client = max(client, now - since)
    return call / (call + client) if call + client > 0 else 0.0


__all__ = [
    "CALL",
    "CLIENT",
    "Sessions",
    "away",
    "busy_fraction",
    "call_arrived",
    "checkpoint_due",
    "comes_to",
    "idle",
    "observe_call",
    "only_idle_left",
]
