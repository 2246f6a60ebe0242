"""The node operator of a session's open plan: every call kind (`calls.CALL_KINDS`) is a service node of this
one operator, named after the kind, so the planner's cost model learns each kind's time apart. The call itself
rides with the node (`OpContext.extra["call"]`, set by the service from the executor's task); the reply goes
back in the node's report (`NodeReport.reply`), the only part of a session node's output that leaves the
service."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from plexrl.batch import Batch
from plexrl.graph import Pipeline, PipelineGraph
from plexrl.operator import OpContext, operator
from plexrl.sessions.calls import CALL_KINDS, Reply, pack
from plexrl.sessions.engine import session_engine

SESSION_PIPELINE = "session"  # the graph name of every session's plan


@dataclass(slots=True)
class CallResult(Batch):
    """A call's reply; `metrics()` are the call's own (its row in the session's MLflow run)."""

    reply: Reply

    def metrics(self) -> dict[str, float]:
        return {**self.reply.metrics, "refused": float(self.reply.error is not None)}

    def payload(self) -> dict[str, Any]:
        """The reply as plain, msgpack-able data (what a report carries across processes: `calls.pack`)."""
        packed: dict[str, Any] = pack(dataclasses.asdict(self.reply))
        return packed


@operator(runs_on="service")
def session_call(ctx: OpContext) -> CallResult:
    """Run the call that came with this node on the session's engine (`SessionEngine.run`)."""
    call = ctx.extra.get("call")
    if call is None:
        raise ValueError(f"node {ctx.node!r} of session {ctx.job_id} ran without its call")
    if call.kind != ctx.node:
        raise ValueError(f"node {ctx.node!r} of session {ctx.job_id} got a {call.kind!r} call")
    return CallResult(session_engine(ctx.engine).run(call, generator=ctx.engine))


def session_calls_together(ctxs: Sequence[OpContext], inputs: Sequence[Any], params: Sequence[Any]) -> list[CallResult]:
    """The batched form of `session_call` (a cohort, `plexrl/services/batched.py`): several sessions' `sample`
    calls in ONE engine call (`sampling.sample_many`), or their `forward_backward` (`forward`) calls in one pass
    (`training.forward_backward_many`); one result per session, in order, each its own call's reply. Calls of
    mixed or other kinds run one after another (the planner cohorts calls of one kind only)."""
    from plexrl.sessions.calls import ForwardBackward, Sample, Samples
    from plexrl.sessions.sampling import bundled, sample_many
    from plexrl.sessions.training import forward_backward_many

    calls: list[Any] = [ctx.extra.get("call") for ctx in ctxs]
    for ctx, call in zip(ctxs, calls, strict=True):
        if call is None or call.kind != ctx.node:
            raise ValueError(f"node {ctx.node!r} of session {ctx.job_id} ran without its call")
    sessions = [session_engine(ctx.engine) for ctx in ctxs]
    if all(isinstance(c, Sample | Samples) for c in calls):  # (a session's calls run together: rows of this call)
        flat: list[tuple[Any, Any, Sample]] = []
        spans: list[tuple[int, int]] = []
        for se, ctx, c in zip(sessions, ctxs, calls, strict=True):
            parts = c.calls if isinstance(c, Samples) else (c,)
            spans.append((len(flat), len(parts)))
            flat += [(se, ctx.engine, p) for p in parts]
        got = sample_many([f[0] for f in flat], [f[1] for f in flat], [f[2] for f in flat])
        return [CallResult(bundled(got[a : a + n]) if isinstance(c, Samples) else got[a])
                for c, (a, n) in zip(calls, spans, strict=True)]  # fmt: skip
    if all(isinstance(c, ForwardBackward) for c in calls):
        return [CallResult(r) for r in forward_backward_many(sessions, calls)]
    pairs = zip(sessions, ctxs, calls, strict=True)
    return [CallResult(se.run(c, generator=x.engine)) for se, x, c in pairs]


session_call.batched = session_calls_together  # type: ignore[attr-defined]  # (`Operator.batched`)


def session_graph() -> PipelineGraph:
    """The session's plan: one service node per call kind, no edges (each iteration runs the one that came)."""
    p = Pipeline(SESSION_PIPELINE)
    for kind in CALL_KINDS:
        p.add(kind, session_call)
    return p.build()


__all__ = ["SESSION_PIPELINE", "CallResult", "session_call", "session_calls_together", "session_graph"]
