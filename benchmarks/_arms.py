"""What the multiplexing benchmarks print for each arm beyond cost and slowdowns, read from a run's timeline spans
(`plexrl.hooks.timeline.Span`) and its jobs' records: the llm-d / OpenRL figures, so that PlexRL and exclusive
time-slicing (`ordering: time-slicing`, the llm-d / OpenRL design on our executor) are compared on the same terms.

- hand-overs: on each service, two consecutive node spans of different jobs; the switch is the blocking swap
  seconds the second job's node waited for (its state in, the holder's out), and the gap is the wall time from
  the first node's end to the second's start (swaps, round trips, nothing running);
- per-phase queue wait: a phase is a run of one job's service nodes with no off-service work between (a node
  whose dependencies are all service nodes continues its phase); the wait is from the moment the phase's first
  node was ready (its dependencies' latest end; a source node: the end of the job's previous iteration) to
  the start of its swaps, or of the node when nothing moved;
- curves: a job's per-iteration metrics without the timing keys (what must be identical in every arm);
- moves: the sums of every state move's record over the services (`plexrl.services.records.summarize`: moves,
  bytes, copy calls, buffers made / reused, page faults, queued / copy / wait seconds, GB/s of the copying);
- idle by reason: each second a service ran nothing (no node, swap or load span on it, from the run's first
  span to its last), named by the off-service nodes of every job running then (`tools` for a tool round,
  `verify` for a remote verifier, ...; digits dropped), or `nothing running` (round trips, dispatch, the
  run's start and end).
"""

from __future__ import annotations

import itertools
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# the metrics that depend on the machine's speed, not on what was learned (tool and verifier waits too)
VOLATILE = ("time/", "tokens_per_s", "latency_s")


def curve(history: Sequence[Mapping[str, float]]) -> list[dict[str, float]]:
    """A job's metric rows without the timing keys."""
    return [{k: v for k, v in row.items() if not any(s in k for s in VOLATILE)} for row in history]


def same_curve(a: Sequence[Mapping[str, float]], b: Sequence[Mapping[str, float]]) -> bool:
    """Equal rows, key for key (NaN equals NaN)."""

    def same(x: float, y: float) -> bool:
        return x == y or (x != x and y != y)

    return len(a) == len(b) and all(
        ra.keys() == rb.keys() and all(same(ra[k], rb[k]) for k in ra) for ra, rb in zip(a, b, strict=True)
    )


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _service_nodes(spans: Iterable[Any], services: set[str]) -> list[Any]:
    return [s for s in spans if s.kind == "node" and s.lane in services]


def hand_overs(spans: Sequence[Any]) -> list[tuple[float, float]]:
    """(switch seconds, gap seconds) of every hand-over on every service (see the module docstring)."""
    swaps = [s for s in spans if s.kind == "swap"]
    services = {s.lane for s in swaps} | {s.lane for s in spans if s.kind == "node" and s.lane.startswith("service")}
    out = []
    for lane in sorted(services):
        nodes = sorted((s for s in _service_nodes(spans, {lane})), key=lambda s: s.start)
        mine = [s for s in swaps if s.lane == lane]
        for prev, cur in itertools.pairwise(nodes):
            if prev.job == cur.job:
                continue
            switch = sum(s.end - s.start for s in mine if s.job == cur.job and prev.end - 1e-6 <= s.start <= cur.start)
            out.append((switch, max(cur.start - prev.end, 0.0)))
    return out


def phase_waits(spans: Sequence[Any], plans: Mapping[str, Mapping[str, tuple[str, tuple[str, ...]]]]) -> list[float]:
    """Every phase's queue wait (see the module docstring). `plans`: job -> node -> (runs_on, deps)."""
    ends: dict[tuple[str, int, str], float] = {}
    starts: dict[tuple[str, int, str], float] = {}
    last: dict[tuple[str, int], float] = {}
    first: dict[str, float] = {}
    for s in spans:
        if s.kind != "node":
            continue
        key = (s.job, s.iteration, s.node)
        ends[key] = max(ends.get(key, s.end), s.end)  # a chunked node: its last chunk's end
        starts[key] = min(starts.get(key, s.start), s.start)
        last[(s.job, s.iteration)] = max(last.get((s.job, s.iteration), s.end), s.end)
        first[s.job] = min(first.get(s.job, s.start), s.start)
    swaps_by_job: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        if s.kind == "swap":
            swaps_by_job.setdefault(s.job, []).append((s.start, s.end))
    waits = []
    for (job, it, node), start in starts.items():
        plan = plans.get(job, {})
        runs_on, deps = plan.get(node, ("cpu", ()))
        if runs_on != "service" or it < 0:
            continue
        if deps and all(plan[d][0] == "service" for d in deps):
            continue  # it continues a phase
        if deps:
            ready = max((ends[(job, it, d)] for d in deps if (job, it, d) in ends), default=None)
        else:
            ready = last.get((job, it - 1), first.get(job))
        if ready is None:
            continue
        began = start
        for a, b in swaps_by_job.get(job, []):
            if ready - 1e-6 <= a and b <= start + 1e-6:
                began = min(began, a)
        waits.append(max(began - ready, 0.0))
    return waits


