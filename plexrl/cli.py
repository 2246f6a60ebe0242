"""The `plexrl` command line: run, validate and draw jobs. User errors print a clear message, no traceback."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from plexrl.errors import PlexRLError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="PlexRL: RLVR jobs as operator DAGs, run by one global planner on shared LLM services.",
)

ConfigArg = Annotated[
    Path | None, typer.Argument(help="Job YAML. Omit to use the embedded defaults (GRPO on 3-digit addition).")
]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a field: --set iterations=10 (repeatable).")]


def _load(config: Path | None, overrides: list[str] | None):  # type: ignore[no-untyped-def]
    from plexrl.job.load import load_job

    return load_job(config, overrides or [])


def _fail(exc: BaseException, code: int = 2) -> None:
    typer.secho(str(exc), fg="red", err=True)
    raise typer.Exit(code)


@app.command()
def run(
    config: ConfigArg = None,
    set_: SetOpt = None,
    progress: Annotated[
        bool | None,
        typer.Option(
            "--progress/--no-progress",
            help="Progress (default: tracking.progress): a bar on a terminal, else a line per job every 30 s.",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Log at INFO level.")] = False,
    scheduler: Annotated[
        str | None, typer.Option("--scheduler", help="Cluster configs: run on this Dask scheduler address.")
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help="A job: where it runs: auto (the first GPU when there is one, else cpu; the default), cpu, cuda, "
            "cuda:N. A cluster config names its own (services.device).",
        ),
    ] = None,
    deterministic: Annotated[
        bool, typer.Option("--deterministic", help="A job on CUDA: deterministic kernels (slower; docs/gpu.md).")
    ] = False,
) -> None:
    """Run a job, or a cluster config (a YAML with `jobs:`) of many jobs on shared services; track them in
    MLflow; print the summary (and, for a cluster, the accounting table)."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    from plexrl.server.signals import sigterm_stops_runs

    sigterm_stops_runs()  # SIGTERM: a graceful stop that closes every MLflow run (KILLED); see the module
    from plexrl.config_kinds import read_config, runnable

    try:
        file = read_config(config)  # the one parse and the one kind detector, `plexrl validate`'s too
        runnable(file)
    except PlexRLError as exc:
        _fail(exc)
        return
    if file.kind == "cluster":
        assert config is not None
        if device is not None or deterministic:
            _fail(ValueError("a cluster config names its device: set services.device (and services.deterministic)"))
        _run_cluster(file, (set_ or []) + ([f"scheduler={scheduler}"] if scheduler else []), progress)
        return
    try:
        from plexrl.devices import resolve_device, visible_gpus
        from plexrl.job.load import load_job
        from plexrl.runtime.jobs import run_jobs

        loaded = load_job(config, set_ or [], parsed=file.raw)

        if progress is None:
            progress = loaded.config.tracking.progress
        where = resolve_device(device or "auto", visible_gpus())
        jobs = run_jobs([loaded], progress=progress, device=where, deterministic=deterministic)
    except (PlexRLError, FileNotFoundError, ValueError) as exc:
        _fail(exc)
        return
    except KeyboardInterrupt:
        typer.secho("interrupted; finished iterations stay recorded in MLflow", fg="red", err=True)
        raise typer.Exit(130) from None
    code = _summarise(jobs)
    raise typer.Exit(_after_sigterm(code))


def _after_sigterm(code: int) -> int:
    """Exit 130 (as after Ctrl-C) when the run was stopped by SIGTERM, else `code`."""
    from plexrl.server.signals import sigterm_received

    if not sigterm_received():
        return code
    typer.secho("interrupted by SIGTERM; open jobs were stopped, their MLflow runs closed (KILLED)", fg="red", err=True)
    return 130


def _summarise(jobs: list[Any]) -> int:
    failed = False
    for job in jobs:
        name = job.spec.eval_metric()
        accs = job.series(name) if name else []
        acc = f"held-out accuracy {accs[0]:.3f} -> {accs[-1]:.3f}; " if len(accs) > 1 else ""
        ran = "never started" if job.started_at is None else f"in {(job.finished_at or 0) - job.started_at:.1f}s"
        iters = job.iterations_done
        typer.echo(
            f"job {job.job_id}: {job.status}; {acc}{iters} iterations {ran} "
            f"(warm start {job.spec.warm_start.get('seconds', 0):.1f}s, cached={job.spec.warm_start.get('cached')})"
        )
        if job.tracking.get("uri"):
            typer.echo(f"  MLflow: {job.tracking['uri']} run {job.tracking.get('run_id')}")
        if job.status != "done":
            typer.secho(f"  error: {job.error}", fg="red", err=True)
            failed = True
    return 1 if failed else 0


