"""The runner's handle ledger: what is in flight under each executor handle (`Pending`), and each job's current
iteration as the runner sees it (`Iteration`: output handles, metrics, seconds, chunk parts).

Pure bookkeeping: no executor, no hooks, no clock. Every method that ends the life of handles RETURNS them,
and the runner tells the executor to forget them; `node_report` turns a node's report into the planner's
`NodeFinished` (plus the handles to forget). Tested with fake reports (`tests/test_runner_ledger.py`).
"""

from __future__ import annotations

from plexrl.planner import NodeFinished
from plexrl.reports import Handle, NodeReport
from plexrl.runtime.records import Iteration, Pending


class Ledger:
    """See the module docstring. The loop thread's alone."""

    def __init__(self) -> None:
        self.pending: dict[Handle, Pending] = {}
        self.iters: dict[str, Iteration] = {}

    def __bool__(self) -> bool:
        """Whether any work is in flight."""
        return bool(self.pending)

    def sent(self, handle: Handle, p: Pending) -> None:
        self.pending[handle] = p

    def take(self, handle: Handle) -> Pending | None:
        """The work a finished handle stood for; None: nobody waits for it (a dropped job, a lost service)."""
        return self.pending.pop(handle, None)

    def lost(self, lane: str) -> None:
        """A service was lost: its work in flight is gone (the executor holds nothing of it)."""
        for handle in [h for h, p in self.pending.items() if p.lane == lane]:
            del self.pending[handle]

    def drop_nodes(self, job_id: str) -> list[Handle]:
        """A job's load failed: its nodes already sent report to nobody. Returns their handles."""
        sent = [h for h, p in self.pending.items() if p.job_id == job_id and p.kind == "node"]
        for h in sent:
            del self.pending[h]
        return sent

    def drop_job(self, job_id: str) -> list[Handle]:
        """Forget everything of a job in flight (submitted again, or forgotten) and its iteration. Returns the
        handles in flight (not the iteration's outputs: the executor forgets those with the job)."""
        mine = [h for h, p in self.pending.items() if p.job_id == job_id]
        for h in mine:
            del self.pending[h]
        self.iters.pop(job_id, None)
        return mine

    def drop_all(self) -> list[Handle]:
        """Stop: every handle in flight."""
        out = list(self.pending)
        self.pending.clear()
        return out

    def node_report(self, handle: Handle, p: Pending, rep: NodeReport) -> tuple[NodeFinished, list[Handle]]:
        """A node's report: the planner's event, and the handles to forget. A failed node's output and its
        chunk parts go; a finished chunk that is not the last is kept for the last one (its seconds add up);
        the last chunk's (or an unchunked node's) handle becomes the node's output and the parts it joined go;
        a paused slice of a sliced node (`paused`) has no output: its handle goes, its seconds add up."""
        it = self.iters.get(p.job_id)
        duration = rep.end - rep.start
        if rep.error is not None:
            parts = it.parts.pop(rep.node, []) if it is not None else []
            event = NodeFinished(p.job_id, rep.iteration, rep.node, ok=False, error=rep.error, duration=duration)
            return event, [handle, *parts]
        forget: list[Handle] = []
        task = p.task
        if it is None or rep.paused:  # (a paused slice has no output: the node's last slice makes it)
            forget = [handle]
            if it is not None:
                it.seconds[rep.node] = it.seconds.get(rep.node, 0.0) + duration
        elif task is not None and task.chunk < task.chunks - 1:  # a part of a chunked node: kept for its last chunk
            it.parts.setdefault(rep.node, []).append(handle)
            it.seconds[rep.node] = it.seconds.get(rep.node, 0.0) + duration
        else:
            it.outputs[rep.node] = handle
            it.metrics[rep.node] = rep.metrics
            it.seconds[rep.node] = it.seconds.get(rep.node, 0.0) + duration  # (the chunks of a chunked node)
            forget = it.parts.pop(rep.node, [])  # joined into the last chunk's output
        swap_seconds = rep.swap_end - rep.swap_start
        event = NodeFinished(
            p.job_id, rep.iteration, rep.node, True, None, duration, rep.swap_bytes, swap_seconds, rep.paused
        )
        return event, forget


__all__ = ["Ledger"]
