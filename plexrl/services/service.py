"""A `Service` hosts the engines of every job placed on it and runs their service nodes, one at a time
(the planner guarantees that; the service does not schedule). For now each placed job keeps its own
`TorchEngine` resident; moving job state between device, host and disk tiers is the StateManager's work.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plexrl.operator import OpContext

if TYPE_CHECKING:
    from plexrl.batch import Batch
    from plexrl.graph import Node
    from plexrl.job import JobHandle

log = logging.getLogger(__name__)


def needs_reference(job: JobHandle) -> bool:
    """Whether the job's pipeline reads reference-policy log-probs (then the engine keeps a frozen copy)."""
    return any(
        n.operator.name == "logprob" and getattr(n.params, "which", None) == "reference" for n in job.graph.nodes
    )


class Service:
    def __init__(self, service_id: str, device: str = "cpu") -> None:
        self.service_id = service_id
        self.device = device
        self.engines: dict[str, Any] = {}

    def load_job(self, job: JobHandle) -> None:
        """Create the job's engine from its starting model (strict affinity: it stays here)."""
        from plexrl.engines.torch_engine import TorchEngine

        tok = job.tokenizer
        self.engines[job.job_id] = TorchEngine(
            job.model_path,
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
            device=self.device,
            with_reference=needs_reference(job),
            attention=job.config.model.attention,
        )

    def context(self, job: JobHandle, iteration: int, node: str) -> OpContext:
        return OpContext(
            job.job_id, iteration, node, job.config.seed, job.task, job.tokenizer, self.engines[job.job_id]
        )

    def run(self, job: JobHandle, iteration: int, node: Node, inputs: dict[str, Batch]) -> Batch:
        return node.operator.run(self.context(job, iteration, node.name), inputs, node.params)

    def save_model(self, job: JobHandle, path: Path) -> Path:
        self.engines[job.job_id].save_pretrained(path)
        job.tokenizer.save_pretrained(str(path))
        return path

    def release(self, job_id: str) -> None:
        self.engines.pop(job_id, None)
