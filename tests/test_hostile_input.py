"""Config files written by a hostile user: every kind is a clear `ConfigError` (the CLI prints it without a
traceback) found before any expensive work, for job configs, cluster configs and `--set` values."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from plexrl.cli import app
from plexrl.cluster import load_cluster
from plexrl.config_kinds import read_config
from plexrl.errors import ConfigError
from plexrl.job.load import load_job
from plexrl.yamlio import MAX_BYTES, MAX_NODES, load_yaml_text

# 9 levels of 9 aliases each: 9^9 = 387 million strings once expanded, from 10 short lines
BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)


def job_error(tmp_path: Path, content: str | bytes) -> str:
    path = tmp_path / "job.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_job(path)
    return str(info.value)


def test_alias_bomb_is_refused_before_expansion(tmp_path: Path) -> None:
    msg = job_error(tmp_path, BOMB)
    assert f"expands to more than {MAX_NODES} values through its aliases" in msg
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(BOMB + "jobs: [{job: {}}]\n")
    with pytest.raises(ConfigError, match="through its aliases"):  # `plexrl run` and `validate` read it first
        read_config(cluster)
    with pytest.raises(ConfigError, match="through its aliases"):
        load_cluster(cluster)


def test_too_many_values_or_bytes(tmp_path: Path) -> None:
    assert f"more than {MAX_NODES} values" in job_error(tmp_path, "x: [" + "1," * MAX_NODES + "1]\n")
    assert f"a config file is at most {MAX_BYTES} bytes" in job_error(tmp_path, "#" * (MAX_BYTES + 1))


def test_self_referencing_alias(tmp_path: Path) -> None:
    assert "refers to its own anchor" in job_error(tmp_path, "name: &n [1, *n]\n")


def test_file_that_is_not_utf8(tmp_path: Path) -> None:
    msg = job_error(tmp_path, b"name: ok\niterations: 3\nseed: caf\xe9\n")
    assert "not UTF-8 text (byte 0xe9 on line 3); save it as UTF-8" in msg


@pytest.mark.parametrize(
    "deep", ["pipeline: " + "[" * 50_000 + "]" * 50_000, "".join(" " * i + "a:\n" for i in range(500))]
)
def test_deep_nesting(tmp_path: Path, deep: str) -> None:  # flow and block style
    assert "nesting deeper than 64 levels" in job_error(tmp_path, deep)


def test_huge_integer(tmp_path: Path) -> None:
    assert "integer with 5000 digits on line 1" in job_error(tmp_path, "seed: " + "7" * 5000 + "\n")
    assert "digits" in job_error(tmp_path, "seed: 0x" + "f" * 200 + "\n")


def test_duplicate_key(tmp_path: Path) -> None:
    msg = job_error(tmp_path, "name: a\niterations: 3\nseed: 1\niterations: 30\n")
    assert "duplicate key 'iterations' on lines 2 and 4; keep one of them" in msg
    assert "twice on line 1" in job_error(tmp_path, "pipeline: {name: grpo, name: dapo}\n")


def test_anchors_and_merge_keys_within_limits_still_work(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: merged\npipeline:\n  name: grpo\n  params:\n    <<: {batch_size: 4, n: 4}\n    n: 2\n")
    job = load_job(path)
    rollout = job.graph.node("rollout").params.model_dump()
    assert rollout["n"] == 2  # an explicit key overrides a merged one: not a duplicate
    assert load_yaml_text("a: &x [1, 2]\nb: *x\n", "t") == {"a": [1, 2], "b": [1, 2]}


def test_set_values_are_read_with_the_same_limits() -> None:
    with pytest.raises(ConfigError, match=r"--set seed=\[\[.*nesting deeper"):
        load_job(None, ["seed=" + "[" * 1000 + "]" * 1000])
    with pytest.raises(ConfigError, match="integer with 5000 digits"):
        load_job(None, ["seed=" + "1" * 5000])


def test_cli_validate_prints_no_traceback(tmp_path: Path) -> None:
    runner = CliRunner()
    for name, content in {"bomb.yaml": BOMB.encode(), "latin1.yaml": b"name: caf\xe9\n"}.items():
        (tmp_path / name).write_bytes(content)
        result = runner.invoke(app, ["validate", str(tmp_path / name)])
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output and "problem(s)" in result.output
