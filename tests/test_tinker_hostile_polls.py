"""Long polls of the Tinker API (`retrieve_future`) against the connection limit of a real `plexrl serve`, over raw
HTTP connections (a hostile client opens them by the hundred; the SDK never would): one user's parked polls are
capped (`tinker.max_polls_per_user`: 429 beyond), and when every connection is busy, a new connection evicts the
longest-parked poll of the user holding the most instead of being turned away; the evicted poll ends at once
(it does not wait out `poll_s` on a closed connection). Bounded: a few sockets, each read with a deadline; the
polls wait longer than the test (`poll_s` 40), so nothing answers them by time."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import wait_for

from plexrl.server.api import RunningServer, start_server
from plexrl.server.config import ServerConfig

ANN, BOB, CARL = "ann-token-0123456789", "bob-token-0123456789", "carl-token-012345678"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RunningServer]:
    cfg = ServerConfig(
        port=0, journal=str(tmp_path / "journal.db"), run_dir=str(tmp_path / "runs"), mlflow=False,
        cluster={"driver": "local", "services": {"count": 1}}, users={"ann": ANN, "bob": BOB, "carl": CARL},
        http={"max_connections": 8}, tinker={"max_polls_per_user": 5, "poll_s": 40},
    )  # fmt: skip
    srv = start_server(cfg)
    yield srv
    srv.stop(120)


def poll(srv: RunningServer, key: str, request_id: str) -> socket.socket:
    """A connection that sends one retrieve_future and is left waiting for its answer."""
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    body = json.dumps({"request_id": request_id}).encode()
    head = (f"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: {host}:{port}\r\nX-API-Key: tml-{key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + body)
    return sock


def answer(sock: socket.socket) -> str:
    """The whole answer on this connection (headers and body come in two writes), each read with a deadline."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < length(data):
        more = sock.recv(4096)
        if not more:
            break
        data += more
    return data.decode()


def length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].decode().lower()
    return next((int(line.split(":")[1]) for line in head.splitlines() if line.startswith("content-length:")), 0)


def closed(sock: socket.socket) -> bool:
    """Whether the server closed this connection (read with the socket's deadline)."""
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def test_one_users_long_polls_are_capped_and_evicted_before_another_user_is_turned_away(
    server: RunningServer,
) -> None:
    srv, futures = server, server.sessions.futures
    polls = futures.polls
    pending = {user: futures.new(user, "sample").request_id for user in ("bob", "carl")}  # (never completed)
    socks: list[socket.socket] = []
    try:
        # carl parks 2 polls first, then bob 5 (his cap)
        socks += [poll(srv, CARL, pending["carl"]) for _ in range(2)]
        wait_for(lambda: polls.count("carl") == 2, "carl's 2 long polls parked")
        bobs = []
        for i in range(5):
            bobs.append(poll(srv, BOB, pending["bob"]))
            wait_for(lambda i=i: polls.count("bob") == i + 1, f"bob's long poll {i + 1} parked")  # (in order)
        socks += bobs
        # bob's 6th: refused at once, 429 naming the setting (its connection is free then, and closed here)
        extra = poll(srv, BOB, pending["bob"])
        refused = answer(extra)
        extra.close()
        assert refused.startswith("HTTP/1.1 429") and "max_polls_per_user" in refused, refused[:300]
        wait_for(lambda: len(list(srv.http.server_state.connections)) == 7, "bob's 6th connection gone")
        socks.append(poll(srv, CARL, pending["carl"]))  # carl's 3rd: the 8 connections of the server, all busy
        wait_for(lambda: polls.count("carl") == 3, "carl's 3 long polls parked")
        # ann: every connection is a parked poll; hers evicts bob's oldest (bob holds the most), not carl's
        # older ones, and she is served, again and again
        for _ in range(8):
            assert httpx.post(f"{srv.url}/api/v1/create_session", json={}, headers={"X-API-Key": f"tml-{ANN}"},
                              timeout=10).status_code == 200  # fmt: skip
        assert closed(bobs[0])
        assert polls.count("bob") == 4 and polls.count("carl") == 3
        # the evicted poll ended at once: its waiter is gone within seconds, not the 40 s of poll_s
        waiting = futures.get(pending["bob"])
        assert waiting is not None
        wait_for(lambda: len(waiting.waiters) == 4, "the evicted poll's waiter dropped", timeout=5.0)
    finally:
        for rid in pending.values():
            futures.complete(rid, "json", {})
        for sock in socks:
            sock.close()
