"""How long a job will be away from the services: after one of its nodes (the `gap` in gap-aware HRRS), and
from now until each job on a service next needs it (what to evict, what to prefetch, whom to wait for); and
how far behind its solo pace a job will end (the `slowdown` ordering). Pure."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace

from plexrl.planner.policies import OrderingPolicy, OrderingView, QueuedNode
from plexrl.planner.records import JobRecord, ServiceRecord
from plexrl.planner.sessions import CLIENT
from plexrl.planner.sessions import busy_fraction as session_busy_fraction
from plexrl.planner.slices import node_rest


def gap_after(job: JobRecord, node: str, predict: Callable[[str, str], float]) -> float:
    """Predicted seconds from the end of `node` until `job` can next use a service: the shortest way along its
    cpu successors to a service node (`predict(job_id, node)` seconds per cpu node), and, past the iteration's
    last node, through the next iteration's leading cpu nodes (once). 0 if a service node follows at once, or
    if nothing follows at all. A session's: its client's time until the next call (`sessions.CLIENT`)."""
    if job.plan.open:
        return predict(job.job_id, CLIENT)
    return _reach(job, node, predict)[0]


def _reach(job: JobRecord, node: str, predict: Callable[[str, str], float]) -> tuple[float, str | None]:
    """`gap_after` of a DAG job's `node`, and the service node that way reaches (None: none follows)."""
    plan, succ, job_id = job.plan.nodes, job.successors, job.job_id
    memo: dict[tuple[str, int], tuple[float, str | None]] = {}

    def reach(name: str, depth: int) -> tuple[float, str | None]:  # from the end of `name` to the next service node
        key = (name, depth)
        if key in memo:
            return memo[key]
        wrap = not succ[name]  # the iteration's end: on to the next iteration's sources (once)
        nxt = job.sources if wrap and depth == 0 else succ[name]
        best: tuple[float, str | None] = (math.inf, None)
        for s in nxt:
            if plan[s].runs_on == "service":
                best = (0.0, s)
                break
            sec, at = reach(s, depth + wrap)
            if predict(job_id, s) + sec < best[0]:
                best = (predict(job_id, s) + sec, at)
        memo[key] = best = best if best[0] < math.inf else (0.0, None)
        return best

    return reach(node, 0)


def next_use(
    svc: ServiceRecord,
    jobs: dict[str, JobRecord],
    predict: Callable[[str, str], float],
    now: float,
    ordering: OrderingPolicy | None = None,
    view: OrderingView | None = None,
    limit: int = 64,
) -> dict[str, float]:
    """Predicted seconds until each job on `svc` next holds the service, for Belady's victim choice with
    predictions (the state needed furthest ahead leaves first, `StateManager`):
    - a job with a node running or sent there: its turn after that node (at the node's end plus the cpu path
      after it, `gap_after`, it joins the queue below; 0 when none follows). Such a job is pinned on device
      while its node runs, so this is what `StateManager.prefetch` weighs: whether to evict another state now
      or that one once its node has ended;
    - 0 with a checkpoint due (its next iteration follows) or in a cohort;
    - a queued job: when `ordering` (with `view`; without them, ready order) would start its first node, the
      service serving the queue from the end of the work sent to it, each node picked taking its predicted
      time plus its job's swap-in (once), a user's simulated seconds adding to its usage (fair share);
    - a job with CPU nodes in flight joins that queue when the first of them is predicted to end (`cpu_rests`:
      a retry's backoff counts) plus the cpu path after it (`gap_after`), at the service node it reaches;
    - inf with nothing in flight.
    Giving every queued job 0 made the job that had just run (out for a short CPU gap) the victim although the
    ordering would serve it before jobs queued behind others, and broke the ties among queued jobs by job id.
    At most `limit` picks are simulated; the jobs left get the time reached plus their ready-order wait."""
    soon = {q[0] for q in svc.checkpoints}  # (a checkpoint: its next iteration)
    for key in (svc.running, svc.next, svc.checkpointing, *svc.cohort, *svc.next_cohort):
        if key is not None:
            soon.add(key[0])
    out = dict.fromkeys(soon & svc.jobs, 0.0)
    t = now  # when the work sent to the service ends
    queued = {q.job_id for q in svc.queue}
    arrivals: list[tuple[float, str, str]] = []  # (when its next service node is ready, job, that node)
    for key, since in ((svc.running, svc.running_since), (svc.next, None)):
        if key is None or key[0] not in jobs:
            continue
        job, left = jobs[key[0]], node_rest(jobs[key[0]], key[2], predict)
        t += max(left - (now - since), 0.0) if since is not None else left
        if job.job_id in svc.jobs and job.job_id not in queued:  # its turn after this one: when it is back
            gap, at = (predict(job.job_id, CLIENT), next(iter(job.plan.nodes), None)) if job.plan.open else _reach(
                job, key[2], predict)  # fmt: skip
            away = _away(job, predict, now)  # (a cpu node of it in flight may end later)
            if at is not None:
                arrivals.append((max(t + gap, now + away[0] if away is not None else 0.0), job.job_id, at))
        out.pop(job.job_id, None)
    for job_id in svc.jobs - soon - queued:
        job = jobs[job_id]
        away = _away(job, predict, now)
        if away is None:
            out[job_id] = math.inf
        elif away[1] is None:
            out[job_id] = away[0]
        else:
            arrivals.append((now + away[0], job_id, away[1]))
    arrivals.sort()
    _serve(svc, jobs, predict, now, t, arrivals, ordering, view, limit, out)
    for key in (svc.running, svc.next):
        if key is not None and key[0] in svc.jobs:
            out.setdefault(key[0], 0.0)
    return out


