"""Runs the code of docs/tutorial-new-algorithm.md as written: its files, validated and run for 2
iterations on a tiny model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from plexrl.job.load import load_job
from plexrl.runtime.jobs import run_jobs

DOC = Path(__file__).parents[1] / "docs" / "tutorial-new-algorithm.md"


def tutorial_files() -> dict[str, str]:
    blocks = re.findall(r"```(?:python|yaml)\n# file: (\S+)\n(.*?)```", DOC.read_text(), flags=re.S)
    return {name: body for name, body in blocks}


def test_tutorial_has_its_files() -> None:
    assert set(tutorial_files()) == {"my_algos.py", "my_job.yaml", "my_job_nodes.yaml"}


@pytest.mark.parametrize("job_file", ["my_job.yaml", "my_job_nodes.yaml"])
def test_tutorial_job_runs(job_file: str, tmp_path: Path, tiny_config: dict[str, Any]) -> None:
    for name, body in tutorial_files().items():
        (tmp_path / name).write_text(body)
    raw = yaml.safe_load((tmp_path / job_file).read_text())
    for key in ("model", "task", "warm_start", "run_dir", "tracking"):  # tiny sizes for the test
        raw[key] = tiny_config[key]
    raw["iterations"] = 2
    raw["tracking"]["mlflow"] = False
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(tmp_path))
        loaded = load_job(
            raw, ["pipeline.params.batch_size=4", "pipeline.params.n=4"] if "name" in raw["pipeline"] else []
        )
        assert loaded.graph.node("curriculum").operator.name == "difficulty_weight"
        (job,) = run_jobs([loaded], progress=False)
    assert job.status == "done", job.error
    assert "curriculum/abs_mean" in job.history[-1] and "time/curriculum" in job.history[-1]
