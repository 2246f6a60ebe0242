"""The futures of the Tinker API: every call a client sends is answered at once with a request id, and its
result is fetched with `retrieve_future`, which waits here for it (a long poll: at most `poll_s` seconds, then
`try_again`; the SDK asks again at once). Results are completed from any thread (the runner's, when the call's
node ends) and awaited on the HTTP server's event loop without holding a thread per waiting client.

A result is kept until `keep_s` after it was first fetched (the SDK may fetch again after a lost answer) and at
most `max_age_s` after it was completed. An unknown id (the server restarted since the call was sent, the result
was fetched long ago, or it is another user's) answers 410 at once, never a hang: Tinker's "promise expired", on
which the SDK sends a sampling call again and raises `RetryableException` for a training call (`GONE`).

A long poll holds a connection: it is parked in `polls` (`http.LongPolls`, shared with the server's connections)
while it waits, at most `max_polls_per_user` of one user at once (one more gets 429, on which the SDK backs off),
and the connection limit evicts parked polls, the most-parked user's first, before it turns a connection away:
an evicted poll ends at once (nothing of it waits out `poll_s`).

`replying(futures, request_id, finish)` is the `done` of a call passed on to the runner: its reply completes the
request's future (through `finish`, which may hand its work to a thread of its own: `Finish`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from plexrl.server.http import LongPolls, Peer
from plexrl.server.tinker.decode import Refused
from plexrl.sessions.calls import unpack

log = logging.getLogger(__name__)

Kind = Literal["json", "proto", "error"]
Done = Callable[[dict[str, Any] | None, str | None], None]
Finish = Callable[[dict[str, Any]], tuple[str, Any] | concurrent.futures.Future[tuple[str, Any]]]
"""How a call's reply value becomes its future's result: ("json", a dict) or ("proto", bytes); or a
`concurrent.futures.Future` of that, from a finish whose work runs on a thread of its own (`exports.py`): the
request's future completes when that one does, and the thread that delivered the reply goes on meanwhile."""
GONE = ("this server does not know it: it restarted since the call was sent (a training client resumes from its "
        "latest checkpoint; send the call again), or its result was fetched long ago")  # fmt: skip


@dataclass(slots=True)
class Future:
    """One request's future: who may read it, what it waits for (`reason`: shown in try_again), its result."""

    request_id: str
    user: str | None
    what: str
    created: float
    reason: str = ""
    kind: Kind | None = None
    payload: Any = None  # json: a dict; proto: bytes; error: (message, category)
    done_at: float | None = None
    fetched_at: float | None = None
    withdraw: Callable[[], bool] | None = None  # takes its call back while still queued (True: it was)
    nbytes: int = 0  # its call's decoded inputs, counted against its user's until it completes
    session: str = ""  # the client session it serves ("": none): while it runs, that client is not silent
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(default_factory=list)


