"""Checks every request gets before any route sees it, whatever the route (the job API, the page, /metrics, the
Tinker API): `RequestGuard`, an ASGI middleware around the whole application.

- **Host** (DNS rebinding): the `Host` header must name this server: one of `http.allowed_hosts`, or by
  default the bound address (a loopback server also answers to `localhost`, `127.0.0.1` and `::1`). A page of
  another site whose name an attacker re-pointed at 127.0.0.1 sends its own name: 421, nothing done. A server
  bound to every interface (0.0.0.0, ::) without `allowed_hosts` accepts any name: it needs a token there, and
  a browser never sends the token on its own.
- **Cross-site requests** (CSRF): a request that changes anything (any method but GET, HEAD, OPTIONS) must
  carry `Content-Type: application/json` (or `application/x-protobuf`, the Tinker SDK's): types a page of
  another origin cannot send without the browser first asking the server (a CORS preflight, which this server
  never grants). Its `Origin`, when the client sends one (a browser always does on such a request), must be
  this server's own (`http(s)://<its Host header>`), and `Sec-Fetch-Site`, when sent, `same-origin` or `none`.
  Refused: 415 (content type) or 403 (origin), with the problem named; command-line and SDK clients send no
  Origin and set the content type (`plexrl.server.client`).
- **A client that hangs up** while its request is read is not an error: no traceback, no answer (nobody is
  there to read it).

Refusals are JSON like every other (`{"problems": [{"where", "message"}]}`). What this module does NOT do:
authenticate (`api.create_app`'s middleware, inside this one), bound connections or their timing
(`plexrl/server/http.py`), or serve CORS (no route grants another origin anything).
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Iterable
from typing import Any

from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
BODY_TYPES = frozenset({"application/json", "application/x-protobuf"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def host_names(bound: str, configured: Iterable[str] | None) -> frozenset[str] | None:
    """The names a request's Host may give (lower case, no port): `configured`, else those of the bound address
    (a loopback address: also `localhost`, `127.0.0.1`, `::1`); None (any) for a wildcard bind without them."""
    if configured:
        return frozenset(_bare(h) for h in configured)
    host = _bare(bound)
    if host in WILDCARDS:
        return None
    names = {host}
    try:
        if ipaddress.ip_address(host).is_loopback:
            names |= LOOPBACK_NAMES
    except ValueError:
        if host == "localhost":
            names |= LOOPBACK_NAMES
    return frozenset(names)


def _bare(host: str) -> str:
    """`host` without a port or brackets, lower case: `[::1]:8765` -> `::1`, `Example.org:80` -> `example.org`."""
    h = host.strip().lower()
    if h.startswith("["):
        return h[1 : h.index("]")] if "]" in h else h[1:]
    if h.count(":") == 1:
        return h.split(":", 1)[0]
    return h  # a bare IPv6 address, or a name without a port


class RequestGuard:
    """The ASGI middleware; see the module docstring. `hosts`: `host_names(...)`."""

    def __init__(self, app: Any, hosts: frozenset[str] | None) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refused = self.problem(scope["method"], headers)
        if refused is not None:
            status, where, message = refused
            body = json.dumps({"problems": [{"where": where, "message": message}]}).encode()
            head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")]  # fmt: skip
            await send({"type": "http.response.start", "status": status, "headers": head})
            await send({"type": "http.response.body", "body": body})
            return
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:  # the client hung up while its body was read: nobody to answer
            log.debug("client %s hung up during %s %s", scope.get("client"), scope["method"], scope.get("path"))

    def problem(self, method: str, headers: dict[str, str]) -> tuple[int, str, str] | None:
        """(status, where, message) of a refused request, or None."""
        host = headers.get("host", "")
        if self.hosts is not None and _bare(host) not in self.hosts:
            shown = ", ".join(sorted(self.hosts))
            return 421, "host", (
                f"this server answers to {shown}, not {host[:100]!r}; use its address (or ask its owner to add the "
                "name to http.allowed_hosts)"
            )  # fmt: skip
        if method.upper() in SAFE_METHODS:
            return None
        kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind not in BODY_TYPES:
            return 415, "content-type", (
                f"{method} needs Content-Type: application/json (got {kind[:100] or 'none'!r}); a page of another "
                "site cannot send that type, so this keeps it from acting through your browser"
            )  # fmt: skip
        origin = headers.get("origin")
        if origin is not None and origin not in (f"http://{host}", f"https://{host}"):
            return 403, "origin", (
                f"a request from {origin[:100]!r} may not change anything on this server (only its own pages, at "
                f"http://{host[:100]}, may)"
            )  # fmt: skip
        site = headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            return 403, "origin", f"a {site[:30]} request may not change anything on this server"
        return None


__all__ = ["BODY_TYPES", "RequestGuard", "host_names"]
