"""Connection exhaustion and a log flood. With the common 1,024 open-file limit, 1,100 idle or
half-sent connections made /health time out, were never closed, and stderr grew by a traceback per failed accept
and per client that hung up. Now connections are bounded in number (the longest-waiting idle one is evicted) and
time (idle, header, body), a client that hangs up costs no traceback, and repeated log lines are rate-limited
(the per-call reward warning included)."""

from __future__ import annotations

import logging
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_for
from test_server import serving

from plexrl.server.client import Client


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    return s


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed `s` (a read returns EOF or a reset); False while it is open."""
    s.setblocking(False)
    try:
        return s.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_idle_and_half_sent_connections_cannot_lock_anyone_out_and_are_closed(tmp_path: Path) -> None:
    http = {"max_connections": 16, "idle_timeout_s": 2, "header_timeout_s": 2, "body_timeout_s": 2}
    with serving(tmp_path, http=http) as srv:
        idle = [connect(srv.url) for _ in range(40)]
        half = [connect(srv.url) for _ in range(40)]
        for s in half:
            s.sendall(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # headers never finished
        body = [connect(srv.url) for _ in range(10)]
        for s in body:
            s.sendall(b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{")  # fmt: skip
        c = Client(srv.url, timeout=10)
        for _ in range(5):  # each answered at once, whatever the open connections
            assert c.request("GET", "/health")["ok"] is True
        # every one of them is closed by the server (evicted, or past its idle / header / body limit)
        wait_for(lambda: all(closed_by_server(s) for s in idle + half + body), "the server closed them all")
        for s in idle + half + body:
            s.close()
        assert c.request("GET", "/health")["ok"] is True


def test_a_client_that_hangs_up_costs_no_traceback(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Clients that close mid-body, or reset the connection (RST: SO_LINGER 0) while the server reads or answers:
    asyncio logged each reset as a 'Fatal read error on socket transport' with its traceback."""
    caplog.set_level(logging.INFO)
    with serving(tmp_path) as srv:
        for i in range(40):
            s = connect(srv.url)
            s.sendall(b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000\r\n\r\n" + b"{" + b" " * 5000)  # fmt: skip
            if i % 2:  # a reset, not a close
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        for _ in range(20):
            s = connect(srv.url)
            s.sendall(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 50)  # pipelined: answers pending
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        assert Client(srv.url).request("GET", "/health")["ok"] is True
        wait_for(lambda: srv.controller.journal.jobs() == [], "nothing journalled")
    tracebacks = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not tracebacks, [r.getMessage() for r in tracebacks]


def test_repeated_log_lines_are_rate_limited_with_a_count() -> None:
    from plexrl.logs import RepeatFilter

    now = [0.0]
    f = RepeatFilter(burst=3, window_s=60, clock=lambda: now[0])
    logger = logging.getLogger("plexrl.test_repeats")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    handler.addFilter(f)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for i in range(1000):
            logger.warning("reward %s: %s on %d row(s); scored 0", "ref", f"ValueError: {i}", 1)
        logger.warning("another kind of line")
        now[0] = 61.0
        logger.warning("reward %s: %s on %d row(s); scored 0", "ref", "ValueError: late", 1)
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 5, seen
    assert seen[3] == "another kind of line" and "997 similar line(s) suppressed" in seen[4]


def test_the_per_call_reward_warning_is_rate_limited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A user reward that raises on every row logged one warning per row (200 rows: 200 lines)."""
    from plexrl.data.config import RewardTerm
    from plexrl.rewards import Reward

    (tmp_path / "raising_reward.py").write_text(
        "from plexrl.roles import declare\n"
        "@declare('reward')\n"
        "def always(prompt, response, truth, **extra):\n"
        "    raise ValueError(f'bad row {response}')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.set_level(logging.WARNING, logger="plexrl.rewards")
    n = 200
    result = Reward([RewardTerm(ref="raising_reward:always")])(["p"] * n, [str(i) for i in range(n)], ["1"] * n)
    assert result.errors == n
    lines = [r for r in caplog.records if r.name == "plexrl.rewards"]
    assert 1 <= len(lines) <= 10, len(lines)


@pytest.mark.slow
def test_1100_idle_connections_at_the_1024_file_limit_leave_health_answering_and_stderr_quiet(
    tmp_path: Path,
) -> None:
    """The issue's setting, as a real `plexrl serve` process: its open-file limit 1,024 (soft and hard), 1,100
    idle or half-sent connections: /health still answers and stderr stays small (it grew to 386 MB in 40 s)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2400:
        pytest.skip(f"this test opens 2,400 files; the hard limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2400), hard))

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    err = tmp_path / "stderr.txt"
    with err.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "plexrl.cli", "serve", "--port", "0", "--set", "cluster.driver=local",
             "--set", f"journal={tmp_path / 'journal.db'}", "--set", f"run_dir={tmp_path / 'runs'}",
             "--set", "http.idle_timeout_s=3600", "--set", "http.header_timeout_s=3600"],
            stdout=subprocess.PIPE, stderr=sink, text=True, cwd=tmp_path, preexec_fn=limited,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert "listening on" in line, (line, err.read_text())
            url = line.split("listening on ", 1)[1].split(" ", 1)[0]
            held = []
            for i in range(1100):
                s = connect(url)
                if i % 2:
                    s.sendall(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                held.append(s)
            c = Client(url, timeout=10)
            for _ in range(10):
                assert c.request("GET", "/health")["ok"] is True
            for s in held:
                s.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
            if proc.stdout is not None:
                proc.stdout.close()
    assert err.stat().st_size < 100_000, err.read_text()[-3000:]
