"""Entry points shared by `plexrl run JOB.yaml` and cluster runs: the standard hooks, and running validated
jobs in-process."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from plexrl.hooks.base import Hook
from plexrl.job.load import LoadedJob
from plexrl.job.spec import JobRun, prepare_job

log = logging.getLogger(__name__)


def configure_torch(threads: int | None) -> None:
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)


def standard_hooks(
    run_dir: Path, *, progress: bool, mlflow: bool, required_timeline: bool = False, keep_ended: bool = True
) -> list[Hook]:
    """The timeline (first: the accounting reads it; `keep_ended` False: it drops an ended job's spans once
    written, as a long-running server must), a progress bar, per-job MLflow runs."""
    from plexrl.hooks.timeline import TimelineRecorder

    hooks: list[Hook] = [TimelineRecorder(run_dir / "timelines", required=required_timeline, keep_ended=keep_ended)]
    if progress:
        from plexrl.hooks.progress import ProgressBar

        hooks.append(ProgressBar())
    if mlflow:
        from plexrl.hooks.mlflow_hook import MlflowHook

        hooks.append(MlflowHook())
    return hooks


def run_jobs(loaded: list[LoadedJob], *, progress: bool | None = None, services: int = 1) -> list[JobRun]:
    """Prepare each job (task, model, warm start; cached) and run them all to completion, in this process, on
    the one runner builder's defaults (`runtime.build.build_runner`, as a cluster config's)."""
    from plexrl.runtime.build import build_runner
    from plexrl.runtime.inline import InlineExecutor

    first = loaded[0].config
    configure_torch(first.threads)
    specs = [prepare_job(job) for job in loaded]
    show = first.tracking.progress if progress is None else progress
    hooks = standard_hooks(
        Path(first.run_dir).resolve(), progress=show, mlflow=any(j.config.tracking.mlflow for j in loaded)
    )
    return build_runner(InlineExecutor(services=services), hooks).run(specs)