class Lazy(Mapping[str, float]):
    """`next_use`, computed on the first read: most dispatches find their job on device with room to spare
    and never ask (the simulation costs up to `limit` ordering picks)."""

    __slots__ = ("_compute", "_value")

    def __init__(self, compute: Callable[[], dict[str, float]]) -> None:
        self._compute = compute
        self._value: dict[str, float] | None = None

    def _got(self) -> dict[str, float]:
        if self._value is None:
            self._value = self._compute()
        return self._value

    def __getitem__(self, job_id: str) -> float:
        return self._got()[job_id]

    def get(self, job_id: str, default: float | None = None) -> float | None:  # type: ignore[override]
        return self._got().get(job_id, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._got())

    def __len__(self) -> int:
        return len(self._got())


def _away(job: JobRecord, predict: Callable[[str, str], float], now: float) -> tuple[float, str | None] | None:
    """Seconds until a job with CPU nodes in flight has its next service node ready, and that node (None: none
    follows); None with nothing in flight."""
    job_id = job.job_id
    ends = [(predict(job_id, n) - (now - t0), n) for n, t0 in job.cpu_started.items()]
    ends += [(predict(job_id, n) + (t - now), n) for n, t in job.backoff.items()]
    if not ends:
        return None
    rest, node = min(ends)
    rest = max(rest, 0.0)
    if job.plan.open:  # a session: its next call, of a kind not known yet
        return rest, next(iter(job.plan.nodes), None)
    gap, at = _reach(job, node, predict)
    return rest + gap, at


def _serve(
    svc: ServiceRecord,
    jobs: dict[str, JobRecord],
    predict: Callable[[str, str], float],
    now: float,
    t: float,
    arrivals: list[tuple[float, str, str]],
    ordering: OrderingPolicy | None,
    view: OrderingView | None,
    limit: int,
    out: dict[str, float],
) -> None:
    """`next_use` of the queued and returning jobs: the service's picks simulated from `t` (into `out`)."""
    pending = [q for q in svc.queue if q.job_id in jobs]
    want = {q.job_id for q in pending} | {a[1] for a in arrivals}
    want -= out.keys()
    served: set[str] = set()
    extra: dict[str, float] = {}
    due: list[Mapping[str, float]] = []
    base = view
    views: dict[str | None, OrderingView] = {}  # one per resident job (usage reads `extra` as it grows)

    def usage(user: str) -> float:
        return base.usage(user) + extra.get(user, 0.0) if base is not None else 0.0

    def once() -> Mapping[str, float]:
        if not due and base is not None:
            due.append(base.due())
        return due[0]

    def sim_view(resident: str | None) -> OrderingView | None:
        if base is None:
            return None
        v = views.get(resident)
        if v is None:
            v = views[resident] = replace(base, resident=resident, usage=usage, due=once)
        return v

    def cost(q: QueuedNode) -> float:
        sec = base.service_time(q) if base is not None else node_rest(jobs[q.job_id], q.node, predict)
        if base is not None and q.job_id not in served:
            sec += base.swap_time(q.job_id)
        return sec

    resident = view.resident if view is not None else None
    seq = max((q.seq for q in pending), default=0)
    picks = 0
    while want and picks < limit and (pending or arrivals):
        while arrivals and (arrivals[0][0] <= t or not pending):
            at, job_id, node = arrivals.pop(0)
            seq += 1
            pending.append(QueuedNode(job_id, jobs[job_id].iteration, node, at, seq))
            t = max(t, at)
        i = -1
        v = sim_view(resident)
        if ordering is not None and v is not None:
            i = ordering.pick(pending, t, v)
        q = pending.pop(max(i, 0))  # (-1: the ordering would wait; the first ready stands in)
        if q.job_id in want:
            out[q.job_id] = t - now
            want.discard(q.job_id)
        sec = cost(q)
        if view is not None:
            user = view.user(q.job_id)
            extra[user] = extra.get(user, 0.0) + sec
        served.add(q.job_id)
        resident, t, picks = q.job_id, t + sec, picks + 1
    for q in sorted(pending, key=lambda q: (q.ready_at, q.seq)):  # past the limit: in ready order
        if q.job_id in want:
            out[q.job_id] = t - now
            want.discard(q.job_id)
        t += cost(q)
    for at, job_id, _ in arrivals:
        if job_id in want:
            out[job_id] = max(at, t) - now