def _run_cluster(file: Any, overrides: list[str], progress: bool | None) -> None:
    from plexrl.accounting import format_report
    from plexrl.cluster import load_cluster, run_cluster

    try:
        loaded = load_cluster(file.path, overrides, raw=file.raw)
        if progress is None:
            progress = loaded.config.progress
        result = run_cluster(loaded, progress=progress)
    except (PlexRLError, FileNotFoundError, ValueError) as exc:
        _fail(exc)
        return
    except KeyboardInterrupt:
        typer.secho("interrupted; the jobs are marked KILLED in MLflow, finished iterations stay", fg="red", err=True)
        raise typer.Exit(130) from None
    code = _summarise(result.jobs)
    typer.echo(format_report(result.report))
    if result.timeline is not None:
        typer.echo(f"timeline: {result.timeline}")
    if result.tracking:
        typer.echo(f"cluster MLflow run: {result.tracking['uri']} run {result.tracking['run_id']}")
    raise typer.Exit(_after_sigterm(code))


@app.command()
def validate(
    config: ConfigArg = None,
    set_: SetOpt = None,
    server: Annotated[
        Path | None,
        typer.Option("--server", help="A server config whose size limits a job is checked against (default: "
                     "plexrl serve's defaults)."),
    ] = None,
) -> None:  # fmt: skip
    """Check any config (job, cluster, server, simulator scenario or trace, profiles): detect its kind (its
    `kind:` or its keys), validate it with that kind's model, report every problem at once. A job is also held
    to the size limits a server checks at submission (its KV cache, memory, parameters, ...)."""
    from plexrl.config_kinds import check_config

    try:
        checked = check_config(config, set_ or [], server)
    except PlexRLError as exc:
        _fail(exc)
        return
    first, *rest = checked.lines
    typer.echo(f"{config or 'defaults'}: OK, a {checked.kind} config ({checked.why}) — {first}")
    for line in rest:
        typer.echo(line)


@app.command()
def graph(
    config: ConfigArg = None,
    set_: SetOpt = None,
    out: Annotated[Path, typer.Option("-o", "--out", help="PNG file to write.")] = Path("pipeline.png"),
) -> None:
    """Draw the job's pipeline DAG to a PNG."""
    try:
        loaded = _load(config, set_)
    except PlexRLError as exc:
        _fail(exc)
        return
    from plexrl.viz import draw_pipeline

    draw_pipeline(loaded.graph, out)
    typer.echo(f"wrote {out}")


@app.command()
def simulate(
    config: Annotated[Path, typer.Argument(help="A scenario or trace YAML under configs/sim/.")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a top-level field: --set jobs=100 (repeatable).")
    ] = None,
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Reports go to RUN_DIR/simulate/NAME/.")] = Path("runs"),
    mlflow: Annotated[bool, typer.Option("--mlflow/--no-mlflow", help="Log the results as an MLflow run.")] = True,
    progress: Annotated[bool | None, typer.Option("--progress/--no-progress", help="Progress bar.")] = None,
) -> None:
    """Predict what multiplexing saves on a cluster: deployments (scenario) or placements (trace), on the real
    planner with cost models (docs/simulator.md)."""
    from plexrl.sim.config import load_sim
    from plexrl.sim.report import simulate as run_sim
    from plexrl.yamlio import load_yaml_text

    try:
        overrides = {}
        for item in set_ or []:
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise ValueError(f"--set {item!r}: write FIELD=VALUE, e.g. --set jobs=100")
            overrides[key] = load_yaml_text(value, f"--set {item}")  # plain values only, like every config
        cfg = load_sim(config, overrides)
        if progress is None:
            progress = sys.stderr.isatty()
        if progress:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            with Progress(
                SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True
            ) as bar:
                task = bar.add_task("simulating", total=None)
                rep = run_sim(cfg, run_dir, lambda msg: bar.update(task, description=msg), track=mlflow)
        else:
            rep = run_sim(cfg, run_dir, track=mlflow)
    except (PlexRLError, FileNotFoundError, ValueError) as exc:
        _fail(exc)
        return
    typer.echo(rep.text)
    typer.echo(f"simulated in {rep.wall_s:.1f} s; report: {rep.out_dir}/report.txt, picture: {rep.files[0]}")
    if rep.tracking:
        typer.echo(f"MLflow run: {rep.tracking['uri']} run {rep.tracking['run_id']}")


