"""What a test session must not leave behind: processes it started (children, grandchildren, and daemons that
left its process tree, such as slurmd or munged) and open Tinker SDK clients (their heartbeat goes on after the
server is gone, printing "Session heartbeat failed").

`mark()` tags the environment that every process this session starts inherits; `leftovers(since)` finds the
processes alive with that tag or under this process (waiting up to `grace_s` for those already ending), and
`open_tinker_clients()` the SDK clients never closed. `end(procs)` kills what was found, so a failed run does
not leave it running either. Used by the session fixture in tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from typing import Any

import psutil

MARK = "PLEXRL_TEST_SESSION"
# Helpers of the standard library that live as long as this process and end with it (they are not a test's).
KEPT = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def mark() -> None:
    """Tag this session's environment with its pid (a nested session tags its own)."""
    os.environ[MARK] = str(os.getpid())


def _ours(proc: psutil.Process, me: int, since: float) -> bool:
    if proc.pid == me or proc.status() == psutil.STATUS_ZOMBIE or proc.create_time() < since:
        return False
    if any(kept in " ".join(proc.cmdline()) for kept in KEPT):
        return False
    with contextlib.suppress(psutil.AccessDenied):
        if proc.environ().get(MARK) == str(me):
            return True
    return any(parent.pid == me for parent in proc.parents())


def _scan(me: int, since: float) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if _ours(proc, me, since):
                found.append(proc)
    return found


def leftovers(since: float, grace_s: float = 15.0) -> list[psutil.Process]:
    """Processes this session started (created after `since`) that are still alive after `grace_s` seconds. Those
    found are waited on (`psutil.wait_procs` returns as soon as they have all ended), then looked for again: one
    may have started another while ending, or become a zombie (not counted), which a wait would not see end."""
    me = os.getpid()
    deadline = time.monotonic() + grace_s
    while (found := _scan(me, since)) and (left := deadline - time.monotonic()) > 0:
        psutil.wait_procs(found, timeout=min(left, 1.0))
    return found


def describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} ({proc.name()}): {' '.join(proc.cmdline())[:160]}"
    except psutil.Error:
        return f"pid {proc.pid} (gone)"


def end(procs: list[psutil.Process]) -> None:
    """Kill `procs` (they were reported first) and wait a little for them."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=5)


def open_tinker_clients() -> list[Any]:
    """The Tinker SDK's client holders (one per ServiceClient that made a call) never closed."""
    if "tinker" not in sys.modules:
        return []
    from tinker.lib.internal_client_holder import InternalClientHolder

    gc.collect()
    holders = [o for o in gc.get_objects() if InternalClientHolder in type(o).__mro__]  # no isinstance: it runs hooks
    # (a session-less holder, what `tinker.RestClient(base_url=..., api_key=...)` runs over, has no session and no
    # heartbeat: the SDK keeps it for the process and says it needs no closing)
    return [h for h in holders if getattr(h, "_closed", True) is False and getattr(h, "_session_id", "") is not None]


def check(since: float) -> str | None:
    """What this session left behind (ended here), as a message naming the fix; None if nothing."""
    problems = []
    procs = leftovers(since)
    if procs:
        problems.append(
            f"{len(procs)} process(es) started by the tests are still running (stop each in the test or fixture "
            "that started it):\n  " + "\n  ".join(describe(p) for p in procs)
        )
        end(procs)
    clients = open_tinker_clients()
    if clients:
        urls = sorted({str(getattr(c, "_base_url", "?")) for c in clients})
        problems.append(
            f"{len(clients)} Tinker SDK client(s) were left open (on {', '.join(urls)}): their heartbeat outlives the "
            'server; close each ServiceClient (`service.close("success").result()`, or `with tinker.ServiceClient('
            "...) as service:`)"
        )
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()
    return "\n".join(problems) or None
