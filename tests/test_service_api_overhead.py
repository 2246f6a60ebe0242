"""benchmarks/service_api.py's overhead part compares its two arms fairly: both are set up first, then their
steps alternate (in-process step k, then the same step through the SDK), so a load that drifts during the run
(the machine is shared) slows both alike; the table reads each arm's own calls. The arms are fakes here: the
test checks the order of the work and the arithmetic, not a server (the smoke run covers that)."""

from __future__ import annotations

import argparse
import importlib.util
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _module(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("bench_service_api_overhead", BENCHMARKS / "service_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_arms_steps_alternate_and_each_is_read_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sa = _module(monkeypatch)
    order: list[str] = []
    seconds = {"in-process": 1.0, "sdk": 1.5}

    class Arm:
        name = ""

        def __init__(self, *args: Any) -> None:
            self.times: dict[str, list[float]] = defaultdict(list)
            order.append(f"{self.name} up")

        def step(self, step: int) -> None:
            order.append(f"{self.name} {step}")
            for kind in ("save_for_sampler", "sample", "sample", "forward_backward", "optim_step"):
                self.times[kind].append(seconds[self.name] * (10 if step == 0 else 1))  # (a slow warm-up)

        def close(self) -> None:
            order.append(f"{self.name} closed")

    class Local(Arm):
        name = "in-process"

    class Remote(Arm):
        name = "sdk"

    class Server:
        url = "http://127.0.0.1:1"

        def stop(self, timeout: float) -> bool:
            order.append("server stopped")
            return True

    monkeypatch.setattr(sa, "InProcess", Local)
    monkeypatch.setattr(sa, "ThroughSDK", Remote)
    monkeypatch.setattr(sa, "tiny_smol", lambda out: out)
    monkeypatch.setattr(sa, "server", lambda *a, **k: Server())
    args = argparse.Namespace(smoke=True, steps=3, prompts=2, group=2, tokens=4, driver="local", layers=1)
    sa.overhead(args, tmp_path)

    assert order == ["in-process up", "sdk up", "in-process 0", "sdk 0", "in-process 1", "sdk 1", "in-process 2",
                     "sdk 2", "in-process closed", "sdk closed", "server stopped"]  # fmt: skip
    out = capsys.readouterr().out
    assert "| sample | 4 | 1.0000 | 1.5000 | 1.50 | 500.0 |" in out  # the warm-up step left out
    assert "ratio sdk / in-process (all calls): 1.50 (5.000 s more over 15 calls)" in out
