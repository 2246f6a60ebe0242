"""Placeholder: replaced by the real sandbox in the next commit."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass(slots=True)
class SandboxResult:
    """Outcome of one sandboxed run."""

    ok: bool
    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None
    timed_out: bool
    truncated: bool
    wall_s: float


class Sandbox:
    """Runs Python code in a separate process (placeholder without isolation)."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s

    def run(self, code: str) -> SandboxResult:
        """Run `code`; never raises on hostile code."""
        t0 = time.perf_counter()
        try:
            cmd = [sys.executable, "-I", "-c", code]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            return SandboxResult(False, "", "", None, "timed out", True, False, time.perf_counter() - t0)
        ok = p.returncode == 0
        err = None if ok else f"exited with status {p.returncode}"
        return SandboxResult(ok, p.stdout, p.stderr, p.returncode, err, False, False, time.perf_counter() - t0)
