"""benchmarks/multiplex_lora.py: LoRA jobs over one shared base (a shortened copy of the real SmolLM2) on one
service against each alone. Its smoke run (2 jobs, a 1-layer copy, 1 iteration) reaches its report: every
job's slowdown and the throughput ratio printed next to their bounds, and the base is loaded once for the
mix (the figures themselves mean nothing at this size)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_lora_mix_smoke_prints_slowdowns_and_throughput_next_to_their_bounds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    threads = torch.get_num_threads()
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("bench_multiplex_lora", BENCHMARKS / "multiplex_lora.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    try:
        module.main(["--smoke"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "/ time-slicing+base: cost" in out, out  # an OpenRL job's base moves counted into time-slicing
    assert re.search(r"lora-0 +1 +[\d.]+ +[\d.]+ +[\d.]+", out) and re.search(r"lora-1 +1 ", out), out
    ratio = re.search(r"multiplexed / alone = ([\d.]+)x \(goal >= 2.5x\), bound ([\d.]+)x", out)
    assert ratio is not None, out
    assert float(ratio.group(1)) > 0 and float(ratio.group(2)) > 0
    assert re.search(r"largest slowdown [\d.]+ \(goal <= 1.5\), bound [\d.]+", out), out
    # the device holds the base and ONE adapter state: the jobs' switches move adapters (megabytes), not the base
    moved = re.search(r"swaps: (\d+) MiB moved", out)
    assert moved is not None and 0 < int(moved.group(1)) < 20, out
