"""Several LoRA sessions' `forward_backward` (or `forward`) calls over one base in ONE pass
(`forward_backward_many`): what a service runs for such calls queued together (the planner's cohorts,
`plexrl/planner/batches.py`, with the session's plan marking both kinds batchable, `plexrl/sessions/spec.py`).

The sessions' datums are stacked into one batch through the shared base, each row under its own session's
adapter (`plexrl/engines/stacked_lora.py`, `grouped`: the rows grouped by adapter, autograd through every
adapter's live parameters), split into forward passes of at most `MAX_FORWARD_TOKENS` padded tokens as one
call's are. Each session's loss is the sum over its own datums (its call's loss and config), the pass's
backward runs on the sum of them all; since the adapters share no parameter, each adapter's gradient is the
gradient of its session's loss alone, and it is added to that session's accumulated gradients as its call
alone would add it (equal up to the float noise of another batch composition). Each call's reply is what it
gets alone (per datum its target log-probs, its loss sum), with `call_sessions` the number of sessions the pass
served. optim_step stays per session.

One pass pays only on an accelerator (`ONE_PASS_DEVICES`): there a step's cost is launches and memory traffic,
which one pass shares. On a CPU the work is compute-bound: one pass does the arithmetic of every call plus the
padding of datums of other lengths and adapters of other ranks, and it cost each session more than its call
alone (docs/benchmarks.md, eight LoRA sessions), so there the calls of a cohort run one after another.

A call refused (a user error) gets its error while the others run. Calls of sessions not on one base, or
adapters `grouped` does not run (LoRA dropout, variants), run one after another, each alone. A pass that fails
fails every call of it, and each of its sessions drops its accumulated gradients, as a call alone does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from plexrl.sessions import losses
from plexrl.sessions.calls import ForwardBackward, Reply
from plexrl.sessions.refused import CallRefused

SessionEngine = Any  # (`plexrl.sessions.engine.SessionEngine`)

log = logging.getLogger(__name__)

ONE_PASS_DEVICES = frozenset({"cuda"})  # where several sessions' calls run as one pass (see the module docstring)


def forward_backward_many(sessions: Sequence[SessionEngine], calls: Sequence[ForwardBackward]) -> list[Reply]:
    """The replies of several sessions' forward_backward (or forward) calls, in one pass where they allow it
    (see the module docstring). Never raises for a call's own error: it comes back in that call's reply."""
    replies: list[Reply | None] = [None] * len(calls)
    run: list[int] = []
    for i, (se, call) in enumerate(zip(sessions, calls, strict=True)):
        try:
            se.check_data(call)
        except CallRefused as exc:
            replies[i] = Reply(error=str(exc))
            continue
        run.append(i)
    together = [sessions[i] for i in run]
    shared = [getattr(se.inner, "shared", None) for se in together]
    one_base = len(run) > 1 and shared[0] is not None and all(s is shared[0] for s in shared)
    one_kind = len({calls[i].backward for i in run}) == 1
    done = None
    if one_base and one_kind and _device(together[0]) in ONE_PASS_DEVICES:
        try:
            done = _together(together, [calls[i] for i in run])
        except Exception as exc:  # (each session drops its gradients, as its call alone would)
            log.exception("forward_backward calls of %d sessions failed", len(run))
            done = [se.failed(calls[i], exc) for i, se in zip(run, together, strict=True)]
    if done is None:  # one after another, each alone
        done = [se.run(calls[i]) for i, se in zip(run, together, strict=True)]
    for i, r in zip(run, done, strict=True):
        replies[i] = r
    return [r if r is not None else Reply(error="not run") for r in replies]


def _device(se: SessionEngine) -> str:
    """The device type the session's adapter trains on ('cpu', 'cuda', ...)."""
    return next(iter(se.trainable().values())).device.type


def _together(sessions: Sequence[SessionEngine], calls: Sequence[ForwardBackward]) -> list[Reply] | None:
    """The calls (checked, of one kind) of `sessions` (LoRA sessions of one shared base) in one pass; None when
    their adapters need the calls run alone (`grouped` refuses them), nothing changed then."""
    from plexrl.engines.stacked_lora import grouped
    from plexrl.sessions.engine import MAX_FORWARD_TOKENS, _forward_parts

    first = sessions[0]
    model = first.inner.shared.model
    backward = calls[0].backward
    params = [se.trainable() for se in sessions]
    owners = [(k, d) for k, c in enumerate(calls) for d in c.data]  # every datum and its session
    outputs: list[list[dict[str, np.ndarray]]] = [[] for _ in sessions]
    totals = [0.0] * len(sessions)
    with grouped(model, [se.inner.adapter for se in sessions]) as select:
        if select is None:
            return None
        trained = [p for ps in params for p in ps.values()]
        wanted = [p.requires_grad for p in trained]  # (peft trains the active adapter only: all of these here)
        model.train(backward)
        try:
            for p in trained:
                p.requires_grad_(True)
            for part in _forward_parts([len(d.tokens) for _, d in owners], MAX_FORWARD_TOKENS):
                select([owners[i][0] for i in part])
                with torch.set_grad_enabled(backward):
                    lps = first._target_logprobs(model, [owners[i][1] for i in part])
                    sums: dict[int, torch.Tensor] = {}
                    for i, lp in zip(part, lps, strict=True):
                        k, d = owners[i]
                        inputs = {n: torch.from_numpy(v).to(lp.device) for n, v in d.inputs.items()}
                        loss = losses.elementwise(calls[k].loss, lp, inputs, calls[k].config).sum()
                        sums[k] = sums[k] + loss if k in sums else loss
                        outputs[k].append({"logprobs": lp.detach().float().cpu().numpy()})
                    if backward:
                        torch.stack(list(sums.values())).sum().backward()
                        for k in sums:
                            sessions[k]._accumulate(params[k])
                for k, loss in sums.items():
                    totals[k] += float(loss.detach())
        finally:
            for p, want in zip(trained, wanted, strict=True):
                p.grad = None
                p.requires_grad_(want)
            model.eval()
    out = []
    for k, call in enumerate(calls):
        tokens = float(sum(len(d.tokens) for d in call.data))
        metrics = {"loss": totals[k], "datums": float(len(call.data)), "tokens": tokens,
                   "call_sessions": float(len(sessions))}  # fmt: skip
        out.append(Reply({"outputs": outputs[k], "metrics": {"loss:sum": totals[k]}}, metrics=metrics))
    return out


__all__ = ["ONE_PASS_DEVICES", "forward_backward_many"]
