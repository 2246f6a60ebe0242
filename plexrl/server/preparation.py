"""A job's preparation out of the server process: `prepare_isolated` runs the preparation (`entries.prepare_entry`:
the journalled config checked again, the task's data opened, indexed and cached, the model built or converted,
the warm start trained) first in a child process (`python -m plexrl.server._prepare_child`) with an address-space
limit (`RLIMIT_AS` = `limits.prepare_memory`) and a wall-clock limit (`limits.prepare_timeout_s`), killed, with
everything it started, when the job is cancelled or the server stops. Only when it succeeded does the server
process prepare the job itself, which then finds every expensive result in the caches the child wrote (the
model and warm start under `<run_dir>/cache`, the data's indexes and Arrow copies under its cache dir) and
loads them; what it still builds in memory (a generated task's problems, the tokenizer) is bounded by the job
limits checked at submission (`limits.py`). So a job whose preparation would exhaust memory, spin or hang fails
with the reason, and the server's memory never holds more than an accepted job's bounded size.

The child's answer is one JSON line on a descriptor of its own (what the preparation prints goes to stderr):
`{"ok": true}`, `{"problems": [[where, message], ...]}` (a `ConfigError`: the job's 400-style reasons) or
`{"error": "Type: message"}`. A `MemoryError` or a death by signal becomes a sentence naming
`limits.prepare_memory`. What this module does NOT do: sandbox the preparation (it runs the job's declared,
allowed code with the server's rights, as before), or limit the child's CPU or disk (its time limit bounds it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from plexrl.errors import ConfigError, Problem

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often the parent looks at the cancellation event while the child works
CHILD_OPTIONS = frozenset({"max_warm_start_steps", "modules", "device", "group", "files", "limits"})


class PreparationFailed(RuntimeError):
    """The preparation's process failed, ran out of its memory or time, or died (the message says which)."""


def prepare_isolated(
    entry: Any,
    cancel: threading.Event | None = None,
    *,
    prepare: Callable[..., Any],
    memory: int | None,
    timeout_s: float,
    **kwargs: Any,
) -> Any:
    """The job's spec (`prepare(entry, cancel=cancel, **kwargs)`: `entries.prepare_entry`), after the same
    preparation ran in a child process within `memory` bytes of address space and `timeout_s` seconds; see the
    module docstring. Raises `ConfigError` (the job's problems), `PreparationFailed`, or `PreparationCancelled`
    when `cancel` is set meanwhile (the child killed)."""
    from plexrl.job.models import PreparationCancelled

    if entry.config.get("kind", "job") == "job":  # (a Tinker session has nothing to build: no child)
        sent = {k: v for k, v in kwargs.items() if k in CHILD_OPTIONS}  # (a session's CallBoard stays here)
        run_child(entry, sent, memory, timeout_s, cancel)
        if cancel is not None and cancel.is_set():
            raise PreparationCancelled("the preparation was cancelled")
    return prepare(entry, cancel=cancel, **kwargs)


def run_child(
    entry: Any, kwargs: dict[str, Any], memory: int | None, timeout_s: float, cancel: threading.Event | None
) -> None:
    """Run the preparation of `entry` in a child process (see the module docstring); returns when it succeeded."""
    from plexrl.job.models import PreparationCancelled

    read, write = os.pipe()
    # the child sets its own RLIMIT_AS first thing (no preexec_fn in a threaded server); malloc's per-thread
    # arenas are address space too: two at most
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "PLEXRL_ANSWER_FD": str(write),
           "PLEXRL_PREPARE_MEMORY": str(memory or 0)}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "plexrl.server._prepare_child"], stdin=subprocess.PIPE, env=env, pass_fds=(write,),
        start_new_session=True,
    )  # fmt: skip
    os.close(write)
    try:
        assert proc.stdin is not None
        try:
            proc.stdin.write(pickle.dumps({"entry": entry, "kwargs": kwargs, "path": list(sys.path)}))
            proc.stdin.close()
        except OSError:
            pass  # (it died at once: its exit says why, below)
        deadline = time.monotonic() + timeout_s
        answer = b""
        while True:
            if cancel is not None and cancel.is_set():
                raise PreparationCancelled("the preparation was cancelled; its process was killed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise PreparationFailed(
                    f"the preparation took longer than this server's limit of {timeout_s:g} s "
                    "(limits.prepare_timeout_s); its process was killed"
                )
            ready, _, _ = select.select([read], [], [], min(POLL_S, left))
            if ready:
                chunk = os.read(read, 1 << 16)
                if not chunk:
                    break
                answer += chunk
                if len(answer) > 1 << 20:
                    break
        proc.wait()
        _verdict(answer, proc.returncode, memory, entry)
    finally:
        os.close(read)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _verdict(answer: bytes, code: int, memory: int | None, entry: Any) -> None:
    limit = f"limits.prepare_memory ({memory / 2**30:.3g} GiB)" if memory is not None else "its memory"
    try:
        got = json.loads(answer.decode("utf-8")) if answer else None
    except ValueError:
        got = None
    if isinstance(got, dict) and got.get("ok") is True:
        return
    if isinstance(got, dict) and isinstance(got.get("problems"), list):
        problems = [Problem(str(w), str(m)) for w, m in got["problems"]]
        raise ConfigError(problems, entry.job_id)
    if isinstance(got, dict) and isinstance(got.get("error"), str):
        if got["error"].startswith("MemoryError") or "allocate memory" in got["error"]:  # (torch's words)
            raise PreparationFailed(f"the preparation needed more memory than this server allows ({limit})")
        raise PreparationFailed(got["error"])
    why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    raise PreparationFailed(f"the preparation's process died ({why}); within {limit}?")


__all__ = ["PreparationFailed", "prepare_isolated", "run_child"]
