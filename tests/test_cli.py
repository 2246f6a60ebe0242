"""The command line: clear messages and exit codes for bad input, no tracebacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from typer.testing import CliRunner

from plexrl.cli import app

runner = CliRunner()


def test_validate_reports_every_problem_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("iterations: -1\nmodle: {}\npipeline: {name: grpo, params: {n: 0.5}}\n")
    result = runner.invoke(app, ["validate", str(bad)])
    assert result.exit_code == 2
    out = result.output
    assert "3 problem(s)" in out and "iterations" in out and "modle: unknown key" in out and "pipeline.params.n" in out
    assert "Traceback" not in out


def test_validate_ok_and_set_overrides(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", "--set", "pipeline.params.n=4", "--set", "iterations=3"])
    assert result.exit_code == 0, result.output
    assert "OK" in result.output and "rollout" in result.output
    result = runner.invoke(app, ["validate", "--set", "iterations"])
    assert result.exit_code == 2 and "expected key=value" in result.output


def test_run_missing_file_and_missing_model_path(tmp_path: Path, tiny_config: dict[str, Any]) -> None:
    result = runner.invoke(app, ["run", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2 and "file not found" in result.output
    tiny_config["model"]["path"] = str(tmp_path / "no-model")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    result = runner.invoke(app, ["run", str(path), "--no-progress"])
    assert result.exit_code == 2 and "model.path" in result.output and "no config.json" in result.output
    assert "Traceback" not in result.output


def test_graph_draws_a_png(tmp_path: Path) -> None:
    out = tmp_path / "dag.png"
    config = Path(__file__).parents[1] / "configs" / "grpo_arithmetic.yaml"
    result = runner.invoke(app, ["graph", str(config), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_malformed_set_value_is_a_clear_error() -> None:
    result = runner.invoke(app, ["validate", "--set", "name=[oops"])
    assert result.exit_code == 2 and "--set name=[oops" in result.output and "not valid YAML" in result.output
    assert "Traceback" not in result.output


def test_validate_does_not_import_heavy_libraries() -> None:
    code = (
        "import sys; from plexrl.cli import app; from plexrl.job.load import load_job; load_job(None); "
        "heavy = [m for m in ('torch', 'transformers', 'mlflow', 'vllm') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_validate_refuses_a_job_the_server_refuses_for_its_size(tmp_path: Path) -> None:
    """`plexrl validate` applies the server's size checks at submission (`job_problems` on the job's footprint):
    a 1 TiB KV cache is refused naming the field and the limit, against `plexrl serve`'s defaults or the limits
    of a server config given with --server, exactly as that server refuses it."""
    from plexrl.job.footprint import footprint
    from plexrl.job.load import load_job
    from plexrl.server.limits import JobLimits, job_problems, reward_timeouts

    huge = ["--set", "engine=vllm", "--set", f"vllm.kv_cache_mb={1 << 20}"]
    loaded = load_job(None, huge[1::2])
    server_says = job_problems(footprint(loaded), JobLimits(), reward_timeouts(loaded.config.model_dump()))
    assert [p.where for p in server_says] == ["vllm.kv_cache_mb"]  # the server refuses it

    result = runner.invoke(app, ["validate", *huge])
    assert result.exit_code == 2, result.output
    assert "vllm.kv_cache_mb" in result.output and "limits.max_kv_cache_bytes" in result.output
    assert "default limits of `plexrl serve`" in result.output and "Traceback" not in result.output

    small = ["--set", "engine=vllm", "--set", "vllm.kv_cache_mb=64"]
    assert runner.invoke(app, ["validate", *small]).exit_code == 0
    server = tmp_path / "server.yaml"
    server.write_text("port: 8765\nlimits: {max_kv_cache_bytes: 32MiB}\n")
    result = runner.invoke(app, ["validate", *small, "--server", str(server)])
    assert result.exit_code == 2 and "limits.max_kv_cache_bytes" in result.output and str(server) in result.output
