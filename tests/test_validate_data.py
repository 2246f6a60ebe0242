"""`plexrl validate` opens a job's data files and resolves its rewards (before: five bad files passed
`validate` and failed only in `run`, after the model loaded): each bad file gets from `validate` the error
`run` gives, and a good job's output says what was checked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from test_data_files import write_verl_parquet
from typer.testing import CliRunner

from plexrl.cli import app

runner = CliRunner()


def bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """The issue's five: each file and a phrase of the error it must get."""
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text("".join(json.dumps({"prompt": f"q{i}", "comment": "x"}) + "\n" for i in range(3)))
    not_utf8 = tmp_path / "not_utf8.jsonl"
    not_utf8.write_bytes(b'{"prompt": "q0", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), str(empty))
    not_parquet = tmp_path / "not_parquet.parquet"
    not_parquet.write_text("prompt,answer\nq,1\n")
    return {
        "a missing answer column": (no_answer, "no answer column"),
        "a null ground truth": (write_verl_parquet(tmp_path / "null.parquet", 5, null_at=3), "ground truth is null"),
        "a line that is not UTF-8": (not_utf8, "line 2 is not UTF-8"),
        "an empty parquet": (empty, "the file has no rows"),
        "a file that is not parquet": (not_parquet, "cannot read the file"),
    }


def job_file(tmp_path: Path, model: Path, train: Path, name: str, **data: Any) -> Path:
    job = {
        "name": "v",
        "iterations": 1,
        "run_dir": str(tmp_path / "runs"),
        "engine": "torch",
        "model": {"path": str(model)},
        "warm_start": {"enabled": False},
        "tracking": {"mlflow": False, "progress": False, "log_model": False},
        "data": {"train": str(train), "rewards": [{"name": "exact"}], **data},
        "pipeline": {"name": "grpo", "params": {"batch_size": 2, "n": 2, "max_new_tokens": 4, "eval_every": 100}},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def error_line(output: str, phrase: str) -> str:
    lines = [line.strip() for line in output.splitlines() if phrase in line]
    assert lines, output
    return lines[0]


@pytest.mark.parametrize(
    "which",
    ["a missing answer column", "a null ground truth", "a line that is not UTF-8", "an empty parquet",
     "a file that is not parquet"],
)  # fmt: skip
def test_each_bad_file_fails_validate_with_the_error_run_gives(tmp_path: Path, smol_tiny: Path, which: str) -> None:
    path, phrase = bad_files(tmp_path)[which]
    job = job_file(tmp_path, smol_tiny, path, "job")
    checked = runner.invoke(app, ["validate", str(job)])
    assert checked.exit_code == 2, checked.output
    assert "Traceback" not in checked.output and str(path) in checked.output
    ran = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert ran.exit_code == 2, ran.output
    assert error_line(checked.output, phrase) == error_line(ran.output, phrase)


def test_validate_says_what_it_checked_and_resolves_rewards(tmp_path: Path, smol_tiny: Path) -> None:
    train = write_verl_parquet(tmp_path / "train.parquet", 20)
    job = job_file(tmp_path, smol_tiny, train, "good", held_out_fraction=0.25, max_prompt_tokens=200)
    done = runner.invoke(app, ["validate", str(job)])
    assert done.exit_code == 0, done.output
    assert "15 train rows, every row checked (verl layout" in done.output
    assert "held out: 5 rows (held_out_fraction 0.25)" in done.output
    assert (
        "the first train prompt renders to" in done.output and "rewards: resolved exact (exact: built-in" in done.output
    )
    raw = yaml.safe_load(job.read_text())
    raw["data"]["rewards"].append({"ref": "test_validate_data:nowhere"})
    job.write_text(yaml.safe_dump(raw))
    bad = runner.invoke(app, ["validate", str(job)])
    assert bad.exit_code == 2 and "data.rewards[1].ref" in bad.output and "nowhere" in bad.output, bad.output
