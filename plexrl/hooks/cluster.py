"""Cluster-level hooks: the accounting (per service busy / swap / idle, per job allocated accelerator-seconds,
cost per step) and the cluster-level MLflow run. Both act in `on_end`, once every job has ended.

`Accounting` reads the spans of a `TimelineRecorder`, so it makes that recorder `required`: a timeline that
fails stops the run loudly instead of leaving the accounting silently wrong.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from plexrl.hooks.base import Hook, RunSummary
from plexrl.hooks.timeline import TimelineRecorder, draw_cluster_timeline

log = logging.getLogger(__name__)


class Accounting(Hook):
    """Computes the `ClusterReport` and writes `report.{json,txt}`, `timeline.{json,png}` under `out_dir`."""

    required = True

    def __init__(self, timeline: TimelineRecorder, out_dir: Path, title: str = "", config: Any = None) -> None:
        timeline.required = True
        self.timeline, self.out_dir, self.title, self.config = timeline, Path(out_dir), title, config
        self.report: Any = None
        self.service_reports: dict[str, dict[str, Any]] = {}
        self.png: Path | None = None

    def on_end(self, summary: RunSummary) -> None:
        from plexrl.accounting import JobFacts, account, format_report

        t0 = self.timeline.t0 if self.timeline.t0 is not None else summary.start
        facts = [
            JobFacts(
                r.job_id,
                r.service,
                r.iterations_done,
                (r.started_at - t0) if r.started_at is not None else 0.0,
                (r.finished_at if r.finished_at is not None else summary.end) - t0,
                r.status,
            )
            for r in summary.runs
        ]
        self.report = account(self.timeline.spans, facts, sorted(summary.services), summary.end - t0)
        self.service_reports = dict(summary.service_reports)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "report.json").write_text(
            json.dumps(
                {"report": self.report.as_dict(), "services": self.service_reports, "config": self.config},
                indent=1,
                default=str,
            )
        )
        (self.out_dir / "report.txt").write_text(format_report(self.report) + "\n")
        (self.out_dir / "timeline.json").write_text(json.dumps([asdict(sp) for sp in self.timeline.spans]))
        (self.out_dir / "moves.json").write_text(json.dumps(self.timeline.moves))  # every move's record
        try:
            png = self.out_dir / "timeline.png"
            draw_cluster_timeline(self.timeline.spans, png, self.title)
            self.png = png
        except Exception:  # a missing picture must not lose the accounting
            log.exception("could not draw the cluster timeline")


class ClusterMlflow(Hook):
    """One MLflow run for the cluster: policies and budgets as params, per-service and per-job accounting
    as metrics, the table, report and timeline as artifacts; each job's run is linked both ways by tags."""

    def __init__(self, accounting: Accounting, run_dir: Path, name: str, experiment: str, params: dict[str, Any]):
        self.accounting, self.run_dir, self.name, self.experiment = accounting, Path(run_dir), name, experiment
        self.params = params
        self.tracking: dict[str, str] = {}

    def on_end(self, summary: RunSummary) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        from plexrl.hooks.mlflow_hook import tracking_uri
        from plexrl.job.config import flatten

        rep = self.accounting.report
        if rep is None:
            raise RuntimeError("the accounting hook produced no report (it must come before ClusterMlflow)")
        uri = tracking_uri(self.run_dir)
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            art = (self.run_dir / "mlartifacts").as_uri()
            exp_id = client.create_experiment(self.experiment, artifact_location=art)
        else:
            exp_id = exp.experiment_id
        run = client.create_run(exp_id, run_name=self.name, tags={"plexrl.kind": "cluster"})
        run_id = run.info.run_id
        params = flatten(self.params)
        client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())])
        now = int(time.time() * 1000)
        metrics = [Metric("accelerator_seconds", rep.accelerator_seconds, now, 0), Metric("wall", rep.wall, now, 0)]
        for s in rep.services:
            for k in ("busy", "swap", "startup", "idle"):
                metrics.append(Metric(f"{s.service}/{k}_seconds", getattr(s, k), now, 0))
            metrics.append(Metric(f"{s.service}/utilization", s.utilization, now, 0))
        for j in rep.jobs:
            metrics += [
                Metric(f"job/{j.job_id}/allocated_seconds", j.allocated, now, 0),
                Metric(f"job/{j.job_id}/steps", float(j.steps), now, 0),
                Metric(f"job/{j.job_id}/completion_seconds", j.completion, now, 0),
            ]
            if j.steps:
                metrics.append(Metric(f"job/{j.job_id}/cost_per_step", j.cost_per_step, now, 0))
        client.log_batch(run_id, metrics=metrics)
        for job in summary.runs:
            if job.tracking.get("run_id"):
                client.set_tag(run_id, f"plexrl.job.{job.job_id}", job.tracking["run_id"])
                try:
                    MlflowClient(tracking_uri=job.tracking["uri"]).set_tag(
                        job.tracking["run_id"], "plexrl.cluster_run", run_id
                    )
                except Exception:
                    log.exception("could not link job %s to the cluster run", job.job_id)
        for name in ("report.txt", "report.json", "timeline.png", "moves.json"):
            path = self.accounting.out_dir / name
            if path.is_file():
                client.log_artifact(run_id, str(path))
        failed = summary.interrupted or any(j.status != "done" for j in summary.runs)
        client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")
        self.tracking = {"uri": uri, "run_id": run_id}
