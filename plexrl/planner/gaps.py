"""How long a job will be away from the services after one of its nodes: the `gap` in gap-aware HRRS. Pure."""

from __future__ import annotations

import math
from collections.abc import Callable

from plexrl.planner.records import JobRecord


def gap_after(job: JobRecord, node: str, predict: Callable[[str, str], float]) -> float:
    """Predicted seconds from the end of `node` until `job` can next use a service: the shortest way along its
    cpu successors to a service node (`predict(job_id, node)` seconds per cpu node), and, past the iteration's
    last node, through the next iteration's leading cpu nodes (once). 0 if a service node follows at once, or
    if nothing follows at all."""
    plan, succ, job_id = job.plan.nodes, job.successors, job.job_id
    memo: dict[tuple[str, int], float] = {}

    def reach(name: str, depth: int) -> float:  # from the end of `name` to the next service node's start
        key = (name, depth)
        if key in memo:
            return memo[key]
        wrap = not succ[name]  # the iteration's end: on to the next iteration's sources (once)
        nxt = job.sources if wrap and depth == 0 else succ[name]
        best = math.inf
        for s in nxt:
            if plan[s].placement == "service":
                best = 0.0
                break
            best = min(best, predict(job_id, s) + reach(s, depth + wrap))
        memo[key] = best = best if best < math.inf else 0.0
        return best

    return reach(node, 0)
