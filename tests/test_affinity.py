"""Pinning a local cluster: each service worker on a core of its own, the CPU pool on the rest."""

from __future__ import annotations

import doctest
import os
import threading

import plexrl.runtime.affinity as affinity


def test_core_plan_doctests() -> None:
    result = doctest.testmod(affinity)
    assert result.attempted >= 3 and result.failed == 0
    assert affinity.core_plan([3, 5, 7], 1, per_service=2) == ([[3, 5]], [7])


def _cores_of_a_new_thread() -> list[int]:
    """Cores of a thread started now (torch's pool and a sandbox's launcher start later than the pinning)."""
    out: list[int] = []
    t = threading.Thread(target=lambda: out.extend(affinity.process_cores()))
    t.start()
    t.join(10)
    return out


def test_a_local_cluster_pins_its_service_and_cpu_pool_apart() -> None:
    from plexrl.runtime.dask import DaskExecutor

    ex = DaskExecutor(services=1, cpu_threads=1, pin_cores=True)
    try:
        ex.start()
        cores = sorted(os.sched_getaffinity(0))
        service, cpu = ex.worker_of["service-0"], ex.cpu_workers[0]
        seen = ex.client.run(_cores_of_a_new_thread)
        if len(cores) < 2:  # no core to spare for the CPU pool: nothing pinned
            assert ex.pinned == {} and seen[service] == seen[cpu] == cores
        else:
            assert ex.pinned == {service: cores[:1], cpu: cores[1:]}
            assert seen[service] == cores[:1] and seen[cpu] == cores[1:]
        assert sorted(os.sched_getaffinity(0)) == cores  # the controller itself is left alone
    finally:
        ex.close()
