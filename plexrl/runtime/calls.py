"""`CallBoard`: the calls of every session (a job with an open plan, `plexrl/planner/sessions.py`) waiting for
the runner, per session in the order they came. The seam between whoever receives calls (the server's Tinker
API, any thread) and the runner's loop:

    open(job): calls may be put from now on; they wait, unannounced, until the runner submits the job
    Carrier at the job's submission: started(job) --> the first waiting call's kind, if any --> CallArrived
    put(job, kind, call, done) --(first waiting call of an idle, started session)--> notify(job, kind) --> CallArrived
    Carrier at RunNode: take(job, kind) --> the call rides with the node (NodeTask.call)
    Carrier at the node's report: finished(job, reply, error) --> the reply kept; the next waiting call's kind,
                                                                if any, --> CallArrived (same loop turn)
    Runner, once the planner handled those events: deliver(held) --> done(...), except for a session held for
                                                                its checkpoint (delivered once that is written)
    a job that ends: drop(job, reason) --> every call of it still waiting or running fails with the reason; a
                                          reply kept for its checkpoint fails too (that state is lost)

A reply waits for the checkpoint after its call (the planner holds a session for one after a call that changes
its weights, `plexrl/planner/sessions.py`), so what a client was told is on disk first: a restart resumes there.

One call of a session is announced at a time (`announced`): the next only once the previous one's node
finished, so a session's calls run in the order they came, and the planner holds at most one per job. With
`bind(..., bundle=True)` (a runner with `bundle_calls`, a server's default, or whose planner batches rollouts),
a call that can run together with the calls waiting right behind it (`call.joins(next)`, e.g. a client's
sample calls sent at once, of the same weights) takes up to `BUNDLE` of them along, `BUNDLE_ROWS` samples in
all (`take`): the node runs them as one call (`call.bundle(calls)`), whose reply holds one reply per call
(`value["replies"]`), each handed to its own call.
A client that sends its calls at once sends them over a few milliseconds: the first finds its session idle and
would run alone, the rest together after it (two engine calls for one burst). With a `window` (`bind`), a
session seen sending at once (its last node ran several calls together, or a call of it came while a call it
would have joined was running) gets the first call of its next burst that finds it idle, of a kind that runs
together (a sample), announced only `window` seconds later (a timer thread), so that the calls sent with it
wait behind it and run in the same node. A wait that gathered nothing (the node ran that call alone) ends this
for the session until it shows either sign again.
Thread-safe (one lock); `done` callbacks run on the runner's thread, outside the lock, and must not block.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BUNDLE = 8  # the most waiting calls of one session that one node runs together (`take`)
# ... and the most samples they make in all (a call of more runs alone): a bundle is one call the service cannot
# preempt, every other user's call waits for all of it, and past a batch this size an engine call gains little
# from more rows on a CPU (eight 64-sample calls bundled took eight times one: docs/benchmarks.md, the flood)
BUNDLE_ROWS = 64

Timer = Callable[[float, Callable[[], None]], None]
"""`timer(seconds, fn)`: call `fn()` (from any thread) once `seconds` have passed (`thread_timer`)."""

Done = Callable[[dict[str, Any] | None, str | None], None]
"""`done(reply, error)`: the call's reply (`plexrl.sessions.calls.Reply` as plain data), or None and why the
call did not run (its node failed, its session ended)."""


@dataclass(slots=True)
class Ticket:
    """One call waiting for (or running on) its session's service."""

    job_id: str
    kind: str
    call: Any
    done: Done


def thread_timer(seconds: float, fn: Callable[[], None]) -> None:
    t = threading.Timer(seconds, fn)
    t.daemon = True
    t.start()


