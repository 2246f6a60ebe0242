"""Runs docs/tutorial-your-model.md as written: its data file, reward module and job, for 2 iterations on a
tiny model with the real SmolLM2 tokenizer and chat template in place of the real model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from plexrl.job.load import load_job
from plexrl.runtime.jobs import run_jobs
from plexrl.yamlio import load_yaml_file

DOC = Path(__file__).parents[1] / "docs" / "tutorial-your-model.md"


def tutorial_files() -> dict[str, str]:
    blocks = re.findall(r"```(?:python|yaml|jsonl)\n# file: (\S+)\n(.*?)```", DOC.read_text(), flags=re.S)
    return {name: body for name, body in blocks}


def test_the_tutorial_job_runs_on_its_files(smol_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = tutorial_files()
    assert set(files) == {"my_train.jsonl", "my_rewards.py", "my_job.yaml"}
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    raw = load_yaml_file(tmp_path / "my_job.yaml")
    assert raw["model"] == {"pretrained": "smollm2-135m-instruct"}
    raw["model"] = {"path": str(smol_tiny)}  # the tiny stand-in, same tokenizer and template
    raw.update(iterations=2, run_dir=str(tmp_path / "runs"), engine="torch")
    raw["tracking"] = {"mlflow": False, "progress": False, "log_model": False}
    raw["pipeline"]["params"]["eval_every"] = 2
    (job,) = run_jobs([load_job(raw)], progress=False)
    assert job.status == "done", job.error
    last = job.history[-1]
    # both reward terms ran and were logged by label; the user reward was called, never failed
    assert {"verify/reward/regex", "verify/reward/brief", "verify/reward_errors"} <= set(last)
    assert last["verify/reward_errors"] == 0 and last["verify/reward_timeouts"] == 0
    assert 0 <= last["evaluate/accuracy"] <= 1 and last["train/steps"] >= 1
