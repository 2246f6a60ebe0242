"""The command line's client commands of a running `plexrl serve` (`plexrl submit | status | list | cancel |
logs`), over the thin urllib client (`plexrl.server.client`). Registered on the `plexrl` app by
`plexrl.cli`; what a server sends back (a user's name, a failure reason) is printed with its control
characters escaped, so that it cannot rewrite the terminal."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from plexrl.errors import PlexRLError

SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a field: --set iterations=10 (repeatable).")]
ServerOpt = Annotated[
    str | None, typer.Option("--server", help="Server URL (default: $PLEXRL_SERVER or http://127.0.0.1:8765).")
]
TokenOpt = Annotated[str | None, typer.Option("--token", help="Bearer token (default: $PLEXRL_TOKEN).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the server's JSON answer.")]


def _client(server: str | None, token: str | None):  # type: ignore[no-untyped-def]
    from plexrl.server.client import Client

    return Client(server, token)


# C0 and C1 control characters (ESC, BEL, CR, ...), DEL, and the Unicode line separators and bidirectional
# marks and overrides: a server's strings (a user's name, a job's failure reason) must not move the cursor,
# clear or retitle the terminal, or reorder what is printed
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def _safe(text: Any, newlines: bool = False) -> str:
    """`text` with every control character written as an escape (`\\x1b`, `\\u202e`), so that it prints as
    what it is; `newlines`: keep line breaks (a multi-line error message)."""

    def escape(m: re.Match[str]) -> str:
        c = m.group()
        if newlines and c == "\n":
            return c
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"

    return _UNSAFE.sub(escape, str(text))


def _fail_remote(exc: BaseException) -> None:
    """`_fail` for a client command: the message carries the server's words, escaped."""
    typer.secho(_safe(exc, newlines=True), fg="red", err=True)
    raise typer.Exit(2)


def _job_line(j: dict[str, Any]) -> str:
    progress = _safe(f"{j['iterations_done']}/{j['iterations']}")
    job_id, status, where, user = (_safe(j.get(k) or "-") for k in ("job_id", "status", "service", "user"))
    return f"{job_id:<32} {status:<10} {progress:>9}  {where:<12} {user:<10} {_safe(j['reason'][:60])}"


def submit(
    config: Annotated[Path, typer.Argument(help="Job YAML.")],
    set_: SetOpt = None,
    user: Annotated[str, typer.Option("--user", help="Who submits (default: $USER).")] = "",
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Submit a job to a running server; prints its id. Every problem with the job is reported at once."""
    try:
        job = _client(server, token).submit(config, set_ or [], user)
    except (PlexRLError, OSError) as exc:
        _fail_remote(exc)
        return
    typer.echo(_safe(job["job_id"]))


def status(
    job: Annotated[str | None, typer.Argument(help="Job id (omit: every unfinished job).")] = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    json_: JsonOpt = False,
) -> None:
    """A job's status (or every unfinished job's): status, iterations done, service, attempt, MLflow run."""
    try:
        client = _client(server, token)
        rows = [client.status(job)] if job else client.jobs("running") + client.jobs("queued")
    except PlexRLError as exc:
        _fail_remote(exc)
        return
    if json_:
        typer.echo(json.dumps(rows[0] if job else rows, indent=1))
        return
    for j in rows:
        typer.echo(_job_line(j))
        if job:
            t = j["tracking"]
            typer.echo(_safe(f"  attempt {j['attempt']}; MLflow {t.get('uri', '-')} run {t.get('run_id', '-')}"))


def list_jobs(
    status_: Annotated[str | None, typer.Option("--status", help="Only jobs with this status.")] = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Every job the server knows (the most recent 1000), oldest first."""
    try:
        rows = _client(server, token).jobs(status_)
    except PlexRLError as exc:
        _fail_remote(exc)
        return
    if json_:
        typer.echo(json.dumps(rows, indent=1))
        return
    for j in rows:
        typer.echo(_job_line(j))


def cancel(
    job: Annotated[str, typer.Argument(help="Job id.")], server: ServerOpt = None, token: TokenOpt = None
) -> None:
    """Cancel a job (recorded at once; the job stops at its next node boundary). Its finished iterations stay."""
    try:
        j = _client(server, token).cancel(job)
    except PlexRLError as exc:
        _fail_remote(exc)
        return
    typer.echo(_job_line(j))


def logs(
    job: Annotated[str, typer.Argument(help="Job id.")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """A job's journal: submission, placement, every iteration's metrics, its end."""
    import time

    after = 0
    client = _client(server, token)
    while True:
        try:
            answer = client.events(job, after)
        except PlexRLError as exc:
            _fail_remote(exc)
            return
        for e in answer["events"]:
            after = e["seq"]
            data = e["data"]
            if e["kind"] == "iteration":
                m = data["metrics"]
                keys = [k for k in sorted(m) if not k.startswith("time/")][:8]
                shown = " ".join(f"{k}={m[k]:.4g}" for k in keys)
                typer.echo(_safe(f"[attempt {e['attempt']}] iteration {data['iteration']}: {shown}"))
            else:  # (json.dumps writes control characters as \u escapes already)
                typer.echo(_safe(f"[attempt {e['attempt']}] {e['kind']} {json.dumps(data)}"))
        if not follow or (answer["job"]["status"] in ("done", "failed", "cancelled") and not answer["events"]):
            return
        time.sleep(1.0)


def register(app: typer.Typer) -> None:
    """Add the client commands to `app`."""
    app.command()(submit)
    app.command()(status)
    app.command("list")(list_jobs)
    app.command()(cancel)
    app.command()(logs)
