"""What the `DaskExecutor` runs inside the Dask workers: a service's start, the job loads, the node tasks,
co-scheduled rollout cohorts, saves, checkpoints, releases and the stop. A worker's `Service` lives in the
worker's registry (`plexrl.services.registry.SERVICES`, one per executor token and service id), so a job's
state stays resident in that worker process between tasks. A node task publishes its small `NodeReport` as a Dask event
before it returns (`registry.publish`); its return value stays on the worker as the node's output."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plexrl.planner.state import Move, Tier
from plexrl.reports import CheckpointReport, LoadReport, NodeReport
from plexrl.services.registry import SERVICES as _SERVICES
from plexrl.services.registry import publish as _publish
from plexrl.services.service import NodeResult, Service, run_cpu_node


def _start_service(
    key: str, device: str, validate: bool, spill_dir: str | None, threads: int | None, host_memory: int | None = None
) -> int:
    """Create the service `key` (`<executor token>/<service id>`: two runs on one cluster never share one)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    if key in _SERVICES:
        raise RuntimeError(f"service {key} already runs in this worker")
    service_id = key.rpartition("/")[2]
    _SERVICES[key] = Service(
        service_id, device, spill_dir=spill_dir, validate=validate, clock=time.time, host_memory=host_memory
    )
    return os.getpid()


def _warm_up() -> None:
    """Import what every node needs once per worker, at cluster start, not inside a job's first node."""
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    import plexrl.engines.torch_engine  # noqa: F401
    from plexrl.operator import BUILTIN_OPERATORS, resolve_operator

    for name in BUILTIN_OPERATORS:  # the declared built-ins, resolved as a job names them (by role)
        resolve_operator(name)


def _start_and_warm(
    key: str, device: str, validate: bool, spill_dir: str | None, threads: int | None, host_memory: int | None = None
) -> int:
    """A replacement service on a worker that joined late: start it and import what nodes need."""
    pid = _start_service(key, device, validate, spill_dir, threads, host_memory)
    _warm_up()
    return pid


def _service(key: str) -> Service:
    try:
        return _SERVICES[key]
    except KeyError:
        raise RuntimeError(f"service {key} is not running in this worker (was the worker restarted?)") from None


def _load_job(key: str, spec: Any, tier: Tier) -> LoadReport:
    start = time.time()
    service_id = key.rpartition("/")[2]
    try:
        nbytes = _service(key).load_job(spec, tier)
    except Exception as exc:
        return LoadReport(spec.job_id, service_id, 0, start, time.time(), f"{type(exc).__name__}: {exc}")
    return LoadReport(spec.job_id, service_id, nbytes, start, time.time())


def _outputs(inputs: dict[str, NodeResult]) -> dict[str, Any]:
    return {port: res.output for port, res in inputs.items()}


def _run_service_node(
    topic: str,
    handle: int,
    key: str,
    job_id: str,
    iteration: int,
    node: str,
    inputs: dict[str, NodeResult],
    swaps: Sequence[Move],
    prefetch: Sequence[Move],
    chunk: int,
    chunks: int,
    parts: list[NodeResult],
    seq: int,
    call: Any,
    *after: Any,
) -> NodeResult:
    """`after`: futures this node must wait for (its job's load, the service's previous node); unused.
    `parts`: the earlier chunks' results of a chunked node's last chunk (made on this worker: no transfer).
    `seq`: the node's number among the service's tasks in the order they were sent (`Service.run_node`).
    `call`: a session's call that the node runs (None for a pipeline node)."""
    outs = [p.output for p in parts if p.output is not None]
    svc = _service(key)
    result = svc.run_node(job_id, iteration, node, _outputs(inputs), swaps, prefetch, chunk, chunks, outs, seq, call)
    _publish(topic, handle, result.report)
    return result


