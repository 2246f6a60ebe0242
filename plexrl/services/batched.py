"""Co-scheduled rollouts on a `Service` (`Planner(batch_rollouts=True)`, `plexrl/planner/batches.py`): the
members of a cohort, rollout nodes of distinct jobs on one shared engine, run as ONE engine call.

`run_cohort` applies the cohort's swaps once (they make every member resident), starts its prefetch, then calls
the members' operator's batched form (`Operator.batched`, e.g. `operators.rollout.rollout_together`: one
`vllm_lora.generate_together`) and returns one `NodeResult` per member, in order, each with its own weight
loads (its adapter's sync) and metrics. The call's span is split among the members in proportion to the tokens
each one's batch holds (`planner.batches.shares`): consecutive spans that tile the call, so the service's busy
time counts once, the cost model learns each member's share and each job is accounted its share. The swap
span goes to the first member. Members whose operators differ or have no batched form run one after another
(correct, just not batched). A session's member carries its call (`Member.call`: several sessions' `sample`
calls, `plexrl/sessions/sampling.py`), shared by tokens sampled. The call ends when its device work does
(`Service.node_end`: one event for every member's job). Errors are returned in the reports, never raised;
an engine call that fails fails every member (the node fails, as a rollout alone would).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plexrl.planner.batches import shares
from plexrl.planner.state import Move
from plexrl.reports import NodeReport
from plexrl.services import swap as sw

if TYPE_CHECKING:
    from plexrl.batch import Batch
    from plexrl.services.service import NodeResult, Service

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Member:
    """One member of a cohort: its node and inputs (input port -> batch)."""

    job_id: str
    iteration: int
    node: str
    inputs: dict[str, Batch]
    call: Any = None  # a session's call (`plexrl.sessions.calls`), which its node runs (`OpContext.extra`)


def run_cohort(
    svc: Service,
    members: Sequence[Member],
    swaps: Sequence[Move],
    prefetch: Sequence[Move],
    seq: int | None = None,
) -> list[NodeResult]:
    """See the module docstring. `seq`: the cohort's number among the service's ordered tasks (an executor
    that sends work ahead, `Service.run_node`'s `seq`; None: none): the cohort takes that one place, and the
    next task's early swaps may start once its swaps are applied and its prefetch queued."""
    from plexrl.services.nodes import NodeResult, finish

    swap_start = svc.clock()
    moved = 0
    measured: dict[str, int] = {}
    try:
        try:
            early = svc.background.claim(seq)
            if early is None:
                moved = svc.apply(swaps)
            else:  # (an executor that started the cohort's swaps early: wait for them)
                svc.background.wait(early)
                for mv in swaps:
                    svc._wait_for(mv.job_id)
            measured = {m.job_id: svc.states[m.job_id].nbytes for m in swaps if m.src == "device"}
            for m in members:
                svc._wait_for(m.job_id)
                if svc.states[m.job_id].tier != "device":
                    raise sw.StateCorrupted(
                        f"job {m.job_id} is on {svc.states[m.job_id].tier}, not device, at run time"
                    )
        except Exception as exc:
            now = svc.clock()
            with svc._lock:
                svc.stats.blocking_seconds += now - swap_start
            error: str | None = f"swap failed: {type(exc).__name__}: {exc}"
            lead = NodeResult(NodeReport(members[0].job_id, members[0].iteration, members[0].node, error, now, now,
                                          swap_start, now, moved, moves=svc.move_log.drain()))  # fmt: skip
            return [lead] + [NodeResult(NodeReport(m.job_id, m.iteration, m.node, error, now, now))
                             for m in members[1:]]  # fmt: skip
        swap_end = svc.clock()
        with svc._lock:
            svc.stats.blocking_seconds += swap_end - swap_start
        if prefetch:
            svc._start_prefetch(list(prefetch))
    finally:
        svc.background.passed(seq)  # also after a failed swap: a later early start must not wait forever
    ops = [svc.jobs[m.job_id].graph.node(m.node) for m in members]
    batched = getattr(ops[0].operator, "batched", None)
    if batched is None or len({n.operator.ref for n in ops}) > 1:
        results = [svc.run_node(m.job_id, m.iteration, m.node, m.inputs, call=m.call) for m in members]  # in turn
        results[0].report.swap_start, results[0].report.swap_end = swap_start, swap_end
        results[0].report.swap_bytes, results[0].report.measured = moved, measured
        return results
    start = svc.clock()
    error = None
    try:
        ctxs = [svc.context(svc.jobs[m.job_id], m.iteration, m.node) for m in members]
        for ctx, m in zip(ctxs, members, strict=True):
            ctx.extra["call"] = m.call
        outs: list[Any] = batched(ctxs, [m.inputs for m in members], [n.params for n in ops])
    except Exception as exc:
        log.error("cohort %s failed: %s", [m.job_id for m in members], exc, exc_info=log.isEnabledFor(logging.INFO))
        svc._drop_generators(only_broken=True)
        outs, error = [None] * len(members), f"{type(exc).__name__}: {exc}"
    error = svc.node_end([m.job_id for m in members], error)  # the call's device work done: then its end
    if error is not None:
        outs = [None] * len(members)
    end = svc.clock()
    weights = [_size(out) for out in outs]
    results = []
    for i, (m, out, (s, e)) in enumerate(zip(members, outs, shares(start, end, weights), strict=True)):
        first = i == 0
        report = NodeReport(m.job_id, m.iteration, m.node, error, s, e, swap_start if first else 0.0,
                            swap_end if first else 0.0, moved if first else 0, svc._weight_loads(m.job_id),
                            measured=measured if first else {},
                            moves=svc.move_log.drain() if first else [])  # fmt: skip
        results.append(NodeResult(report) if error is not None else finish(report, out))
    return results


def _size(out: Any) -> float:
    """A member's share of the call: the tokens of its rollout, those its session's sample call made, or those
    its session's forward_backward call trained on."""
    if out is None:
        return 0.0
    mask = getattr(out, "attention_mask", None)
    if mask is not None:
        return float(mask.sum())
    metrics = out.metrics()
    return float(metrics.get("sampled_tokens", metrics.get("tokens", 0.0)))


__all__ = ["Member", "run_cohort"]
