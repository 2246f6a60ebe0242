"""Decode-step preemption as the planner sees it: a sliced service node runs as slices (each a bounded number
of decode steps on the service); after each slice that ends before the node does (`NodeFinished(paused=True)`)
the node is `paused` and queued again on its job's service, where the ordering policy weighs its next slice
against the other jobs' queued nodes like any node. Pure helpers of `core.Planner`:

- `record_slice`: a slice's seconds add to the node's progress (`JobRecord.slices`); the cost model learns
  the whole node's seconds (every slice) when its last slice ends, so predictions stay per node;
- `node_rest`: what the ordering policy is told a queued node costs: the whole node's prediction, less what
  its slices so far took (at least the last slice's seconds: a node past its prediction runs one slice more);
- `paused_jobs`: the jobs whose paused generation (its KV cache) waits on a service. They stay RESIDENT:
  the planner never evicts them (nor prefetches over them) until the node's last slice ends, so the paused
  KV cache never moves between tiers (it is not part of the state the StateManager budgets). Another job's
  node runs between two slices only if its state fits on the device beside them;
- `violation`: the invariants (`Planner.validate`): a paused node is a service node of a placed job, with
  progress recorded, queued on the job's service, and its job's state is on device; progress is recorded
  only for nodes paused or running a later slice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from plexrl.planner.records import JobRecord, ServiceRecord, SliceProgress


def record_slice(job: JobRecord, node: str, seconds: float, paused: bool) -> float:
    """Count one finished run of `node` (a slice, or a whole node) that took `seconds`: a slice that paused adds
    to the node's progress, the run that ends the node clears it. Returns the node's seconds so far."""
    progress = job.slices.get(node)
    if progress is None:
        if not paused:
            return seconds  # an unsliced node (or a sliced one that finished within one slice)
        progress = job.slices[node] = SliceProgress()
    progress.slices += 1
    progress.seconds += seconds
    progress.last = seconds
    total = progress.seconds
    if not paused:
        del job.slices[node]
    return total


def slices_done(job: JobRecord, node: str) -> int:
    """How many slices of `node` have run this iteration (0: none paused)."""
    progress = job.slices.get(node)
    return progress.slices if progress is not None else 0


def node_rest(job: JobRecord, node: str, predict: Callable[[str, str], float]) -> float:
    """Predicted seconds of what is left of `node`: the whole node's prediction, less what its slices so far
    took, and at least as long as its last slice."""
    whole = predict(job.job_id, node)
    progress = job.slices.get(node)
    if progress is None:
        return whole
    return max(whole - progress.seconds, progress.last)


def paused_jobs(svc: ServiceRecord, jobs: Mapping[str, JobRecord]) -> set[str]:
    """The jobs on `svc` with a paused generation there (never evicted until its node's last slice ends)."""
    return {j for j in svc.jobs if jobs[j].slices}


def violation(jobs: Mapping[str, JobRecord], services: Mapping[str, ServiceRecord]) -> str | None:
    """The first broken invariant of paused nodes, described; None when all hold."""
    for job in jobs.values():
        if job.status != "running":
            continue
        for node, status in job.nodes.items():
            if status == "paused":
                if job.plan.nodes[node].runs_on != "service" or node not in job.slices:
                    return f"{job.job_id}/{node} paused without a slice recorded"
                svc = services[job.service] if job.service is not None else None
                if svc is None or not svc.state.on_device(job.job_id):
                    return f"{job.job_id}/{node} paused while its state is off device"
                if not any((q.job_id, q.iteration, q.node) == (job.job_id, job.iteration, node) for q in svc.queue):
                    return f"{job.job_id}/{node} paused but not queued on {job.service}"
        for node in job.slices:
            if job.nodes.get(node) not in ("paused", "running"):
                return f"{job.job_id}/{node}: slices recorded for a node {job.nodes.get(node)}"
    return None


__all__ = ["node_rest", "paused_jobs", "record_slice", "slices_done", "violation"]
