"""Co-scheduled rollouts (`Planner(batch_rollouts=True)`): several jobs' rollout nodes in ONE engine call.

A node has a batch key when its job's generation engine can mix jobs in one call (`JobPlan.batch` > 1: a
LoRA job on a shared vLLM engine, whose adapters one engine step mixes, up to `batch` of them) and its node is
batchable (`NodePlan.batchable`: a rollout that runs whole, neither chunked nor sliced): the key is the job's
shared-engine key (`JobPlan.engine[0]`), so one key means one engine on a service. When the planner sends such
a node (to run now, or ahead), `gather` adds the other queued nodes of that key on that service, of distinct
jobs, in the ordering policy's order, each only if its state can be made resident beside the members already
taken (a member that does not fit is left queued), up to the smallest `batch` of the members. The cohort is
ONE `RunNode` (the first member's, `cohort` naming the others) whose swaps make every member resident. With
lookahead a cohort is also sent ahead, to run right after the node or cohort running (`ServiceRecord.next_cohort`,
`next` one of its members, every member resident beside the running ones); it runs once those end (`advance`).
A batchable node that would go ahead alone waits instead when another job of its key will have its batchable
node ready before the running node is predicted to end (`worth_waiting`): both then run as one cohort when the
service frees, instead of one after the other.

Sessions' calls cohort with calls of their own kind only: sample calls in one engine call
(`plexrl/sessions/sampling.py`), forward_backward calls of LoRA sessions in one training pass
(`plexrl/sessions/training.py`). A session's batchable call (`JobPlan.open`: the client, not the plan, says when
its next call comes, so no due time predicts it) that finds its service idle may wait a little for its partners
(`gather_until`, `Planner(batch_window=...)`): while other sessions of its key on that service sit idle
between calls (their clients may be about to send theirs: a session whose client was never seen to send that
kind after the kind of its latest call is not waited for), at most `batch_window` seconds after the first queued
member became ready.
It stops waiting at once when no such session is left idle (they all queued their calls: the cohort is what can
form), when the cohort is full, or when any other work queues on the service (the service never idles while
something else could run). A session alone on its base never waits; one beside idle partners loses at most the
window per batchable call. The window counts from when the service freed, if that was later than the first
member's ready time: a member that waited behind other work is not a reason to start without the partners.

Sessions keep in phase (`keep_phase`, `Planner(phase_window=...)`): a session's batchable call the ordering
picks while other work could run lets that work go first when sessions of its key are busy on the service with
calls of other kinds (queued or running) and their clients were seen to come back to its kind from those
(`sessions.comes_to`: a loop that samples, trains, steps and saves). They then sample in the same cohort
instead of each alone as it comes round: SDK loops on one base that drifted apart come back into one cohort,
where without it they stay apart. It costs the service nothing (only other runnable work goes first) and
the call at most `phase_window` seconds after it became ready; the cohort full, it goes. Only sessions of the
call's own user hold it: another user's busy sessions (a flood of training calls, say) never delay it.

While the cohort runs, `ServiceRecord.cohort` holds every member and `running` one of them still running; each
member ends with its own `NodeFinished`, and the service is free once all have (`member_finished`). The
executor reports each member a consecutive share of the cohort's span (`shares`: proportional to the tokens of
its calls), so the cost model learns each member's share, the service's busy time counts once and each job's
accounted seconds are its share. Pure helpers of `core.Planner`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from plexrl.planner.policies import OrderingPolicy, OrderingView, QueuedNode
from plexrl.planner.records import JobRecord, ServiceRecord
from plexrl.planner.sessions import comes_to, idle
from plexrl.planner.state import Move, NoRoom

Key = tuple[str, int, str]


def batch_key(job: JobRecord, node: str) -> str | None:
    """The key of the engine `node` of `job` can share a call on; None: it runs alone. A session's call
    (`JobPlan.open`) shares one only with calls of its own kind (samples with samples, forward_backward calls
    with forward_backward calls): its key names the kind too."""
    plan = job.plan
    if plan.batch < 2 or plan.engine is None or not plan.nodes[node].batchable:
        return None
    return f"{plan.engine[0]}|{node}" if plan.open else plan.engine[0]


def gather(
    svc: ServiceRecord,
    jobs: Mapping[str, JobRecord],
    lead: QueuedNode,
    ordering: OrderingPolicy,
    view: OrderingView,
    now: float,
    make_resident: Callable[[str, set[str]], list[Move]],
    pinned: set[str],
) -> tuple[list[QueuedNode], list[Move]]:
    """The other members of `lead`'s cohort (taken off nothing: the caller pops them) and the moves that make
    them resident, in order. `make_resident(job, pinned)` raises `NoRoom` when the job does not fit beside
    `pinned`; such a job stays queued. Empty when `lead` has no batch key."""
    key = batch_key(jobs[lead.job_id], lead.node)
    if key is None:
        return [], []
    limit = jobs[lead.job_id].plan.batch
    taken = {lead.job_id}
    left = [
        q
        for q in svc.queue
        if q is not lead
        and q.job_id not in pinned
        and q.job_id != lead.job_id
        and jobs[q.job_id].nodes.get(q.node) == "ready"
        and batch_key(jobs[q.job_id], q.node) == key
    ]
    members: list[QueuedNode] = []
    moves: list[Move] = []
    while left and len(taken) < limit:
        index = ordering.pick(left, now, view)
        if index < 0:
            break
        q = left.pop(index)
        if q.job_id in taken or len(taken) >= jobs[q.job_id].plan.batch:
            continue
        try:
            moves += make_resident(q.job_id, pinned | taken)
        except NoRoom:
            continue  # it does not fit beside the members: it stays queued, to run later
        taken.add(q.job_id)
        limit = min(limit, jobs[q.job_id].plan.batch)
        members.append(q)
    return members, moves


def next_service_node(job: JobRecord) -> str | None:
    """The job's next service node not yet running: this iteration's first waiting or ready one, else the next
    iteration's first active one (None after its last iteration)."""
    plan, order = job.plan, job.plan.order or tuple(job.plan.nodes)
    for name in order:
        if plan.nodes[name].runs_on == "service" and job.nodes.get(name) in ("waiting", "ready"):
            return name
    it = job.iteration + 1
    if it >= plan.iterations:
        return None
    active = [n for n in order if plan.nodes[n].runs_on == "service" and plan.nodes[n].active(it, plan.iterations)]
    return active[0] if active else None


