"""Pinning a local cluster's processes to cores: each service worker on cores of its own, the CPU pool on
the rest, so that verifiers, tool sandboxes and tokenisation on the CPU pool do not slow the "accelerator".

On a real node the host CPUs and the accelerators are separate devices; on a CPU-only test machine the
service's torch threads ARE the accelerator, and without pinning they share cores with the CPU pool's work,
which then slows every service node (on 2 cores, a tool job's sandbox processes halved the service's speed).
`core_plan` decides who gets which cores (pure); `pin_process` applies a set of cores to every thread of
the calling process (threads started later inherit it; processes it starts, such as sandboxes, too).

What it does NOT do: pin the controller process (the runner's loop), or pin anything on a cluster this
process did not start (`scheduler:` set).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def core_plan(cores: list[int], services: int, per_service: int = 1) -> tuple[list[list[int]], list[int]] | None:
    """`(cores of each service, cores of the CPU pool)`: `per_service` cores per service from the front of
    `cores`, the rest for the pool; None when that leaves the pool no core (then nothing is pinned).

    >>> core_plan([0, 1], 1)
    ([[0]], [1])
    >>> core_plan([0, 1, 2, 3], 2)
    ([[0], [1]], [2, 3])
    >>> core_plan([0, 1], 2) is None
    True
    """
    need = services * per_service
    if len(cores) <= need:
        return None
    return [cores[i * per_service : (i + 1) * per_service] for i in range(services)], cores[need:]


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pin_process(cores: list[int]) -> list[int]:
    """Restrict every thread of this process to `cores`; returns the process's affinity afterwards."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            continue
    return sorted(os.sched_getaffinity(0))


def process_cores() -> list[int]:
    """The calling thread's cores (what a worker reports in the tests)."""
    return sorted(os.sched_getaffinity(0))


__all__ = ["available_cores", "core_plan", "pin_process", "process_cores"]