def _run_service_cohort(
    topic: str,
    handles: list[int],
    key: str,
    members: list[tuple[str, int, str, dict[str, NodeResult], Any]],
    loads: dict[str, LoadReport],
    swaps: Sequence[Move],
    prefetch: Sequence[Move],
    seq: int,
    *after: Any,
) -> list[NodeResult]:
    """Co-scheduled rollouts (`services.batched.run_cohort`): the members (job, iteration, node, inputs, a
    session's call or None), nodes of distinct jobs, in ONE engine call, taking one place (`seq`) in the
    service's order; publishes each member's report under its own handle and returns every member's result,
    in order (`_member` picks one out: that member's output). A member whose job's load failed (`loads`: the
    members' loads, or is not loaded here) is reported not run; the swaps still happen (the planner counts on
    them). Never raises: anything that fails comes back in the members' reports. `after`: the futures it must
    follow; unused."""
    from plexrl.services.batched import Member, run_cohort

    service_id = key.rpartition("/")[2]
    results: list[NodeResult | None] = [None] * len(members)
    try:
        svc = _service(key)
        run: list[int] = []
        for i, (job_id, iteration, node, *_) in enumerate(members):
            load = loads.get(job_id)
            why = load.error if load is not None and load.error else None
            if why is None and job_id not in svc.jobs:
                why = "it is not loaded there"
            if why is None:
                run.append(i)
                continue
            now = time.time()
            error = f"not run: loading the job on {service_id} failed ({why})"
            results[i] = NodeResult(NodeReport(job_id, iteration, node, error, now, now))
        if run:
            batch = [Member(*members[i][:3], _outputs(members[i][3]), members[i][4]) for i in run]
            for i, res in zip(run, run_cohort(svc, batch, swaps, prefetch, seq), strict=True):
                results[i] = res
        else:
            with svc.in_order(seq):
                svc.apply(swaps)
    except Exception as exc:  # (the members' own errors come back in their reports; this is anything else)
        now = time.time()
        error = f"{type(exc).__name__}: {exc}"
        for i, (job_id, iteration, node, *_) in enumerate(members):
            if results[i] is None:
                results[i] = NodeResult(NodeReport(job_id, iteration, node, error, now, now))
    out = [r for r in results if r is not None]
    for handle, res in zip(handles, out, strict=True):
        _publish(topic, handle, res.report)
    return out


def _member(results: list[NodeResult], i: int) -> NodeResult:
    """Member `i`'s result of a cohort (`_run_service_cohort`): its handle's future, its output kept here."""
    return results[i]


def _start_swaps(key: str, seq: int, swaps: Sequence[Move], *after: Any) -> str:
    """A lookahead node's swaps, started early on the service's background thread (`Service.start_early`).
    Runs on the service worker's second thread, NOT after the service's running node (no GPU slot, no
    chain); returns at once. `after`: the loads of the jobs it moves; unused."""
    return _service(key).start_early(seq, swaps)


def _run_cpu_node(
    topic: str, handle: int, spec: Any, iteration: int, node: str, inputs: dict[str, NodeResult], threads: int,
    limit_s: float | None = None,
) -> NodeResult:  # fmt: skip
    """`limit_s`: run it in a worker process of this worker, killed past that many seconds (runtime/cpu_nodes.py)."""
    import torch

    if not _SERVICES and torch.get_num_threads() != threads:  # never change a service worker's threads
        torch.set_num_threads(threads)
    if limit_s is not None:
        from plexrl.runtime.cpu_nodes import run_bounded

        result = run_bounded(spec, iteration, node, _outputs(inputs), time.time, limit_s)
    else:
        result = run_cpu_node(spec, iteration, node, _outputs(inputs), time.time)
    _publish(topic, handle, result.report)
    return result


def _save_model(key: str, job_id: str, path: str) -> str:
    return str(_service(key).save_model(job_id, Path(path)))


def _checkpoint(key: str, job_id: str, path: str, extra: dict[str, Any], seq: int, *after: Any) -> CheckpointReport:
    """`after`: the futures it must follow (the job's load, the service's previous task); unused. `seq`: its
    number among the service's tasks: no later node's early swaps start before it ends."""
    start, service_id = time.time(), key.rpartition("/")[2]
    try:
        svc = _service(key)
        with svc.in_order(seq):
            where = str(svc.checkpoint(job_id, Path(path), extra))
    except Exception as exc:
        return CheckpointReport(job_id, service_id, path, start, time.time(), f"{type(exc).__name__}: {exc}")
    return CheckpointReport(job_id, service_id, where, start, time.time())


def _release(key: str, job_id: str) -> None:
    if key in _SERVICES:
        _SERVICES[key].release(job_id)


def _stop_service(key: str) -> dict[str, Any]:
    svc = _SERVICES.pop(key, None)
    if svc is None:
        return {}
    report = svc.report()
    svc.close()
    return report