def worth_waiting(
    svc: ServiceRecord, jobs: Mapping[str, JobRecord], lead: QueuedNode, pinned: set[str],
    due: Callable[[], Mapping[str, float]], window: float,
) -> bool:  # fmt: skip
    """Whether `lead`, about to be sent ahead, should wait: it has a batch key, no other queued node of that key
    (of a job not `pinned`) could join it now, and another job on `svc` whose next service node has that key is
    due (`OrderingView.due`) within `window` seconds (the running node's predicted rest)."""
    key = batch_key(jobs[lead.job_id], lead.node)
    if key is None:
        return False
    for q in svc.queue:
        if q.job_id != lead.job_id and q.job_id not in pinned and batch_key(jobs[q.job_id], q.node) == key:
            return False  # a cohort can form now
    for job_id, rest in due().items():
        if job_id == lead.job_id or rest > window:
            continue
        nxt = next_service_node(jobs[job_id])
        if nxt is not None and batch_key(jobs[job_id], nxt) == key:
            return True
    return False


def gather_until(
    svc: ServiceRecord, jobs: Mapping[str, JobRecord], lead: QueuedNode, now: float, window: float
) -> float | None:
    """Until when `lead`, picked to run on the idle `svc`, waits for partners (see the module docstring): the
    first queued member's ready time + `window`; None: it starts now. Reads only."""
    key = batch_key(jobs[lead.job_id], lead.node)
    if key is None or window <= 0.0 or svc.running is not None:
        return None
    queued = {q.job_id for q in svc.queue}
    if len(queued) < len(svc.queue) or any(batch_key(jobs[q.job_id], q.node) != key for q in svc.queue):
        return None  # other work could run now (or a job queues twice)
    if len(queued) >= min(jobs[j].plan.batch for j in queued):
        return None  # the cohort is full
    until = max(min(q.ready_at for q in svc.queue), svc.running_since) + window  # (freed at: `advance`)
    if now >= until:
        return None
    for job_id in sorted(svc.jobs - queued):
        job = jobs[job_id]
        partner = job.status == "running" and not job.closing and idle(job) and lead.node in job.plan.nodes
        unseen = job.last_call is None or not job.follows.get(job.last_call)  # (no history after its latest call)
        if partner and batch_key(job, lead.node) == key and (unseen or comes_to(job, lead.node)):
            return until  # a session of its key between calls whose next call may be of lead's kind
    return None


def keep_phase(svc: ServiceRecord, jobs: Mapping[str, JobRecord], lead: QueuedNode, now: float, window: float) -> bool:
    """Whether `lead`, a session's batchable call the ordering picked, lets other queued work on `svc` go first
    (see the module docstring): a session of its key and of its user has a call of another kind queued or running
    there and its client was seen to come to lead's kind from it, the cohort that could form now is not full, and
    lead became ready less than `window` seconds ago. Reads only; the caller defers it only to work it can run
    now."""
    job = jobs[lead.job_id]
    key = batch_key(job, lead.node)
    if key is None or not job.plan.open or window <= 0.0 or now >= lead.ready_at + window:
        return False
    queued = {q.job_id for q in svc.queue if batch_key(jobs[q.job_id], q.node) == key} | {lead.job_id}
    if len(queued) >= min(jobs[j].plan.batch for j in queued):
        return False  # the cohort is full
    for job_id in sorted(svc.jobs - queued):
        other = jobs[job_id]
        busy = other.status == "running" and not other.closing and bool(other.nodes) and lead.node not in other.nodes
        mine = other.plan.user == job.plan.user  # (another user's sessions never hold a call: no one can stall it)
        if busy and mine and batch_key(other, lead.node) == key and comes_to(other, lead.node):
            return True  # it samples (say) after the call it has here: in phase, it joins lead's cohort
    return False


