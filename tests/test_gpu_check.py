"""The GPU check's pieces that run without a GPU: the script parses, refuses unknown options with its usage,
and the copy-stream benchmark runs its CPU path with the state unchanged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_gpu_check_script_parses_and_names_its_usage() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    bad = subprocess.run(["bash", str(SCRIPT), "nonsense"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage: bash benchmarks/gpu_check.sh prepare" in bad.stderr


def test_gpu_overlap_runs_on_cpu_and_leaves_the_state_unchanged() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_overlap.py"), "--smoke"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "state checksum after the swaps: unchanged" in out.stdout
    assert "share of the swap hidden behind compute:" in out.stdout
