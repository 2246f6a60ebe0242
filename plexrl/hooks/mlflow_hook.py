"""MLflow tracking as a hook (operators and the planner never import mlflow).

Per job, one MLflow run: the flattened config as params; per iteration, every metric of the iteration
(step = iteration + 1; step 0 is the baseline before training); artifacts: the job YAML, a picture of the
pipeline DAG, the timeline, and the final model. Uses `MlflowClient` with explicit run ids, so many jobs
can be tracked at once. Default store: `sqlite:///<run_dir>/mlflow.db`; `tracking.uri` or the environment
variable MLFLOW_TRACKING_URI overrides it.

A job's run is created at its start (its id goes to `job.tracking` at once); its params and artifacts (the
config, the job YAML, a picture of the DAG: the slow part) are written on a background thread while the job's
load runs on its service, and every later call for that job waits for them first. A job whose tracking fails
(its experiment cannot be created, the store refuses a write) loses tracking for itself only: `HookList` turns
this hook off for that job (at the call where the failure surfaces) and keeps it on for the others. What the
hook keeps per job is dropped at the job's end (a server runs jobs for weeks).
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from plexrl.hooks.base import Hook
from plexrl.job.config import flatten

if TYPE_CHECKING:
    from plexrl.job.spec import JobRun

log = logging.getLogger(__name__)


def tracking_uri(run_dir: Path, configured: str | None = None) -> str:
    """`configured`, else MLFLOW_TRACKING_URI, else a sqlite file under `run_dir`."""
    if configured:
        return configured
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    run_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


class MlflowHook(Hook):
    def __init__(self) -> None:
        self.clients: dict[str, Any] = {}
        self.runs: dict[str, str] = {}
        self.logged: dict[str, int] = {}  # a resumed job's last step already in its run (not logged twice)
        self._starting: dict[str, Future[None]] = {}  # job -> its run being created (`on_job_start`)
        self._pool: ThreadPoolExecutor | None = None

    def _started(self, job_id: str) -> None:
        """Wait until the job's run exists (raises what creating it raised)."""
        fut = self._starting.pop(job_id, None)
        if fut is not None:
            fut.result()

    def close(self) -> None:
        """Wait for runs still being created, then stop the background thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._starting.clear()

    def _client(self, job: JobRun) -> Any:
        from mlflow.tracking import MlflowClient

        uri = tracking_uri(job.spec.run_dir, job.config.tracking.uri)
        if uri not in self.clients:
            self.clients[uri] = MlflowClient(tracking_uri=uri)
        job.tracking["uri"] = uri
        return self.clients[uri]

    def on_job_start(self, job: JobRun) -> None:
        """Create (or, resumed, reopen) the job's run here, so its id is in `job.tracking` at once (the server
        journals it); log its params and artifacts on the background thread (see the module docstring)."""
        client = self._client(job)
        resume = getattr(job.spec, "resume_run_id", None)
        if resume:  # resumed from a checkpoint (plexrl serve): continue the same run, params already logged
            client.update_run(resume, status="RUNNING")
            self.runs[job.job_id] = resume
            job.tracking.update(run_id=resume, experiment_id=client.get_run(resume).info.experiment_id)
            history = client.get_metric_history(resume, "time/iteration")
            self.logged[job.job_id] = max((m.step for m in history), default=0)
            return
        name = job.config.tracking.experiment
        exp = client.get_experiment_by_name(name)
        if exp is None:
            art = (job.spec.run_dir / "mlartifacts").resolve().as_uri()
            exp_id = client.create_experiment(name, artifact_location=art)
        else:
            exp_id = exp.experiment_id
        run = client.create_run(exp_id, run_name=job.job_id, tags={"plexrl.pipeline": job.graph.name})
        self.runs[job.job_id] = run.info.run_id
        job.tracking.update(run_id=run.info.run_id, experiment_id=exp_id)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-start")
        self._starting[job.job_id] = self._pool.submit(self._start, job, client, run.info.run_id)

    def _start(self, job: JobRun, client: Any, run_id: str) -> None:
        """The new run's params and artifacts (the config, the resolved job YAML, a picture of the DAG)."""
        from mlflow.entities import Param

        params = flatten(job.config.model_dump(mode="json"))
        params.update({f"warm_start_result.{k}": v for k, v in job.spec.warm_start.items()})
        params["pipeline.graph"] = json.dumps(job.graph.describe())
        params["engine.resolved"] = job.spec.generation  # what `engine: auto` became, and why
        params["engine.reason"] = job.spec.generation_reason
        client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())])
        art_dir = job.spec.run_dir / "jobs" / job.job_id
        art_dir.mkdir(parents=True, exist_ok=True)
        # the resolved config: a job YAML that reproduces this run (defaults and --set overrides applied)
        resolved = yaml.safe_dump(job.config.model_dump(mode="json"), sort_keys=False)
        (art_dir / "job.yaml").write_text(f"# plexrl run {art_dir / 'job.yaml'}\n{resolved}")
        client.log_artifact(run_id, str(art_dir / "job.yaml"))
        try:
            from plexrl.viz import draw_pipeline

            draw_pipeline(job.graph, art_dir / "pipeline.png")
            client.log_artifact(run_id, str(art_dir / "pipeline.png"))
        except Exception:  # a missing picture must not fail tracking
            log.exception("could not draw the pipeline DAG")

    def on_iteration_end(self, job: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        self._started(job.job_id)
        run_id = self.runs.get(job.job_id)
        if run_id is None:
            return
        step = iteration + 1  # (iterations keep their real numbers: a resumed job's first is not 0)
        if step <= self.logged.get(job.job_id, -1):
            return  # logged by the attempt before the restart (a resumed run repeats it exactly)
        now = int(time.time() * 1000)
        rows = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items())]
        self._client(job).log_batch(run_id, metrics=rows)

    def on_job_end(self, job: JobRun) -> None:
        try:
            self._started(job.job_id)
        except Exception:
            log.exception("could not create the MLflow run of job %s", job.job_id)
        run_id = self.runs.pop(job.job_id, None)
        self.logged.pop(job.job_id, None)
        if run_id is None:
            return
        client = self._client(job)
        for name, path in sorted(job.artifacts.items()):
            if Path(path).is_dir():
                client.log_artifacts(run_id, str(path), artifact_path=name)
            elif Path(path).is_file():
                client.log_artifact(run_id, str(path))
        if job.error:
            client.set_tag(run_id, "plexrl.error", job.error[:5000])
        status = {"done": "FINISHED", "cancelled": "KILLED"}.get(job.status, "FAILED")
        client.set_terminated(run_id, status=status)