def cpu_rests(job: JobRecord, predict: Callable[[str, str], float], now: float) -> list[float]:
    """Predicted seconds until each of the job's cpu nodes in flight ends (negative when overdue): a running
    one from its start; one in `backoff` (a retry) from the end of its backoff, which is still to come."""
    job_id = job.job_id
    rests = [predict(job_id, n) - (now - t0) for n, t0 in job.cpu_started.items()]
    rests += [predict(job_id, n) + (t - now) for n, t in job.backoff.items()]
    return rests


def busy_fraction(job: JobRecord, predict: Callable[[str, str], float], now: float | None = None) -> float:
    """Predicted busy fraction of `job` on its service: predicted service seconds per iteration (every chunk
    of a chunked node) over service + CPU seconds (nodes that run every k iterations count 1/k). Before any
    observation the cost model's prior makes it the share of service nodes. A session's: `sessions.busy_fraction`
    (at `now`: an idle session's falls while its client stays away)."""
    if job.plan.open:
        return session_busy_fraction(job, predict, now)
    busy = gap = 0.0
    for name, node in job.plan.nodes.items():
        sec = predict(job.job_id, name) * node.chunks / (node.every or 1)
        if node.runs_on == "service":
            busy += sec
        else:
            gap += sec
    return busy / (busy + gap) if busy + gap > 0 else 0.0


def due(
    svc: ServiceRecord,
    jobs: dict[str, JobRecord],
    predict: Callable[[str, str], float],
    gap: Callable[[str, str], float],
    now: float,
) -> dict[str, float]:
    """`OrderingView.due`: for the jobs on `svc` with no node queued there, the predicted seconds until their
    next service node is ready: the running (or sent-ahead) node's job -> `gap(job, node)`, the gap that
    node's end opens; a job with CPU nodes in flight -> the least predicted rest of them (`cpu_rests`,
    negative when overdue). Jobs with nothing in flight are left out."""
    queued = {q.job_id for q in svc.queue}
    out: dict[str, float] = {}
    for key in (svc.running, svc.next, *svc.cohort, *svc.next_cohort):
        if key is not None and key[0] not in queued:
            out[key[0]] = gap(key[0], key[2])
    for job_id in svc.jobs - queued - out.keys():
        rests = cpu_rests(jobs[job_id], predict, now)
        if rests:
            out[job_id] = min(rests)
    return out


def projected_slowdown(job: JobRecord, predict: Callable[[str, str], float], now: float) -> float:
    """The job's projected slowdown: (time since placement + the predicted rest of its work at its solo pace) /
    (the time its finished nodes took + that rest), each side + 1 s. The rest is the iterations left times
    the predicted seconds per iteration (every node; nodes that run every k iterations count 1/k). A job about
    to finish is judged by how late it will end, not by how late it is now: a short job kept waiting cannot
    catch up later, a long one can (the others' end frees the service)."""
    placed = job.placed_at if job.placed_at is not None else now
    left = 1 if job.plan.open else max(job.plan.iterations - max(job.iteration, 0), 0)  # (a session: its next call)
    rest = left * sum(predict(job.job_id, n) / (p.every or 1) for n, p in job.plan.nodes.items())
    return (now - placed + rest + 1.0) / (job.work_done + rest + 1.0)
