"""The server's HTTP connections, bounded: how many, for how long, and how big their headers (`HttpConfig`, the
server config's `http:` section), and `serve`, which runs uvicorn over the listening socket with them.

`bounded_protocol(cfg)` is uvicorn's HTTP protocol (httptools) with, per connection:
- an **idle** limit: a connection that has not begun a request `idle_timeout_s` after it opened (or after its
  last answer) is closed;
- a **header** limit: a request's line and headers must arrive within `header_timeout_s` of its first byte
  and hold at most `max_header_bytes` (a slow or endless header: closed);
- a **body** limit: its body must arrive within `body_timeout_s` after the headers (the routes bound its size);
- a **count**: at most `max_connections` at once. A connection over the count evicts the one that has waited
  longest without a whole request (idle, or half-sent); else, when every connection is busy with a request, a
  long poll (`LongPolls`: the longest-parked one of the user who holds the most); only when none is parked is
  the new one closed. Idle or half-sent connections thus cannot lock anyone out: a real request always finds
  room, and the server never reaches the process's open-file limit (raised at start to what the count needs:
  `open_files`: the count, `FILES_SPARE`, and a few bursts of `BACKLOG` connections the event loop accepts
  before any of them is counted and evicted; with less, the count is lowered to fit), where every accept, and
  every file the server opens (the journal, a model, a worker's pipe), would fail.
uvicorn's own `limit_concurrency` (503 for a request beyond it) is set just above the count, as a backstop, and
its `timeout_keep_alive` to the idle limit. A request being handled is not timed: its route bounds its work.

`serve` runs the server's event loop with an exception handler that logs what asyncio reports (a failed accept,
a transport error) without its traceback, through the rate-limited log (`plexrl.logs`): a flood of failing
connections costs a few lines a minute. What this module does NOT do: look at requests (`guard.py`), TLS.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from collections import Counter
from collections.abc import Callable
from typing import Any

from pydantic import Field

from plexrl.job.model_config import StrictModel

log = logging.getLogger(__name__)

FILES_SPARE = 256  # open files kept for everything but connections (journal, workers' pipes, Dask, models)
BACKLOG = 128  # the listening queue, and the most connections the event loop accepts at once
BURSTS = 3  # accepted bursts that can be open before their connections are counted (and evicted)


class HttpConfig(StrictModel):
    """The `http:` section of the server config: which names it answers to, and its connections' limits."""

    allowed_hosts: list[str] | None = Field(
        None,
        description="Names a request's Host header may give (e.g. the name of a proxy in front). None: the bound "
        "address (a loopback server also answers to localhost, 127.0.0.1 and ::1); a server bound to 0.0.0.0 "
        "or :: then accepts any name (it needs a token there).",
    )
    max_connections: int = Field(
        512,
        ge=8,
        le=65536,
        description="Open connections at once; one more evicts the connection that has waited longest without a "
        "whole request (docs/security.md). The open-file limit is raised to fit at start.",
    )
    idle_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="A connection with no request begun this long after opening (or after its "
        "last answer) is closed."
    )  # fmt: skip
    header_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="A request's line and headers must arrive within this of its first byte."
    )
    body_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="A request's body must arrive within this after its headers."
    )
    max_header_bytes: int = Field(
        65536, ge=4096, le=1 << 24, description="Largest request line plus headers; beyond it the request is refused."
    )


Peer = tuple[str, int]  # a connection's client address, as uvicorn gives it (the protocol's `client`, a scope's)


class LongPolls:
    """The connections whose request is a long poll (a route that waits for a result it does not make, such as
    the Tinker API's `retrieve_future`), by client address, with their user. Such a connection is busy, but it
    works for nobody: at most `per_user` of one user are parked at once (`park` says no beyond, and the route
    refuses the poll: 429), and when every connection is busy the longest-parked poll of the user holding the
    most is evicted for a new connection (`victim`), so one user's long polls cannot lock another user out. Used
    from the event loop's thread only (the routes and the connections share it): no lock."""

    def __init__(self, per_user: int) -> None:
        self.per_user = per_user
        self._parked: dict[Peer, tuple[str | None, object, Callable[[], None] | None]] = {}  # (user, token, evicted)
        self._since: dict[Peer, int] = {}  # peer -> park order (oldest first)
        self._n = 0

    def count(self, user: str | None) -> int:
        return sum(1 for u, _, _ in self._parked.values() if u == user)

    def park(self, peer: Peer | None, user: str | None, evicted: Callable[[], None] | None = None) -> object | None:
        """Park `peer`'s long poll for `user` (None: the administrator, never capped): a token for `unpark`, or
        None when `user` has `per_user` parked already. A connection with no address is not tracked. `evicted`:
        called when `victim` picks it (the poll then ends at once, instead of waiting out its time on a closed
        connection)."""
        token = object()
        if peer is None:
            return token
        if user is not None and self.count(user) >= self.per_user:
            return None
        self._n += 1
        self._parked[peer], self._since[peer] = (user, token, evicted), self._n
        return token

    def unpark(self, peer: Peer | None, token: object) -> None:
        """The poll of that `park` ended (answered, or its connection evicted before: then nothing)."""
        if peer is not None and self._parked.get(peer, (None, None, None))[1] is token:
            del self._parked[peer], self._since[peer]

    def victim(self) -> Peer | None:
        """The parked connection to evict: the longest-parked of the user holding the most (None: none); its poll
        is told (`park`'s `evicted`)."""
        if not self._parked:
            return None
        held = Counter(u for u, _, _ in self._parked.values())
        peer = min(self._parked, key=lambda p: (-held[self._parked[p][0]], self._since[p]))
        evicted = self._parked.pop(peer)[2]
        del self._since[peer]
        if evicted is not None:
            evicted()
        return peer


