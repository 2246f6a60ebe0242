"""Progress when the output is not a terminal (before: `make demo` printed nothing for the 160 s of its job
into a log file): plain lines with the iteration, reward, accuracy, time per iteration and estimated end, at
most one every N seconds; the rich bar stays for a terminal."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from conftest import TINY
from typer.testing import CliRunner

from plexrl.cli import app
from plexrl.hooks.progress import ProgressBar, ProgressLines, progress_hook


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_job(iterations: int) -> Any:
    spec = SimpleNamespace(eval_metric=lambda: "evaluate/accuracy")
    return SimpleNamespace(
        job_id="j", config=SimpleNamespace(iterations=iterations), spec=spec, status="done", error=""
    )


def test_lines_at_most_every_n_seconds_with_time_per_iteration_and_the_estimated_end() -> None:
    out, clock = io.StringIO(), Clock()
    hook = ProgressLines(out, every_s=30, clock=clock, wall=lambda: 0.0)
    job = fake_job(100)
    hook.on_job_start(job)
    for i in range(100):
        clock.now = 10.0 * (i + 1)  # 10 s per iteration
        metrics = {"verify/reward_mean": 0.5, **({"evaluate/accuracy": 0.25} if i == 3 else {})}
        hook.on_iteration_end(job, i, metrics)
    hook.on_job_end(job)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[j] started: 100 iterations"
    assert lines[1] == "[j] iteration 1/100 | reward 0.500"  # the first: no rate yet
    assert lines[2].startswith("[j] iteration 4/100 | reward 0.500 | acc 0.250 | 10.0 s/it | ETA 16m00s (")
    assert lines[3].startswith("[j] iteration 7/100 | reward 0.500 | acc 0.250 | 10.0 s/it | ETA 15m30s")
    assert lines[-2].startswith("[j] iteration 100/100") and lines[-1] == "[j] done"
    assert len(lines) == 1 + 1 + 33 + 1  # started, the first, one per 30 s after it (the last among them), done


def test_the_bar_on_a_terminal_and_lines_elsewhere() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    bar = progress_hook(Tty())
    assert isinstance(bar, ProgressBar)
    bar.close()
    assert isinstance(progress_hook(io.StringIO()), ProgressLines)


def test_plexrl_run_into_a_log_prints_progress_lines(tmp_path: Path) -> None:
    cfg = copy.deepcopy(TINY)
    cfg.update(run_dir=str(tmp_path / "runs"), iterations=2)
    cfg["tracking"] = {"mlflow": False, "log_model": False}  # progress: the default (on)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = CliRunner().invoke(app, ["run", str(path)])  # its output is not a terminal
    assert done.exit_code == 0, done.output
    assert "[tiny] iteration 1/2 | reward" in done.output and "[tiny] iteration 2/2 | reward" in done.output
    assert "[tiny] done" in done.output
