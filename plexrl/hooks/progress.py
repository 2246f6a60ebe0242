"""A rich progress bar per job: iteration, reward, held-out accuracy, tokens/s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plexrl.hooks.base import Hook

if TYPE_CHECKING:
    from plexrl.job.spec import JobRun


class ProgressBar(Hook):
    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"),
        )
        self.tasks: dict[str, Any] = {}
        self.acc: dict[str, float] = {}
        self.progress.start()

    def on_job_start(self, job: JobRun) -> None:
        self.tasks[job.job_id] = self.progress.add_task(job.job_id, total=job.config.iterations, stats="")

    def on_iteration_end(self, job: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        name = job.spec.eval_metric()
        if name and name in metrics:
            self.acc[job.job_id] = metrics[name]
        parts = [f"reward {metrics.get('verify/reward_mean', float('nan')):.3f}"]
        if job.job_id in self.acc:
            parts.append(f"acc {self.acc[job.job_id]:.3f}")
        if "rollout/tokens_per_s" in metrics:
            parts.append(f"{metrics['rollout/tokens_per_s']:.0f} tok/s")
        self.progress.update(self.tasks[job.job_id], completed=iteration + 1, stats=" | ".join(parts))

    def close(self) -> None:
        self.progress.stop()
