"""Runs the loop of docs/tutorial-your-loop.md as written, through the tinker SDK, against `plexrl serve` on a
tiny model (the real SmolLM2 tokenizer) for two steps."""

from __future__ import annotations

import os
import re
import types
from pathlib import Path

import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
pytest.importorskip("tinker")

from plexrl.server.api import start_server
from plexrl.server.config import ServerConfig

DOC = Path(__file__).parents[1] / "docs" / "tutorial-your-loop.md"


def the_loop() -> types.ModuleType:
    (body,) = re.findall(r"```python\n# file: rl_loop.py\n(.*?)```", DOC.read_text(), flags=re.S)
    module = types.ModuleType("rl_loop")
    exec(compile(body, str(DOC), "exec"), module.__dict__)
    return module


def test_the_tutorial_loop_runs_on_a_server(tmp_path: Path, smol_tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ServerConfig(
        port=0, journal=str(tmp_path / "journal.db"), run_dir=str(tmp_path / "runs"), mlflow=False,
        cluster={"driver": "local", "services": {"count": 1}}, allowed_roots=[str(tmp_path), str(smol_tiny.parent)],
    )  # fmt: skip
    srv = start_server(cfg)
    monkeypatch.setenv("TINKER_API_KEY", "tml-ann")
    try:
        accuracy = the_loop().main([
            "--base-url", srv.url, "--base-model", str(smol_tiny), "--steps", "2", "--batch", "2", "--group", "2",
            "--max-tokens", "4", "--rank", "4", "--held-out", "3",
        ])  # fmt: skip
        sessions = [e for e in srv.journal.jobs() if e.config.get("kind") == "session"]
    finally:
        srv.stop(120)
    assert 0.0 <= accuracy <= 1.0
    assert len(sessions) == 1 and sessions[0].user == "ann" and sessions[0].iterations_done >= 6