# -- the server and its clients (plexrl/server/) ---------------------------------------------------------
ServerOpt = Annotated[
    str | None, typer.Option("--server", help="Server URL (default: $PLEXRL_SERVER or http://127.0.0.1:8765).")
]
TokenOpt = Annotated[str | None, typer.Option("--token", help="Bearer token (default: $PLEXRL_TOKEN).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the server's JSON answer.")]


@app.command()
def serve(
    config: Annotated[Path | None, typer.Option("--config", help="Server YAML (docs/operations.md).")] = None,
    host: Annotated[str | None, typer.Option("--host", help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option("--port", help="TCP port (default 8765; 0: any free port).")] = None,
    scheduler: Annotated[
        str | None, typer.Option("--scheduler", help="Run nodes on this Dask scheduler (driver: dask).")
    ] = None,
    set_: SetOpt = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Log at INFO level.")] = False,
) -> None:
    """Run the PlexRL server: jobs are submitted, watched and cancelled over HTTP (`plexrl submit`, `status`,
    `list`, `cancel`, `logs`); every transition goes to a journal, and a restart on the same journal resumes
    unfinished jobs (from their latest checkpoint with `--set checkpoint_every=K`, else from scratch). SIGTERM
    or Ctrl-C stops it gracefully. Details: docs/operations.md."""
    import os

    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    from plexrl.server.api import start_server
    from plexrl.server.config import load_server_config
    from plexrl.server.journal import JournalError
    from plexrl.server.signals import stop_event

    overrides = list(set_ or [])
    overrides += [f"host={json.dumps(host)}"] if host is not None else []
    overrides += [f"port={port}"] if port is not None else []
    overrides += ["cluster.driver=dask", f"cluster.scheduler={json.dumps(scheduler)}"] if scheduler is not None else []
    try:
        cfg = load_server_config(config, overrides, token=os.environ.get("PLEXRL_TOKEN"))
        stop = stop_event()
        server = start_server(cfg)
    except (PlexRLError, JournalError, OSError, ValueError) as exc:  # JournalError: a held or unreadable journal
        _fail(exc)
        return
    resumed = len(server.controller.recovered)
    typer.echo(
        f"PlexRL server listening on {server.url} (journal {cfg.journal}; {resumed} unfinished job(s) resubmitted)"
    )
    while not stop.wait(0.5):
        if not server.controller.healthy:
            typer.secho(f"the runner failed: {server.controller.failure!r}; stopping", fg="red", err=True)
            break
    ok = server.stop()
    typer.echo("PlexRL server stopped" + ("" if ok else " (some threads did not end in time)"))
    raise typer.Exit(0 if ok and server.controller.failure is None else 1)


@app.command()
def certs(
    directory: Annotated[Path, typer.Argument(help="Where to write ca.pem, ca-key.pem, cert.pem and key.pem.")],
    host: Annotated[
        list[str] | None, typer.Option("--host", help="A name or address the certificate names (repeatable).")
    ] = None,
    days: Annotated[int, typer.Option("--days", min=1, help="Days the certificates are valid.")] = 365,
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing files.")] = False,
) -> None:
    """Make TLS files for the Dask cluster: a CA and one certificate it signed, which the scheduler, every
    worker and the PlexRL client present (set `dask_tls` in the server or cluster config). Copy ca.pem,
    cert.pem and key.pem to the cluster's machines; keep ca-key.pem elsewhere. Details: docs/operations.md."""
    from plexrl.runtime.tls import write_certs

    try:
        files = write_certs(directory, host or [], days, force)
    except OSError as exc:
        _fail(exc)
        return
    typer.echo(f"wrote {directory}/ca.pem, ca-key.pem (keep it off the cluster), cert.pem, key.pem; use:")
    typer.echo(f"  dask_tls: {{ca_file: {files.ca_file}, cert: {files.cert}, key: {files.key}}}")


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


@app.command()
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


@app.command()
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


@app.command("list")
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


@app.command()
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


@app.command()
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


@app.command()
def pretrained(
    name: Annotated[str, typer.Argument(help="A pretrained model's short name, e.g. smollm2-135m-instruct.")],
) -> None:
    """Convert a pretrained model shipped in a package (installed by `make setup`) into the local cache, once,
    and print its directory (plexrl/job/pretrained.py). A job names it as `model: {pretrained: NAME}`."""
    from plexrl.job.pretrained import pretrained_path

    try:
        typer.echo(str(pretrained_path(name)))
    except LookupError as exc:
        _fail(exc)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