def start_cohort(svc: ServiceRecord, lead: QueuedNode, members: Sequence[QueuedNode], ahead: bool) -> set[str]:
    """`lead` (already off the queue) starts with `members` (taken off it here) as one cohort, now or (`ahead`)
    after what runs; its jobs."""
    if members:
        svc.queue = [e for e in svc.queue if all(e is not m for m in members)]
        keys = {(e.job_id, e.iteration, e.node) for e in (lead, *members)}
        if ahead:
            svc.next_cohort = keys
        else:
            svc.cohort = keys
    return {lead.job_id, *(m.job_id for m in members)}


def cohort_jobs(svc: ServiceRecord) -> set[str]:
    """The jobs of every member of the cohort running and of the cohort sent ahead."""
    return {k[0] for k in svc.cohort} | {k[0] for k in svc.next_cohort}


def advance(svc: ServiceRecord, now: float) -> None:
    """What ran ended (a node, or a cohort's last member): what was sent ahead, a node or a cohort, runs now."""
    svc.running, svc.next, svc.running_since = svc.next, None, now
    svc.cohort, svc.next_cohort = svc.next_cohort, set()


def leave_cohorts(svc: ServiceRecord, job_id: str, now: float) -> None:
    """An ended job's members of the running cohort and of the one sent ahead: dropped (`next` or `running`
    passes to another member; an emptied running cohort frees the service)."""
    for key in sorted(k for k in svc.next_cohort if k[0] == job_id):
        svc.next_cohort.discard(key)
        if svc.next == key:
            svc.next = min(svc.next_cohort) if svc.next_cohort else None
    for key in sorted(k for k in svc.cohort if k[0] == job_id):
        if member_finished(svc, key):
            advance(svc, now)


def member_finished(svc: ServiceRecord, key: Key) -> bool:
    """A member of the cohort `svc` runs ended (or its job did): drop it. True when the service is free."""
    svc.cohort.discard(key)
    if svc.cohort:
        if svc.running == key:
            svc.running = min(svc.cohort)  # another member still running stands for the cohort
        return False
    return True


def shares(start: float, end: float, weights: Sequence[float]) -> list[tuple[float, float]]:
    """Consecutive spans that tile [start, end], one per member, proportional to `weights` (equal when they
    sum to zero): what each member of a cohort is reported to have taken."""
    total = float(sum(weights))
    n = len(weights)
    fractions = [w / total for w in weights] if total > 0 else [1.0 / n] * n
    out, t = [], start
    for i, f in enumerate(fractions):
        u = end if i == n - 1 else t + f * (end - start)
        out.append((t, u))
        t = u
    return out


def violation(jobs: Mapping[str, JobRecord], services: Mapping[str, ServiceRecord]) -> str | None:
    """The first broken invariant of cohorts, described; None when all hold: a cohort's members are running
    service nodes of distinct jobs placed on its service, with their states on device, and `running` is one."""
    for svc in services.values():
        if svc.next_cohort and svc.next not in svc.next_cohort:
            return f"{svc.service_id}: next {svc.next} is not one of its cohort sent ahead {sorted(svc.next_cohort)}"
        if svc.cohort and svc.running not in svc.cohort:
            return f"{svc.service_id}: running {svc.running} is not one of its cohort {sorted(svc.cohort)}"
        both = svc.cohort | svc.next_cohort
        if len({k[0] for k in both}) < len(both):
            return f"{svc.service_id}: a job twice in its cohorts {sorted(svc.cohort)} / {sorted(svc.next_cohort)}"
        for job_id, iteration, node in both:
            job = jobs[job_id]
            if job.service != svc.service_id or job.status != "running" or not svc.state.on_device(job_id):
                return f"{svc.service_id}: cohort member {job_id} not placed there with its state on device"
            if job.iteration != iteration or job.nodes.get(node) != "running":
                return f"{svc.service_id}: cohort member {job_id}/{node} not marked running"
    return None


__all__ = [
    "advance", "batch_key", "cohort_jobs", "gather", "gather_until", "keep_phase", "leave_cohorts", "member_finished",
    "next_service_node", "shares", "start_cohort", "violation", "worth_waiting",
]  # fmt: skip
