"""A journalled job as the runner's spec: `prepare_entry` (a DAG job: validated again, task and warm-started model
built) and `prepare_session_entry` (a Tinker session: its `SessionSpec`), each resumed after the entry's
checkpoint when it has one.

The controller's preparation pool calls `prepare_entry` (`start_server` binds the server's options to it), and so
does the preparation's child process (`_prepare_child.py`, through `preparation.prepare_isolated`): this module
imports neither the HTTP app nor the controller, so the child loads only what a preparation needs.

What it does NOT do: journal anything, or decide when a job is prepared (the controller's pool does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from pathlib import Path
from typing import Any

from plexrl.errors import ConfigError, Problem
from plexrl.server.journal import JobEntry


def prepare_entry(
    entry: JobEntry,
    cancel: threading.Event | None = None,
    max_warm_start_steps: int | None = None,
    modules: list[str] | None = None,
    device: str = "cpu",
    group: bool = False,
    calls: Any = None,
    files: Any = None,
    limits: Any = None,
) -> Any:
    """The runner's spec of a journalled job: validated again, task and warm-started model built (cached);
    with a checkpoint, set to resume after it (same MLflow run). `cancel`: the controller's cancellation event
    (`plexrl.job.models.PreparationCancelled` soon after it is set); `max_warm_start_steps`: the server's cap
    (a ConfigError above it, before any work); `modules`: the server's allow-list, in force while the job is
    compiled and prepared (a journalled job is checked again: the owner may have narrowed the list since);
    `device` ("cpu" or "cuda") and `group` (services.ranks > 1): the services', whose defaults the job takes
    (`plexrl.devices.job_defaults`) and where its warm start trains; `files` (`ServerFiles`): the user's file
    policy, checked again on the journalled paths (the owner may have narrowed `allowed_roots` since) and in
    force wherever a file is opened; `limits` (`JobLimits`): the job's footprint checked again likewise. A
    session's entry (`kind: session`, written by the Tinker API only) becomes its `SessionSpec`
    (`prepare_session_entry`; `calls`: the runner's `CallBoard`)."""
    if entry.config.get("kind") == "session":
        return prepare_session_entry(entry, calls, cancel, device=device)

    from plexrl.job.load import load_job
    from plexrl.job.spec import prepare_job
    from plexrl.paths import check_tree, file_policy
    from plexrl.roles import allowed_modules

    policy = files.policy(entry.user) if files is not None else None
    with allowed_modules(modules) if modules is not None else contextlib.nullcontext(), file_policy(policy):
        if policy is not None:
            from plexrl.server.submissions import path_problems

            refused = path_problems(entry.config, policy)
            if refused:
                raise ConfigError(refused, entry.job_id)
        loaded = load_job(entry.config)
        if limits is not None:
            from plexrl.job.footprint import footprint
            from plexrl.server.limits import job_problems, reward_timeouts

            over = job_problems(footprint(loaded), limits, reward_timeouts(loaded.config.model_dump()))
            if over:
                raise ConfigError(over, entry.job_id)
        if loaded.config.model.path is not None:  # a library opens its files: each checked now
            check_tree(loaded.config.model.path, "model.path")
        from plexrl.job.devices import device_jobs, group_problems

        loaded = device_jobs(device, group, [loaded])[0]
        if group and group_problems(loaded.config):  # what a worker group would silently ignore
            raise ConfigError([Problem("model", why) for why in group_problems(loaded.config)], entry.job_id)
        warm = loaded.config.warm_start
        if max_warm_start_steps is not None and warm.enabled and warm.max_steps > max_warm_start_steps:
            why = f"{warm.max_steps} steps; this server allows at most {max_warm_start_steps} (max_warm_start_steps)"
            raise ConfigError([Problem("warm_start.max_steps", f"{why}: lower it")], entry.job_id)
        spec = dataclasses.replace(prepare_job(loaded, job_id=entry.job_id, cancel=cancel, device=device),
                                   user=entry.user)  # fmt: skip
    if entry.checkpoint is None or entry.checkpoint_iteration is None:
        return spec
    return dataclasses.replace(
        spec,
        first_iteration=entry.checkpoint_iteration + 1,
        resume_state=Path(entry.checkpoint),
        resume_run_id=entry.tracking.get("run_id"),
    )


def prepare_session_entry(
    entry: JobEntry, calls: Any = None, cancel: threading.Event | None = None, *, device: str = "cpu"
) -> Any:
    """The spec of a journalled session: its calls opened on the board first (a call may come before its job);
    resumed from its latest checkpoint; with the defaults of the services' `device` (`prepare_session`). A
    session placed before (a restart, its service lost) without a checkpoint resumes from scratch where the
    server checkpoints (its first weight change would have one, and its client is told of a change only once
    that is written); otherwise it fails: its client's state would be gone without a word."""
    from plexrl.sessions.spec import SessionConfig, prepare_session

    if calls is not None:
        calls.open(entry.job_id)
    cfg = SessionConfig.model_validate(entry.config)
    if entry.attempt > 1 and entry.checkpoint is None and not cfg.client.get("checkpoint_every"):
        raise RuntimeError(
            "the session was interrupted (the server restarted or its service was lost) and has no checkpoint "
            "(set the server's checkpoint_every); create a new training client from its last save_state"
        )
    after = entry.checkpoint_iteration
    return prepare_session(
        cfg, job_id=entry.job_id, user=entry.user, first_call=0 if after is None else after + 1,
        resume_state=None if entry.checkpoint is None else Path(entry.checkpoint),
        resume_run_id=entry.tracking.get("run_id") if entry.checkpoint is not None else None, cancel=cancel,
        device=device,
    )  # fmt: skip


__all__ = ["prepare_entry", "prepare_session_entry"]
