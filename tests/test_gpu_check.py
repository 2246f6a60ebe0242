"""The GPU check without a GPU: the script parses and refuses unknown options with its usage, its whole dry run
(`run --cpu`: every part's code on the CPU with a tiny model) passes, and the copy-stream benchmark runs its
CPU path with the state unchanged. So the first run on a GPU finds a script that runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
PARTS = ["build", "env", "race", "bf16", "lora", "nccl1", "mux", "sessions", "tests"]


def test_gpu_check_script_parses_and_names_its_usage() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    bad = subprocess.run(["bash", str(SCRIPT), "nonsense"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage: bash benchmarks/gpu_check.sh prepare" in bad.stderr
    bad = subprocess.run(["bash", str(SCRIPT), "run", "--bogus"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr


def test_the_whole_check_dry_runs_on_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_PYTHON": sys.executable,
           "GPU_CHECK_SITE": str(tmp_path / "site"), "GPU_CHECK_WORK": str(tmp_path / "work"),
           "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels")}  # fmt: skip
    env.pop("PYTHONPATH", None)
    res = subprocess.run(["bash", str(SCRIPT), "run", "--cpu"], capture_output=True, text=True, timeout=900, env=env)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert res.returncode == 0, summary
    for part in PARTS:
        assert f"   {part}: ok" in summary, summary
    assert "ok: every host copy equals the state after a full synchronize" in summary
    assert "ok: gloo group of 1 on cpu: init, fully_shard, train" in summary
    assert "the simulator's swap constants from these records:" in (tmp_path / "out" / "mux.log").read_text()
    assert (tmp_path / "out" / "mux-moves.json").is_file()  # the records travel back
    assert "together / alone:" in summary and "(bound 2x; goal >= 3x at 8 sessions)" in summary
    assert "gpu_check: 0 part(s) not ok" in summary


def test_gpu_overlap_runs_on_cpu_and_leaves_the_state_unchanged() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_overlap.py"), "--smoke"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "state checksum after the swaps: unchanged" in out.stdout
    assert "share of the swap hidden behind compute:" in out.stdout


def _fake_python(path: Path, log: Path) -> Path:
    """An executable that records that it was called, then fails (so `run` stops at the install)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{path.name} $*" >> "{log}"\nexit 1\n')
    path.chmod(0o755)
    return path


def test_run_uses_the_projects_venv_unless_gpu_check_python_says_otherwise(tmp_path: Path) -> None:
    """`run` takes `.venv/bin/python` of the repository when there is one (a development machine, where
    `python3` may have no torch), `GPU_CHECK_PYTHON` over it, and `python3` where neither is (a GPU machine)."""
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "gpu_check.sh").write_text(SCRIPT.read_text())
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "fake-0-py3-none-any.whl").write_text("")
    log = tmp_path / "calls.log"
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_SITE": str(tmp_path / "site"),
           "GPU_CHECK_WORK": str(tmp_path / "work"), "GPU_CHECK_WHEELS": str(wheels)}  # fmt: skip
    env.pop("GPU_CHECK_PYTHON", None)

    def run(**extra: str) -> str:
        log.unlink(missing_ok=True)
        res = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh"), "run", "--cpu"],
                             capture_output=True, text=True, timeout=60, env={**env, **extra})  # fmt: skip
        assert res.returncode == 2 and "installing the carried wheels failed" in res.stderr, res.stderr
        return log.read_text()

    _fake_python(root / ".venv" / "bin" / "python", log)
    assert run().startswith("python -m pip install")
    override = _fake_python(tmp_path / "other" / "py-override", log)
    assert run(GPU_CHECK_PYTHON=str(override)).startswith("py-override -m pip install")
    (root / ".venv" / "bin" / "python").unlink()
    fake_bin = _fake_python(tmp_path / "bin" / "python3", log).parent
    assert run(PATH=f"{fake_bin}:{env['PATH']}").startswith("python3 -m pip install")
