"""The `plexrl` command line: run, validate and draw jobs. User errors print a clear message, no traceback."""

from __future__ import annotations

import json
import logging
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
    from plexrl.config import load_job

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
        typer.Option("--progress/--no-progress", help="Progress bar (default: tracking.progress on a TTY)."),
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Log at INFO level.")] = False,
    scheduler: Annotated[
        str | None, typer.Option("--scheduler", help="Cluster configs: run on this Dask scheduler address.")
    ] = None,
) -> None:
    """Run a job, or a cluster config (a YAML with `jobs:`) of many jobs on shared services; track them in
    MLflow; print the summary (and, for a cluster, the accounting table)."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    from plexrl.cluster import is_cluster_file

    if is_cluster_file(config):
        assert config is not None
        _run_cluster(config, (set_ or []) + ([f"scheduler={scheduler}"] if scheduler else []), progress)
        return
    try:
        loaded = _load(config, set_)
        from plexrl.runtime.jobs import run_jobs

        if progress is None:
            progress = loaded.config.tracking.progress and sys.stderr.isatty()
        jobs = run_jobs([loaded], progress=progress)
    except (PlexRLError, FileNotFoundError, ValueError) as exc:
        _fail(exc)
        return
    except KeyboardInterrupt:
        typer.secho("interrupted; finished iterations stay recorded in MLflow", fg="red", err=True)
        raise typer.Exit(130) from None
    raise typer.Exit(_summarise(jobs))


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


def _run_cluster(config: Path, overrides: list[str], progress: bool | None) -> None:
    from plexrl.accounting import format_report
    from plexrl.cluster import load_cluster, run_cluster

    try:
        loaded = load_cluster(config, overrides)
        if progress is None:
            progress = loaded.config.progress and sys.stderr.isatty()
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
    raise typer.Exit(code)


@app.command()
def validate(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Check a job or cluster config and its pipelines; report every problem at once."""
    from plexrl.cluster import is_cluster_file

    if is_cluster_file(config):
        from plexrl.cluster import load_cluster

        assert config is not None
        try:
            cluster = load_cluster(config, set_ or [])
        except PlexRLError as exc:
            _fail(exc)
            return
        c = cluster.config
        typer.echo(
            f"{config}: OK — {len(cluster.jobs)} jobs on {c.services.count} service(s), "
            f"placement {c.placement}, ordering {c.ordering}, driver {c.driver}"
        )
        for job in cluster.jobs:
            typer.echo(f"  {job.config.name:<24} pipeline {job.graph.name!r} ({len(job.graph.order)} nodes)")
        return
    try:
        loaded = _load(config, set_)
    except PlexRLError as exc:
        _fail(exc)
        return
    typer.echo(f"{loaded.source}: OK — pipeline {loaded.graph.name!r} with {len(loaded.graph.order)} nodes")
    for node in loaded.graph.describe():
        typer.echo(f"  {node['name']:<12} {node['placement']:<8} {node['op']}  inputs={json.dumps(node['inputs'])}")


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
    import yaml

    from plexrl.sim.config import load_sim
    from plexrl.sim.report import simulate as run_sim

    try:
        overrides = {}
        for item in set_ or []:
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise ValueError(f"--set {item!r}: write FIELD=VALUE, e.g. --set jobs=100")
            overrides[key] = yaml.safe_load(value)
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
