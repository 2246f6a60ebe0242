"""A thin HTTP client of `plexrl serve` (stdlib urllib), used by `plexrl submit | status | list | cancel | logs`.
The server's address comes from `--server`, else PLEXRL_SERVER, else http://127.0.0.1:8765; the token from
`--token`, else PLEXRL_TOKEN. Errors are `ServerError`s whose text names every problem the server reported."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from plexrl.errors import PlexRLError

DEFAULT_URL = "http://127.0.0.1:8765"


class ServerError(PlexRLError):
    """The server refused a request (`status`: its HTTP status; 0: no server answered)."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = (url or os.environ.get("PLEXRL_SERVER") or DEFAULT_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("PLEXRL_TOKEN")
        self.timeout = timeout

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One request; the decoded JSON answer. Raises ServerError on any non-2xx answer or no answer."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None or method not in ("GET", "HEAD"):  # (the server refuses another type: guard.py)
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise ServerError(exc.code, _explain(exc.code, exc.read())) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerError(0, f"no PlexRL server at {self.url} ({reason}); start one with `plexrl serve`") from None

    def submit(self, path: Path, overrides: list[str] | None = None, user: str = "") -> dict[str, Any]:
        """Send a job YAML (read here, within the server's size limits) with `--set` overrides."""
        text = Path(path).read_text(encoding="utf-8")
        body = {"yaml": text, "set": list(overrides or []), "user": user or os.environ.get("USER", "")}
        answer: dict[str, Any] = self.request("POST", "/jobs", body)
        return answer

    def status(self, job_id: str) -> dict[str, Any]:
        answer: dict[str, Any] = self.request("GET", f"/jobs/{urllib.parse.quote(job_id, safe='')}")
        return answer

    def jobs(self, status: str | None = None) -> list[dict[str, Any]]:
        query = f"?status={urllib.parse.quote(status)}" if status else ""
        answer: list[dict[str, Any]] = self.request("GET", f"/jobs{query}")["jobs"]
        return answer

    def cancel(self, job_id: str) -> dict[str, Any]:
        answer: dict[str, Any] = self.request("POST", f"/jobs/{urllib.parse.quote(job_id, safe='')}/cancel")
        return answer

    def events(self, job_id: str, after: int = 0) -> dict[str, Any]:
        answer: dict[str, Any] = self.request(
            "GET", f"/jobs/{urllib.parse.quote(job_id, safe='')}/events?after={after}"
        )
        return answer


def _explain(status: int, body: bytes) -> str:
    try:
        problems = json.loads(body)["problems"]
        lines = [f"  - {p['where']}: {p['message']}" if p.get("where") else f"  - {p['message']}" for p in problems]
    except (ValueError, KeyError, TypeError):
        lines = [f"  {body[:2000].decode(errors='replace')}"]
    return "\n".join([f"the server refused the request (HTTP {status}):", *lines])


__all__ = ["DEFAULT_URL", "Client", "ServerError"]
