"""The `plexrl` command line: run, validate and draw jobs. User errors print a clear message, no traceback."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from plexrl.errors import PlexRLError
from plexrl.server.commands import SetOpt
from plexrl.server.commands import register as register_client_commands

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="PlexRL: RLVR jobs as operator DAGs, run by one global planner on shared LLM services.",
)

ConfigArg = Annotated[
    Path | None, typer.Argument(help="Job YAML. Omit to use the embedded defaults (GRPO on 3-digit addition).")
]


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


register_client_commands(app)  # submit, status, list, cancel, logs: plexrl/server/commands.py


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
