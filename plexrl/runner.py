"""Run validated jobs on the local driver with the standard hooks (timeline, progress, MLflow)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from plexrl.config import LoadedJob
from plexrl.hooks.base import Hook
from plexrl.job import JobHandle, prepare_job

log = logging.getLogger(__name__)


def configure_torch(threads: int | None) -> None:
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)


def run_jobs(loaded: list[LoadedJob], *, progress: bool | None = None, services: int = 1) -> list[JobHandle]:
    """Prepare each job (task, model, warm start; cached) and run them all to completion."""
    from plexrl.drivers.local import LocalDriver
    from plexrl.hooks.mlflow_hook import MlflowHook
    from plexrl.hooks.timeline import TimelineRecorder

    first = loaded[0].config
    configure_torch(first.threads)
    handles = [prepare_job(job) for job in loaded]
    hooks: list[Hook] = [TimelineRecorder(Path(first.run_dir).resolve() / "timelines")]
    show = first.tracking.progress if progress is None else progress
    if show:
        from plexrl.hooks.progress import ProgressBar

        hooks.append(ProgressBar())
    if any(job.config.tracking.mlflow for job in loaded):
        hooks.append(MlflowHook())
    return LocalDriver(services=services, hooks=hooks).run(handles)
