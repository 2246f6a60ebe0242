"""Online cost model: predicted node durations and swap bandwidth, fitted to what the driver observes.

Pure and tiny: an exponentially weighted moving average (EWMA) per (job, node), a per-node-name average over
all jobs as the prior for a job that has not run that node yet, and a global prior before any observation.
The planner uses it for HRRS (expected service time), for the predicted busy fraction of a job (placement)
and for the expected cost of a swap (bytes / bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Ewma:
    value: float
    count: int = 1

    def update(self, x: float, alpha: float) -> None:
        self.value = (1 - alpha) * self.value + alpha * x
        self.count += 1


@dataclass(slots=True)
class CostModel:
    """`alpha`: EWMA weight of a new observation. `prior_seconds`: a node's duration before any observation
    of its name. `bandwidth`: bytes/second of a swap before the first measured swap."""

    alpha: float = 0.3
    prior_seconds: float = 0.1
    bandwidth: float = 2e9
    nodes: dict[tuple[str, str], Ewma] = field(default_factory=dict)
    by_name: dict[str, Ewma] = field(default_factory=dict)
    _bandwidth: Ewma | None = None

    def observe(self, job_id: str, node: str, seconds: float) -> None:
        entry = self.nodes.get((job_id, node))
        if entry is None:
            self.nodes[(job_id, node)] = Ewma(seconds)
        else:
            entry.update(seconds, self.alpha)
        shared = self.by_name.get(node)
        if shared is None:
            self.by_name[node] = Ewma(seconds)
        else:
            shared.update(seconds, self.alpha)

    def observe_swap(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        bw = nbytes / seconds
        if self._bandwidth is None:
            self._bandwidth = Ewma(bw)
        else:
            self._bandwidth.update(bw, self.alpha)

    def predict(self, job_id: str, node: str) -> float:
        entry = self.nodes.get((job_id, node)) or self.by_name.get(node)
        return entry.value if entry is not None else self.prior_seconds

    def swap_seconds(self, nbytes: int) -> float:
        bw = self._bandwidth.value if self._bandwidth is not None else self.bandwidth
        return nbytes / bw

    def observed(self, job_id: str, node: str) -> bool:
        return (job_id, node) in self.nodes

    def of_job(self, job_id: str) -> dict[str, float]:
        """The job's own predictions, node -> seconds (what a checkpoint keeps of the cost model)."""
        return {node: e.value for (j, node), e in self.nodes.items() if j == job_id}

    def forget(self, job_id: str) -> None:
        for key in [k for k in self.nodes if k[0] == job_id]:
            del self.nodes[key]
