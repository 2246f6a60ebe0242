"""Timeline recorder: every node as a span on its lane (a service id, or "cpu"), and every blocking state
move as a `swap` span on its service; written per job as JSON and a picture (lanes x time, coloured by
node) under `<run_dir>/timelines/<job>/`. Every state move (blocking or background) is also kept as its
record (`plexrl.reports.MoveRecord`, plus its service and its start since the run began) in `moves`, written
per job as `moves.json` beside the timeline. `draw_cluster_timeline` draws all jobs at once (services x time,
coloured by job, swaps hatched)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plexrl.hooks.base import Hook

if TYPE_CHECKING:
    from plexrl.job.spec import JobRun
    from plexrl.reports import MoveRecord


@dataclass(slots=True)
class Span:
    job: str
    iteration: int
    node: str
    lane: str
    start: float
    end: float
    # "node", "swap" (blocking state moves), "load" (a job's engine and state created on its service), or
    # "weights" (a weight load into the generation engine, inside a node span)
    kind: str = "node"
    nbytes: int = 0


class TimelineRecorder(Hook):
    """`required`: the accounting reads these spans, so a recorder that fails stops the run (set it when an
    accounting hook uses this recorder)."""

    def __init__(self, out_dir: Path, draw: bool = True, required: bool = False, keep_ended: bool = True) -> None:
        self.required = required
        self.out_dir = Path(out_dir)
        self.draw = draw
        self.spans: list[Span] = []
        self.keep_ended = keep_ended  # False: an ended job's spans are dropped once written (a long-running server)
        self.t0: float | None = None
        self.moves: list[dict[str, Any]] = []  # every move's record, as plain data (`on_move`)

    def on_start(self, time: float) -> None:
        if self.t0 is None:
            self.t0 = time

    def after_node(
        self, job: JobRun, iteration: int, node: str, lane: str, start: float, end: float, metrics: dict[str, float]
    ) -> None:
        if self.t0 is None:
            self.t0 = start
        self.spans.append(Span(job.job_id, iteration, node, lane, start - self.t0, end - self.t0))

    def on_swap(self, job: JobRun, lane: str, start: float, end: float, nbytes: int) -> None:
        """Blocking state moves as `swap` spans."""
        if self.t0 is None:
            self.t0 = start
        self.spans.append(Span(job.job_id, -1, "swap", lane, start - self.t0, end - self.t0, "swap", nbytes))

    def on_move(self, job: JobRun, lane: str, record: MoveRecord) -> None:
        """A state move's record, with its service (`service`) and its start since the run began."""
        if self.t0 is None:
            self.t0 = record.start
        self.moves.append({**asdict(record), "service": lane, "start": record.start - self.t0})

    def on_load(self, job: JobRun, lane: str, start: float, end: float, nbytes: int) -> None:
        if self.t0 is None:
            self.t0 = start
        self.spans.append(Span(job.job_id, -1, "load", lane, start - self.t0, end - self.t0, "load", nbytes))

    def on_weight_load(self, job: JobRun, lane: str, kind: str, start: float, end: float, nbytes: int) -> None:
        if self.t0 is None:
            self.t0 = start
        span = Span(job.job_id, -1, f"weight {kind}", lane, start - self.t0, end - self.t0, "weights", nbytes)
        self.spans.append(span)

    def busy_seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.spans:
            if s.kind == "node":
                out[s.lane] = out.get(s.lane, 0.0) + (s.end - s.start)
        return out

    def on_job_end(self, job: JobRun) -> None:
        mine = [s for s in self.spans if s.job == job.job_id]
        (self.out_dir / job.job_id).mkdir(parents=True, exist_ok=True)
        path = self.out_dir / job.job_id / "timeline.json"
        path.write_text(json.dumps([asdict(s) for s in mine]))
        job.artifacts["timeline.json"] = path
        moves = self.out_dir / job.job_id / "moves.json"
        moves.write_text(json.dumps([m for m in self.moves if m["job"] == job.job_id]))
        job.artifacts["moves.json"] = moves
        if self.draw and mine:
            png = self.out_dir / job.job_id / "timeline.png"
            draw_timeline(mine, png)
            job.artifacts["timeline.png"] = png
        if not self.keep_ended:
            self.spans = [s for s in self.spans if s.job != job.job_id]
            self.moves = [m for m in self.moves if m["job"] != job.job_id]


def draw_timeline(spans: list[Span], path: Path) -> None:
    """Lanes x time; one colour per job, node names shaded by node."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = sorted({s.lane for s in spans}, key=lambda x: (x == "cpu", x))
    nodes = sorted({s.node for s in spans if s.kind != "weights"})
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * len(lanes)))
    for s in spans:
        y = lanes.index(s.lane)
        if s.kind == "weights":  # drawn over the node it happened in
            _draw_weight_load(ax, y, s)
        else:
            ax.barh(y, s.end - s.start, left=s.start, height=0.8, color=cmap(nodes.index(s.node) % 10))
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(i % 10)) for i in range(len(nodes))]
    labels = list(nodes)
    if any(s.kind == "weights" for s in spans):
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch="xx"))
        labels.append("weight load (vLLM)")
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=min(len(labels), 6), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def draw_cluster_timeline(spans: list[Span], path: Path, title: str = "") -> None:
    """Services (and the CPU pool) x time; one colour per job; swaps hatched in black."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = sorted({s.lane for s in spans}, key=lambda x: (x == "cpu", x))
    jobs = sorted({s.job for s in spans})
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.7 * len(lanes)))
    for s in spans:
        y = lanes.index(s.lane)
        if s.kind in ("swap", "load"):
            ax.barh(y, s.end - s.start, left=s.start, height=0.8, color="black", hatch="///")
        elif s.kind == "weights":
            _draw_weight_load(ax, y, s)
        else:
            ax.barh(y, s.end - s.start, left=s.start, height=0.8, color=cmap(jobs.index(s.job) % 10))
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds")
    if title:
        ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(i % 10)) for i in range(len(jobs))]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="black", hatch="///"))
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch="xx"))
    labels = [*jobs, "swap", "weight load"]
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=min(len(labels), 6), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _draw_weight_load(ax: Any, y: int, s: Span) -> None:
    """A weight load into the generation engine: a thin hatched bar over the node that waited for it."""
    ax.barh(y, s.end - s.start, left=s.start, height=0.35, facecolor="white", edgecolor="black", hatch="xx")