def bounded_protocol(cfg: HttpConfig, polls: LongPolls | None = None) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with `cfg`'s limits, evicting `polls`' long polls last; see the module
    docstring."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Bounded(HttpToolsProtocol):
        """One connection (uvicorn's protocol object) with a state for the limits: `waiting` (no request, or one
        arriving: evictable, timed) or `busy` (a whole request is being answered)."""

        def connection_made(self, transport: Any) -> None:
            self._timer: asyncio.TimerHandle | None = None
            self._busy, self._since, self._header_bytes = False, self.loop.time(), 0
            if len(self.connections) >= cfg.max_connections and not _evict(self.connections):
                transport.abort()  # every connection is answering a request: this one waits its turn elsewhere
                return
            super().connection_made(transport)
            self._arm(cfg.idle_timeout_s, "idle")

        def _arm(self, seconds: float | None, what: str) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = None if seconds is None else self.loop.call_later(seconds, self._expire, what)

        def _expire(self, what: str) -> None:
            log.debug("closing connection %s: %s limit passed", self.client, what)
            if self.transport is not None and not self.transport.is_closing():
                self.transport.abort() if what != "idle" else self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._arm(None, "")
            if self.transport is not None:
                super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._busy, self._header_bytes = False, 0
            self._arm(cfg.header_timeout_s, "header")

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > cfg.max_header_bytes:  # (httptools turns this into a 400 and a close)
                raise ValueError(f"request headers over {cfg.max_header_bytes} bytes")

        def on_headers_complete(self) -> None:
            self._arm(cfg.body_timeout_s, "body")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._arm(None, "")
            self._busy = True
            super().on_message_complete()

        def on_response_complete(self) -> None:
            self._busy, self._since = False, self.loop.time()
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(cfg.idle_timeout_s, "idle")

    def _evict(connections: set[Any]) -> bool:
        """Close the connection that has waited longest without a whole request, else a long poll (`polls`);
        False if all are busy with other requests."""
        waiting = [c for c in connections if isinstance(c, Bounded) and not c._busy and c.transport is not None]
        if not waiting:
            while polls is not None and (peer := polls.victim()) is not None:
                parked = [c for c in connections if isinstance(c, Bounded) and c.client == peer and c.transport]
                if parked:
                    log.debug("evicting the long poll of %s: every connection is busy", peer)
                    waiting = parked[:1]
                    break
            if not waiting:
                return False
        oldest = min(waiting, key=lambda c: c._since)
        oldest.connections.discard(oldest)  # (its connection_lost comes later, from the loop)
        oldest.transport.abort()
        return True

    return Bounded


def open_files(needed: int) -> int:
    """Raise this process's soft open-file limit to at least `needed` (within the hard limit); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def _quiet_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's errors (a failed accept, a broken transport): one line each, no traceback, rate-limited."""
    exc = context.get("exception")
    log.warning("%s%s", context.get("message", "asyncio error"), f": {type(exc).__name__}: {exc}" if exc else "")


def uvicorn_server(app: Any, cfg: HttpConfig, polls: LongPolls | None = None) -> Any:
    """The uvicorn `Server` for `app` with `cfg`'s limits (not started); `polls`: the long polls its routes park."""
    import uvicorn

    limit = open_files(cfg.max_connections + FILES_SPARE + BURSTS * BACKLOG)
    connections = cfg.max_connections
    if limit != resource.RLIM_INFINITY and limit < connections + FILES_SPARE + BURSTS * BACKLOG:
        connections = max(8, limit - FILES_SPARE - BURSTS * BACKLOG)
        log.warning("the open-file limit is %d: at most %d connections at once (http.max_connections)", limit,
                    connections)  # fmt: skip
        cfg = cfg.model_copy(update={"max_connections": connections})
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", http=bounded_protocol(cfg, polls),
        limit_concurrency=connections + 1, timeout_keep_alive=max(1, int(cfg.idle_timeout_s)), backlog=BACKLOG,
    )  # fmt: skip
    return uvicorn.Server(config)


def serve(server: Any, sock: socket.socket) -> None:
    """Run `server` (`uvicorn_server`) on the listening `sock` until it exits (in the calling thread)."""

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(_quiet_handler)
        await server.serve(sockets=[sock])

    asyncio.run(main())


__all__ = ["HttpConfig", "LongPolls", "Peer", "bounded_protocol", "open_files", "serve", "uvicorn_server"]
