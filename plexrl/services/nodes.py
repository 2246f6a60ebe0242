"""What a service node returns, and the nodes that need no engine: `NodeResult` (a node's report and its
output), `run_cpu_node` (a CPU-pool node) and `chunk_inputs` (one chunk's inputs of a chunked node). Split
from `plexrl.services.service`, which runs engine nodes and moves states; nothing here touches a state."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plexrl.operator import OpContext
from plexrl.reports import NodeReport

if TYPE_CHECKING:
    from plexrl.batch import Batch
    from plexrl.job.spec import JobSpec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeResult:
    """A node's report and its output (None on error). Where it is made, it stays: an executor hands the
    runner `report` and keeps `output` for the nodes that read it."""

    report: NodeReport
    output: Batch | None = None


def finish(report: NodeReport, out: Batch | None) -> NodeResult:
    """Attach the output's metrics (a session call's reply too) to the report; a metrics() that raises fails it."""
    if out is not None:
        try:
            report.metrics = {k: float(v) for k, v in out.metrics().items()}
        except Exception as exc:
            report.error = f"metrics of node {report.node!r}: {type(exc).__name__}: {exc}"
            return NodeResult(report, None)
        if hasattr(out, "payload"):  # a session call's result (`plexrl.sessions.operators.CallResult`)
            report.reply = out.payload()
    return NodeResult(report, out)


def run_cpu_node(
    job: JobSpec, iteration: int, node_name: str, inputs: dict[str, Batch], clock: Callable[[], float]
) -> NodeResult:
    """Run one CPU-pool node of `job` (no engine). Errors are returned, never raised."""
    node = job.graph.node(node_name)
    ctx = OpContext(job.job_id, iteration, node.name, job.config.seed, job.task, job.tokenizer)
    start = clock()
    try:
        out = node.operator.run(ctx, inputs, node.params)
    except Exception as exc:
        log.error("job %s node %s (iteration %d) failed: %s", job.job_id, node_name, iteration, exc,
                  exc_info=log.isEnabledFor(logging.INFO))  # fmt: skip
        error = f"{type(exc).__name__}: {exc}"
        return NodeResult(NodeReport(job.job_id, iteration, node_name, error, start, clock()))
    return finish(NodeReport(job.job_id, iteration, node_name, None, start, clock()), out)


def chunk_inputs(op: Any, inputs: dict[str, Batch], chunk: int, chunks: int, parts: int) -> dict[str, Batch]:
    """The inputs of chunk `chunk` of `chunks` of a node of `op`: its chunk input cut to the chunk's rows, the
    rest whole. `parts`: how many earlier chunks' outputs came with it (the last chunk needs all of them)."""
    from plexrl.batch import chunk_rows

    if not op.chunkable:
        raise ValueError(f"operator {op.name!r} cannot run in chunks (it declares no chunk_input)")
    if parts != (chunk if chunk == chunks - 1 else 0):
        raise ValueError(f"chunk {chunk} of {chunks} got {parts} earlier parts")
    batch: Any = inputs[op.chunk_input]  # a row-sliceable batch (`Operator._check_chunkable`)
    return {**inputs, op.chunk_input: batch.rows(*chunk_rows(len(batch), chunk, chunks))}


__all__ = ["NodeResult", "chunk_inputs", "finish", "run_cpu_node"]
