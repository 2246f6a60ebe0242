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
    written, as a long-running server must), progress (a rich bar on a terminal, else a line per job every
    30 s: `plexrl.hooks.progress.progress_hook`), per-job MLflow runs."""
    from plexrl.hooks.timeline import TimelineRecorder

    hooks: list[Hook] = [TimelineRecorder(run_dir / "timelines", required=required_timeline, keep_ended=keep_ended)]
    if progress:
        from plexrl.hooks.progress import progress_hook

        hooks.append(progress_hook())
    if mlflow:
        from plexrl.hooks.mlflow_hook import MlflowHook

        hooks.append(MlflowHook())
    return hooks


def run_jobs(
    loaded: list[LoadedJob],
    *,
    progress: bool | None = None,
    services: int = 1,
    device: str = "cpu",
    deterministic: bool = False,
) -> list[JobRun]:
    """Prepare each job (task, model, warm start; cached) and run them all to completion, in this process, on
    the runtime section's defaults (`RuntimeConfig`, as a cluster config's) with the in-process driver.
    `device`: "cpu" or "cuda:N" (`plexrl.devices.resolve_device`): the jobs take its defaults (`job_defaults`:
    bfloat16 and sdpa on CUDA where they leave them unset), warm-start and train there (several services: one
    GPU each); `deterministic`: `plexrl.devices.configure_process`."""
    from plexrl.devices import configure_process, inline_devices, visible_gpus
    from plexrl.job.devices import device_jobs
    from plexrl.runtime.build import build_runner
    from plexrl.runtime.config import RuntimeConfig
    from plexrl.runtime.inline import InlineExecutor

    kind = "cuda" if device.startswith("cuda") else "cpu"
    configure_process(kind, deterministic)  # before CUDA starts here
    loaded = device_jobs(kind, False, loaded)
    first = loaded[0].config
    configure_torch(first.threads)
    specs = [prepare_job(job, device=device) for job in loaded]
    show = first.tracking.progress if progress is None else progress
    hooks = standard_hooks(
        Path(first.run_dir).resolve(), progress=show, mlflow=any(j.config.tracking.mlflow for j in loaded)
    )
    devices = [device] * services if services == 1 or kind == "cpu" else inline_devices(
        kind, services, None, visible_gpus()
    )  # fmt: skip
    section = RuntimeConfig.model_validate({"driver": "local"})
    return build_runner(section, hooks, InlineExecutor(services=services, devices=devices)).run(specs)
