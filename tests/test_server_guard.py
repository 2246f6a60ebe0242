"""Cross-site requests and DNS rebinding against the default server (loopback, no token). A page
of another origin used to submit a job and cancel another user's job through the browser (`fetch(..., {mode:
"no-cors"})`: a simple request, `Content-Type: text/plain`, the page's `Origin`), and any `Host` was answered.
Here the requests are sent as the browser sends them (raw HTTP, its headers): refused, and nothing changes."""

from __future__ import annotations

import copy
import http.client
import json
from pathlib import Path
from typing import Any

import yaml
from conftest import TINY, wait_for
from test_server import serving

from plexrl.server.client import Client

EVIL = "http://evil.example"


def raw(url: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One request with exactly these headers (as a browser would send them); (status, decoded JSON or text)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for k, v in {"Host": f"{host}:{port}", **(headers or {})}.items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, data.decode(errors="replace")
    finally:
        conn.close()


def job_text() -> str:
    return yaml.safe_dump({**copy.deepcopy(TINY), "iterations": 100_000})


def no_cors(origin: str = EVIL) -> dict[str, str]:
    """What `fetch(url, {method: "POST", mode: "no-cors", body: "..."})` from a page of `origin` sends."""
    return {"Content-Type": "text/plain;charset=UTF-8", "Origin": origin, "Sec-Fetch-Site": "cross-site",
            "Sec-Fetch-Mode": "no-cors"}  # fmt: skip


def test_a_page_of_another_origin_cannot_submit_or_cancel_through_a_browser(tmp_path: Path) -> None:
    with serving(tmp_path) as srv:
        c = Client(srv.url)
        (tmp_path / "job.yaml").write_text(job_text())
        victim = c.submit(tmp_path / "job.yaml", user="ann")["job_id"]
        wait_for(lambda: c.status(victim)["status"] == "running", "ann's job running")
        body = json.dumps({"yaml": job_text(), "user": "mallory"}).encode()
        status, answer = raw(srv.url, "POST", "/jobs", body, no_cors())
        assert status in (403, 415), (status, answer)
        status, answer = raw(srv.url, "POST", f"/jobs/{victim}/cancel", b"", no_cors())
        assert status in (403, 415), (status, answer)
        # the body parsed as JSON whatever its type: refused on the type alone, even from no origin at all
        status, answer = raw(srv.url, "POST", "/jobs", body, {"Content-Type": "text/plain"})
        assert status == 415 and "application/json" in answer["problems"][0]["message"], answer
        # a cross-origin request that could send JSON (it would need a preflight, never granted) is refused too
        json_cross = {"Content-Type": "application/json", "Origin": EVIL}
        assert raw(srv.url, "POST", f"/jobs/{victim}/cancel", b"{}", json_cross)[0] == 403
        assert raw(srv.url, "POST", "/jobs", body, {**json_cross, "Origin": "null"})[0] == 403
        assert [j["job_id"] for j in c.jobs()] == [victim] and c.status(victim)["status"] == "running"
        # the server's own page (same origin) and the command line (no Origin) still act
        status, _ = raw(srv.url, "POST", f"/jobs/{victim}/cancel", b"{}", {"Content-Type": "application/json",
                        "Origin": srv.url, "Sec-Fetch-Site": "same-origin"})  # fmt: skip
        assert status == 200 and c.status(victim)["status"] == "cancelled"
        assert c.submit(tmp_path / "job.yaml")["status"] == "queued"


def test_a_rebound_name_gets_nothing_but_the_servers_own_names_work(tmp_path: Path) -> None:
    """DNS rebinding: a page at http://evil.example:PORT whose name now resolves to 127.0.0.1 reads and acts as
    same-origin; its requests carry its own name as Host. Refused (421), reads included."""
    with serving(tmp_path) as srv:
        port = srv.url.rsplit(":", 1)[1]
        for path in ("/jobs", "/cluster", "/health", "/metrics", "/"):
            status, answer = raw(srv.url, "GET", path, headers={"Host": f"evil.example:{port}"})
            assert status == 421 and "evil.example" in answer["problems"][0]["message"], (path, status, answer)
        body = json.dumps({"yaml": job_text()}).encode()
        rebound = {"Host": f"evil.example:{port}", "Content-Type": "application/json",
                   "Origin": f"http://evil.example:{port}"}  # fmt: skip
        assert raw(srv.url, "POST", "/jobs", body, rebound)[0] == 421
        assert Client(srv.url).jobs() == []
        for name in ("127.0.0.1", "localhost", "LOCALHOST", "[::1]"):
            assert raw(srv.url, "GET", "/health", headers={"Host": f"{name}:{port}"})[0] == 200, name
    with serving(tmp_path / "other", http={"allowed_hosts": ["plexrl.internal"]}) as srv:
        port = srv.url.rsplit(":", 1)[1]
        assert raw(srv.url, "GET", "/health", headers={"Host": f"plexrl.internal:{port}"})[0] == 200
        assert raw(srv.url, "GET", "/health", headers={"Host": f"127.0.0.1:{port}"})[0] == 421


def test_the_tinker_sdks_protobuf_bodies_pass_the_guard(tmp_path: Path) -> None:
    """The guard is app-wide: a non-JSON type a page cannot send without a preflight (the Tinker SDK's protobuf)
    reaches the route (which answers for itself: 404 without the Tinker API, its own 400 for this body with
    it), where a form type does not."""
    with serving(tmp_path) as srv:
        proto = {"Content-Type": "application/x-protobuf"}
        assert raw(srv.url, "POST", "/api/v1/forward_backward", b"\x00", proto)[0] in (400, 404)
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        assert raw(srv.url, "POST", "/api/v1/forward_backward", b"a=b", form)[0] == 415