class Futures:
    """See the module docstring. Thread-safe."""

    def __init__(
        self, keep_s: float = 120.0, max_age_s: float = 3600.0, max_open: int | None = None, max_polls: int = 64,
        max_bytes: int | None = None,
    ) -> None:  # fmt: skip
        self.polls = LongPolls(max_polls)  # (the event loop's: `wait` is its only user here)
        self._lock = threading.Lock()
        self._items: dict[str, Future] = {}
        self._open: dict[str | None, int] = {}  # user -> futures not yet fetched (pending or done)
        self._bytes: dict[str | None, int] = {}  # user -> bytes of the inputs of its calls not yet completed
        self.keep_s, self.max_age_s, self.max_open, self.max_bytes = keep_s, max_age_s, max_open, max_bytes

    def room(self, user: str | None, nbytes: int = 0) -> None:
        """Refused (429) when `user` holds `max_open` futures not yet fetched (calls in flight, held, queued or
        done and never retrieved), or `nbytes` more of inputs would pass `max_bytes` of its calls not yet
        completed: check it before a request changes anything."""
        with self._lock:
            self._sweep(time.monotonic())
            held, waiting = self._open.get(user, 0), self._bytes.get(user, 0)
        if self.max_bytes is not None and user is not None and nbytes and waiting + nbytes > self.max_bytes:
            raise Refused(429, f"user {user!r} has {waiting} bytes of inputs waiting to run, this server's "
                               "tinker.max_queued_bytes_per_user; wait for them to run")  # fmt: skip
        if self.max_open is not None and user is not None and held >= self.max_open:
            raise Refused(429, f"user {user!r} has {held} requests not yet retrieved, this server's "
                               "tinker.max_requests_per_user; retrieve their results first (or ask the server's "
                               "owner to raise it)")  # fmt: skip

    def new(self, user: str | None, what: str, reason: str = "", nbytes: int = 0, session: str = "") -> Future:
        """A pending future for a call of `user` (None: the administrator) whose inputs take `nbytes`, sent in
        client session `session`; `room` refused first."""
        self.room(user, nbytes)
        now = time.monotonic()
        # (ids cannot be guessed)
        fut = Future("r" + secrets.token_hex(12), user, what, now, reason, nbytes=nbytes, session=session)
        with self._lock:
            self._items[fut.request_id] = fut
            self._open[user] = self._open.get(user, 0) + 1
            self._bytes[user] = self._bytes.get(user, 0) + nbytes
        return fut

    def waiting_bytes(self, user: str | None) -> int:
        """Bytes of `user`'s call inputs not yet completed (`max_bytes`)."""
        with self._lock:
            return self._bytes.get(user, 0)

    def complete(self, request_id: str, kind: Kind, payload: Any) -> None:
        """Set a future's result (the first one stands) and wake its waiters."""
        with self._lock:
            fut = self._items.get(request_id)
            if fut is None or fut.kind is not None:
                return
            fut.kind, fut.payload, fut.done_at = kind, payload, time.monotonic()
            waiters, fut.waiters = fut.waiters, []
            self._bytes[fut.user] = self._bytes.get(fut.user, 0) - fut.nbytes  # (its inputs are no longer held)
            fut.nbytes = 0
        for loop, waiter in waiters:
            loop.call_soon_threadsafe(_wake, waiter)

    def fail(self, request_id: str, message: str, category: str = "user") -> None:
        self.complete(request_id, "error", (message, category))

    def cancel(self, request_id: str, user: str | None) -> bool:
        """The client's `cancel_future`: a call of `user`'s still queued is taken back and its future fails
        ("cancelled"); one running or done, or an unknown or foreign id, is left as it is (False)."""
        with self._lock:
            fut = self._items.get(request_id)
            if fut is None or (user is not None and fut.user != user) or fut.kind is not None or not fut.withdraw:
                return False
            withdraw = fut.withdraw
        if not withdraw():
            return False
        self.fail(request_id, "cancelled by its client before it ran", "user")
        return True

    def set_reason(self, request_id: str, reason: str) -> None:
        with self._lock:
            fut = self._items.get(request_id)
            if fut is not None:
                fut.reason = reason

    def get(self, request_id: str) -> Future | None:
        with self._lock:
            return self._items.get(request_id)

    async def wait(self, request_id: str, timeout: float, user: str | None, peer: Peer | None = None) -> Future | None:
        """The future once it is done, or as it is after `timeout` seconds; None at once for an unknown id or
        another user's (`user` None: the administrator, who reads every one): such a read waits for nothing
        and changes nothing, so it tells nothing about the future either. While it waits, the connection of
        `peer` is parked (`polls`); Refused (429) when `user` has `max_polls_per_user` parked already."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] | None = None
        with self._lock:
            fut = self._items.get(request_id)
            if fut is None or (user is not None and fut.user != user):
                return None
            if fut.kind is None:
                waiter = loop.create_future()
                fut.waiters.append((loop, waiter))
        token = None
        if waiter is not None:  # (evicted by the connection limit: the poll ends at once, its connection is gone)
            token = self.polls.park(peer, user, functools.partial(_wake, waiter))
        try:
            if waiter is not None and token is None:
                raise Refused(429, f"user {user!r} has {self.polls.count(user)} retrieve_future long polls waiting, "
                                   "this server's tinker.max_polls_per_user; the SDK asks again after a pause (or "
                                   "ask the server's owner to raise it)")  # fmt: skip
            if waiter is not None:
                await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            pass
        finally:
            if waiter is not None:
                with self._lock:
                    fut.waiters = [(lp, w) for lp, w in fut.waiters if w is not waiter]
            if token is not None:
                self.polls.unpark(peer, token)
        with self._lock:
            if fut.kind is not None and fut.fetched_at is None:
                fut.fetched_at = time.monotonic()
                self._gone(fut)
        return fut

    def busy(self, within_s: float) -> set[str]:
        """The sessions a client is still waiting on: a call of theirs runs (or waits for its turn or a
        service), or one completed or was fetched in the last `within_s` seconds. A client that sent a long
        call is polling for it, not silent (`registry.sweep`)."""
        since = time.monotonic() - within_s
        with self._lock:
            return {f.session for f in self._items.values()
                    if f.session and (f.kind is None or max(f.done_at or 0, f.fetched_at or 0) >= since)}  # fmt: skip

    def pending(self) -> int:
        with self._lock:
            return sum(1 for f in self._items.values() if f.kind is None)

    def _sweep(self, now: float) -> None:
        """Drop results fetched more than `keep_s` ago or completed more than `max_age_s` ago (lock held)."""
        gone = [
            rid
            for rid, f in self._items.items()
            if f.kind is not None
            and ((f.fetched_at is not None and now - f.fetched_at > self.keep_s)
                 or (f.done_at is not None and now - f.done_at > self.max_age_s))
        ]  # fmt: skip
        for rid in gone:
            fut = self._items.pop(rid)
            if fut.fetched_at is None:
                self._gone(fut)

    def _gone(self, fut: Future) -> None:
        """`fut` no longer counts against its user (fetched, or dropped unfetched; lock held)."""
        left = self._open.get(fut.user, 0) - 1
        if left > 0:
            self._open[fut.user] = left
        else:
            self._open.pop(fut.user, None)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def replying(futures: Futures, request_id: str, finish: Finish) -> Done:
    """The `done(reply, error)` of a call (run on the runner's thread, which must not wait): the reply's value made
    the future's result (`finish`), a refusal on the service a user error, a call that did not run a server
    error."""

    def settle(make: Callable[[], Any]) -> None:
        try:
            out = make()
        except Exception as exc:  # a reply we cannot encode: the server's fault, said so
            log.exception("encoding the reply of request %s failed", request_id)
            futures.fail(request_id, f"encoding the reply failed: {type(exc).__name__}: {exc}", "server")
            return
        if isinstance(out, concurrent.futures.Future):  # (its work runs elsewhere: settled once it is done)
            out.add_done_callback(lambda ran: settle(ran.result))
            return
        kind, payload = out
        futures.complete(request_id, kind, payload)

    def done(reply: dict[str, Any] | None, error: str | None) -> None:
        if reply is None:
            futures.fail(request_id, error or "the call did not run", "server")
        elif reply.get("error"):
            futures.fail(request_id, str(reply["error"]), "user")
        else:
            settle(lambda: finish(unpack(reply.get("value") or {})))

    return done


__all__ = ["GONE", "Done", "Finish", "Future", "Futures", "replying"]