class CallBoard:
    """See the module docstring. `notify(job_id, kind)` tells the runner that an idle session's next call is
    waiting (`Runner` binds its inbox's; any thread). `timer`: how a delayed announcement is scheduled (tests
    give their own)."""

    def __init__(self, timer: Timer = thread_timer) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, deque[Ticket]] = {}
        self._running: dict[str, list[Ticket]] = {}  # a session's running call (or calls run together)
        self._announced: set[str] = set()
        self._started: set[str] = set()  # sessions the runner has submitted (their calls may be announced)
        self._replies: list[tuple[Ticket, dict[str, Any] | None, str | None]] = []  # not yet delivered
        self._held: set[str] = set()  # sessions whose kept replies wait for a checkpoint
        self._notify: Callable[[str, str], None] | None = None
        self._bundle = False  # run a session's waiting calls that join together (`bind`)
        self._window = 0.0  # how long a bursting session's first call waits for the rest (`bind`)
        self._timer = timer
        self._bursts: set[str] = set()  # sessions seen sending at once (see the module docstring)
        self._waiting: set[str] = set()  # sessions whose first call waits out the window before its announcement
        self._waited: set[str] = set()  # ... and that did, until their next node starts

    def bind(self, notify: Callable[[str, str], None], bundle: bool = False, window: float = 0.0) -> None:
        """The runner's way to be told (set once, when the runner is built); `bundle`: run a session's calls
        that join together (`take`; the runner's planner batches rollouts: a call's numbers may then differ by
        float noise from its numbers alone, as in a cohort); `window`: with `bundle`, how long the first call of
        a session whose client sends its calls at once waits for the rest (see the module docstring)."""
        self._notify, self._bundle, self._window = notify, bundle, window if bundle else 0.0

    def open(self, job_id: str) -> None:
        """A session whose calls this board takes (before its job is submitted)."""
        with self._lock:
            self._queues.setdefault(job_id, deque())

    def sessions(self) -> int:
        """How many sessions are open here."""
        with self._lock:
            return len(self._queues)

    def has(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._queues

    def put(self, job_id: str, kind: str, call: Any, done: Done) -> None:
        """Queue a call of session `job_id` (any thread); KeyError if the session is not open here."""
        announce, wait = None, False
        with self._lock:
            queue = self._queues[job_id]
            queue.append(Ticket(job_id, kind, call, done))
            running = self._running.get(job_id)
            joins = getattr(running[0].call, "joins", None) if running and self._window > 0 else None
            if joins is not None and len(queue) == 1 and joins(call):
                self._bursts.add(job_id)  # it came while a call it would have joined ran: sent with it
            if job_id in self._started and job_id not in self._announced and job_id not in self._waiting:
                if self._window > 0 and job_id in self._bursts and hasattr(queue[0].call, "joins"):
                    self._waiting.add(job_id)
                    wait = True
                else:
                    self._announced.add(job_id)
                    announce = queue[0].kind
        if wait:
            self._timer(self._window, lambda: self._announce_late(job_id))
        if announce is not None and self._notify is not None:
            self._notify(job_id, announce)

    def _announce_late(self, job_id: str) -> None:
        """The window of a bursting session's first call is over: announce its first waiting call (any thread)."""
        with self._lock:
            self._waiting.discard(job_id)
            queue = self._queues.get(job_id)
            if not queue or job_id not in self._started or job_id in self._announced:
                return  # (withdrawn, or the session ended meanwhile)
            self._announced.add(job_id)
            self._waited.add(job_id)
            announce = queue[0].kind
        if self._notify is not None:
            self._notify(job_id, announce)

    def withdraw(self, job_id: str, done: Done) -> bool:
        """Take back the call queued with `done` (its client cancelled it; any thread): True if it was waiting
        and not yet announced to the runner (then it never runs and `done` is not told), else False."""
        with self._lock:
            queue = self._queues.get(job_id)
            for i, ticket in enumerate(queue or ()):
                if ticket.done is done:
                    if i == 0 and job_id in self._announced:
                        return False  # (the planner holds it: it runs)
                    del queue[i]  # type: ignore[union-attr]
                    return True
        return False

    def started(self, job_id: str) -> str | None:
        """The runner submitted the session's job: its calls may be announced from now on; returns the kind of
        the first one waiting (announced by the caller, after the job's submission), or None."""
        with self._lock:
            if job_id not in self._queues:
                return None
            self._started.add(job_id)
            queue = self._queues[job_id]
            if not queue or job_id in self._announced:
                return None
            self._announced.add(job_id)
            return queue[0].kind

    def take(self, job_id: str, kind: str) -> list[Ticket] | None:
        """The runner starts the session's announced call (of `kind`), with the waiting calls right behind it
        that join it (see the module docstring): they leave the queue and run; None if the head of the queue is
        not such a call (a bug: the caller fails the job)."""
        with self._lock:
            queue = self._queues.get(job_id)
            if not queue or queue[0].kind != kind or job_id in self._running:
                return None
            tickets = [queue.popleft()]
            joins = getattr(tickets[0].call, "joins", None) if self._bundle else None
            rows = _rows(tickets[0].call)
            while joins is not None and queue and len(tickets) < BUNDLE and joins(queue[0].call):
                if rows + _rows(queue[0].call) > BUNDLE_ROWS:
                    break
                rows += _rows(queue[0].call)
                tickets.append(queue.popleft())
            if len(tickets) > 1:
                self._bursts.add(job_id)
            elif job_id in self._waited:
                self._bursts.discard(job_id)  # it waited and gathered nothing: not a client that sends at once
            self._waited.discard(job_id)
            self._running[job_id] = tickets
            return tickets

    def call_of(self, job_id: str, kind: str) -> tuple[bool, Any]:
        """(True, the call) a node of kind `kind` of `job_id` runs (`take`: several calls run together are one
        call, `bundle`; None for a job that is no session here), or (False, None) when a session has no such
        call waiting (a bug: the caller fails the job)."""
        if not self.has(job_id):
            return True, None
        tickets = self.take(job_id, kind)
        if tickets is None:
            return False, None
        if len(tickets) == 1:
            return True, tickets[0].call
        return True, tickets[0].call.bundle(tuple(t.call for t in tickets))

    def finished(self, job_id: str, reply: dict[str, Any] | None, error: str | None) -> str | None:
        """The running call's node ended: its reply is kept for `deliver`; returns the kind of the session's next
        waiting call (announced from now on), or None (the session is idle)."""
        with self._lock:
            tickets = self._running.pop(job_id, [])
            queue = self._queues.get(job_id)
            nxt = queue[0].kind if queue else None
            if nxt is None:
                self._announced.discard(job_id)
            replies = (reply.get("value") or {}).get("replies") if len(tickets) > 1 and reply is not None else None
            if isinstance(replies, list | tuple) and len(replies) == len(tickets):  # run together: each its own
                self._replies += [(t, r, error) for t, r in zip(tickets, replies, strict=True)]
            else:
                self._replies += [(t, reply, error) for t in tickets]
        return nxt

    def deliver(self, held: Callable[[str], bool]) -> None:
        """Tell the kept replies' `done`, except those of sessions `held(job_id)` for a checkpoint (kept until a
        later `deliver` finds the session no longer held: its checkpoint was written)."""
        with self._lock:
            if not self._replies:
                return
            out = [r for r in self._replies if not held(r[0].job_id)]
            self._replies = [r for r in self._replies if held(r[0].job_id)]
            self._held = {r[0].job_id for r in self._replies}
        for ticket, reply, error in out:
            ticket.done(reply, error)

    def drop(self, job_id: str, reason: str) -> None:
        """The session's job ended: every call still waiting or running fails with `reason`, and the board
        forgets the session."""
        with self._lock:
            tickets = list(self._queues.pop(job_id, ()))
            running = self._running.pop(job_id, [])
            self._announced.discard(job_id)
            self._started.discard(job_id)
            for bursts in (self._bursts, self._waiting, self._waited):
                bursts.discard(job_id)
            kept = [r for r in self._replies if r[0].job_id == job_id]
            self._replies = [r for r in self._replies if r[0].job_id != job_id]
            lost = job_id in self._held
            self._held.discard(job_id)
        for ticket, reply, error in kept:  # (held for a checkpoint that will not be written: not acknowledged)
            if lost:
                ticket.done(None, f"{reason}, before the checkpoint after this call was written")
            else:
                ticket.done(reply, error)
        for ticket in running + tickets:
            ticket.done(None, reason)


def _rows(call: Any) -> int:
    """The samples a call makes (`BUNDLE_ROWS`; a call of another kind: one)."""
    n = getattr(call, "num_samples", 1)
    return n if isinstance(n, int) else 1


__all__ = ["BUNDLE", "BUNDLE_ROWS", "CallBoard", "Done", "Ticket", "Timer", "thread_timer"]