def move_totals(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """The services' move-record sums (`Service.report()["move_records"]`) added up, GB/s recomputed."""
    from plexrl.services.records import gbps

    out: dict[str, float] = {}
    for rep in reports.values():
        for key, value in rep.get("move_records", {}).items():
            out[key] = out.get(key, 0) + value
    if out:
        out["gbps"] = gbps(out.get("bytes", 0), out.get("copy_s", 0.0))
    return out


def switches(spans: Sequence[Any]) -> list[tuple[str, str, float]]:
    """(job handing over, job taking over, the second's node start) of every hand-over, on the spans' clock."""
    out = []
    for lane in sorted({s.lane for s in spans if s.kind == "node" and s.lane.startswith("service")}):
        nodes = sorted(_service_nodes(spans, {lane}), key=lambda s: s.start)
        out += [(a.job, b.job, b.start) for a, b in itertools.pairwise(nodes) if a.job != b.job]
    return out


def job_ends(spans: Sequence[Any]) -> dict[str, float]:
    """Each job's last span end, on the spans' clock."""
    out: dict[str, float] = {}
    for s in spans:
        out[s.job] = max(out.get(s.job, s.end), s.end)
    return out


def idle_reasons(spans: Sequence[Any]) -> dict[str, float]:
    """Seconds the services sat idle, summed over services, by what the jobs ran off the service meanwhile (see
    the module docstring)."""
    lanes = sorted({s.lane for s in spans if s.lane.startswith("service")})
    if not lanes:
        return {}
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    off = [(s.start, s.end, re.sub(r"\d+$", "", s.node)) for s in spans if s.kind == "node" and s.lane not in lanes]
    out: dict[str, float] = {}
    for lane in lanes:
        pieces, cur = [], t0
        for a, b in sorted((s.start, s.end) for s in spans if s.lane == lane and s.kind != "weights"):
            if a > cur:
                pieces.append((cur, a))
            cur = max(cur, b)
        if t1 > cur:
            pieces.append((cur, t1))
        for a, b in pieces:
            near = [o for o in off if o[0] < b and o[1] > a]
            cuts = sorted({a, b} | {x for o in near for x in o[:2] if a < x < b})
            for x, y in itertools.pairwise(cuts):
                mid = (x + y) / 2
                running = sorted({o[2] for o in near if o[0] <= mid < o[1]})
                reason = "+".join(running) if running else "nothing running"
                out[reason] = out.get(reason, 0.0) + y - x
    return out


def format_idle(idle: Mapping[str, float], top: int = 4) -> str:
    """`12.3 s: tools 8.1 s, verify 2.0 s, ...` (the `top` largest reasons, the rest as `other`)."""
    ranked = sorted(idle.items(), key=lambda kv: -kv[1])
    parts = [f"{k} {v:.1f} s" for k, v in ranked[:top]]
    if len(ranked) > top:
        parts.append(f"other {sum(v for _, v in ranked[top:]):.1f} s")
    return f"{sum(idle.values()):.1f} s: " + ", ".join(parts) if parts else "0.0 s"


def plans_of(runs: Iterable[Any]) -> dict[str, dict[str, tuple[str, tuple[str, ...]]]]:
    """job -> node -> (runs_on, deps) of finished runs (`JobRun.graph`)."""
    return {r.job_id: {n.name: (n.runs_on, tuple(r.graph.deps(n.name))) for n in r.graph.nodes} for r in runs}


__all__ = [
    "VOLATILE",
    "curve",
    "format_idle",
    "hand_overs",
    "idle_reasons",
    "job_ends",
    "median",
    "move_totals",
    "phase_waits",
    "plans_of",
    "same_curve",
    "switches",
]
