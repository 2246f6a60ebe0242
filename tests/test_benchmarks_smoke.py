"""Every script in benchmarks/ has a `--smoke` mode, and the test suite runs it, so that none can rot.

A smoke run exercises the script's whole code path on tiny jobs (`benchmarks/_tiny.py`) in seconds; its
figures mean nothing, only that it ran to the end and printed its headline line. Each runs in this process
(`main(["--smoke"])`): a subprocess would pay torch's import every time. Three are run by the tests of what
they measure (SMOKED_ELSEWHERE); a test checks that those tests still exist.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"

# benchmark -> what its smoke run must print (the headline: the run reached its end); one not listed here is
# still run, and must print something and not raise
EXPECTED = {
    "algorithms": "| algorithm | held-out accuracy before |",
    "calibrate": "largest error",
    "chunks": "largest slowdown of the other jobs",
    "client_bytes": "client bytes/iteration",
    "dask_overhead": "ratio dask / in-process",
    "engine_choice": "vLLM / torch time",
    "fresh_memory": "fresh / touched:",
    "multiplex": "/ time-slicing: cost",  # the time-slicing arm ran beside the default ordering
    "multiplex_agentic": "/ time-slicing+base: cost",  # PlexRL against time-slicing with the base moves
    "multiplex_real": "state moves against the memory-copy bound",
    "pipeline_overhead": "ratio plexrl / hand",
    "real_model": "seeds at >= 85% within 20 minutes",
    "rollout": "wrapper/raw",
    "serve": "status p99",
    "service_api": "ratio sdk / in-process",
    "swap": "memory bandwidth (one reused buffer, copy_)",
    "tinker_flood": "bound of a flooded call",
    "tinker_sessions": "total steps/s together / alone (samples batched)",
    "tools": "ratio busy / idle",
    "warm_start": "slowest seed's steps to",
}
SMOKED_ELSEWHERE = {
    "planner": ("tests/test_sim.py", "test_benchmark_smoke_prints_dispatch_rates"),
    "simulate": ("tests/test_simulate.py", "test_simulate_benchmark_smoke"),
    "sim_layouts": ("tests/test_simulate.py", 'load_benchmark("sim_layouts"'),
    "multiplex_lora": ("tests/test_multiplex_lora.py", '"/ time-slicing+base: cost" in out'),
}


def scripts() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def load(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Import benchmarks/NAME.py as a module, with benchmarks/ on sys.path (for `_tiny`), as a script sees it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_has_a_smoke_mode_that_a_test_runs() -> None:
    names = scripts()
    assert len(names) >= 13
    for name in names:
        source = (BENCHMARKS / f"{name}.py").read_text()
        assert '"--smoke"' in source, f"benchmarks/{name}.py has no --smoke mode"
        assert "def main(argv: " in source, f"benchmarks/{name}.py: main(argv) lets the tests pass --smoke"
    assert set(EXPECTED) <= set(names), "EXPECTED names a benchmark that is gone"
    for path, marker in SMOKED_ELSEWHERE.values():
        assert marker in (ROOT / path).read_text(), f"{path} no longer runs its benchmark's smoke mode"


@pytest.fixture
def torch_threads() -> Any:
    """Benchmarks set torch's thread count for their model work; later tests get it back."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# Start a process and pay its imports (Dask workers, a server, vLLM's import and engine start): 15-60 s each on
# 2 shared cores, the rest a few seconds. `-m "not slow"` leaves them out.
SLOW = {
    "client_bytes", "dask_overhead", "engine_choice", "rollout", "serve", "service_api", "tinker_flood",
    "tinker_sessions",
}  # fmt: skip
NEEDS_VLLM = {"engine_choice", "rollout"}
# A Dask cluster started while another process on the machine holds one of distributed's default HTTP ports:
# distributed warns, takes another port, and leaks the socket of the failed bind (its bug, not ours).
DASK_PORT_CLASH = [
    pytest.mark.filterwarnings("ignore:Port .* is already in use:UserWarning"),
    pytest.mark.filterwarnings("ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"),
]


def params() -> list[Any]:
    """Every benchmark not smoked elsewhere (a new one is picked up here with no edit: it runs as a script, in a
    subprocess, and counts as slow until it is listed in EXPECTED)."""
    out = []
    for name in [n for n in scripts() if n not in SMOKED_ELSEWHERE]:
        marks = [pytest.mark.slow] if name in SLOW or name not in EXPECTED else []
        if name in ("client_bytes", "dask_overhead"):
            marks += DASK_PORT_CLASH
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", params())
def test_smoke(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], torch_threads: Any
) -> None:
    if name in NEEDS_VLLM:
        from plexrl.engines.vllm_engine import vllm_installed

        if not vllm_installed():
            pytest.skip("vLLM is not installed (make setup-vllm)")
    monkeypatch.chdir(ROOT)
    if name in EXPECTED:
        load(name, monkeypatch).main(["--smoke"])
        out = capsys.readouterr().out
    else:  # not vetted for running in this process (it may spawn processes that re-import its __main__)
        script = [sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke"]
        done = subprocess.run(script, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        out = done.stdout
    assert EXPECTED.get(name, "") in out, out[-2000:]
    assert out.strip(), "a smoke run printed nothing"


def test_multiplex_reports_slowdowns_and_cost_against_both_baselines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The summary's arithmetic on hand-made repetitions: cost per step = wall / steps per arm, the ratio
    multiplexed / lean and / isolated, and each job's slowdown as mean +- sd over the repetitions."""
    mux = load(name="multiplex", monkeypatch=monkeypatch)

    def rep(lean: float, iso: float, done: float) -> Any:
        arm = {j: mux.Alone(lean, 10, "done", 0.1) for j in ("a", "b")}
        isolated = {j: mux.Alone(iso, 10, "done", 0.1) for j in ("a", "b")}
        hrrs = mux.Mux({"a": done, "b": done}, {"a": 0.1, "b": 0.1}, done / 20, ["done", "done"])
        slow = mux.Mux({"a": done / 2, "b": done}, {"a": 0.1, "b": 0.1}, done / 10, ["done", "done"])
        return mux.Rep(arm, isolated, {"hrrs": hrrs, "slowdown": slow})

    reps = [rep(10.0, 20.0, 15.0), rep(10.0, 20.0, 25.0)]
    assert reps[0].cost_per_step(reps[0].lean) == 1.0 and reps[0].cost_per_step(reps[0].iso) == 2.0
    mux.summarize(reps, "dask-iso")
    out = capsys.readouterr().out
    # mux acc-s/step 0.75 and 1.25 against lean 1.0 -> ratio 1.0 +- 0.354; against isolated 2.0 -> 0.5 +- 0.177
    assert "multiplexed / lean     = 1.000 +- 0.354 [0.750, 1.250]" in out
    assert "multiplexed / dask-iso = 0.500 +- 0.177 [0.375, 0.625]" in out
    assert "largest slowdown vs lean 2.000 +- 0.707 [1.500, 2.500]" in out
    # bounds from the lean arm: 0.1 s of service per iteration x 10 steps per job -> 2 s over 20 steps
    assert "bounds: cost >= 0.100 +- 0.000 [0.100, 0.100] acc-s/step" in out
    assert "= 0.100 +- 0.000 [0.100, 0.100] of lean; slowdown >= 1.000 +- 0.000 [1.000, 1.000]" in out
    assert "measured / bound: cost 10.000 +- 3.536 [7.500, 12.500] (goal <= 1.05)" in out
    # each ordering is summarized on its own, against the same lean and isolated arms
    hrrs, slow = out.split("ordering slowdown")
    assert "ordering hrrs" in hrrs and "multiplexed / lean     = 1.000" in hrrs
    assert "multiplexed / lean     = 2.000 +- 0.707 [1.500, 2.500]" in slow
    assert mux.spread([0.5]) == "0.500"


def span(job: str, node: str, lane: str, start: float, end: float, kind: str = "node") -> Any:
    from plexrl.hooks.timeline import Span

    return Span(job, 0, node, lane, start, end, kind)


def test_idle_seconds_are_named_by_what_the_jobs_ran_off_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    """service busy 0-1 and 4-5; job a's tools run 1-3 and job b's verify 2-3.5: idle 1-2 is `tools`, 2-3
    `tools+verify`, 3-3.5 `verify`, 3.5-4 nothing running."""
    arms = load("_arms", monkeypatch)
    spans = [
        span("a", "turn0", "service-0", 0.0, 1.0),
        span("a", "tools0", "cpu", 1.0, 3.0),
        span("b", "verify", "cpu", 2.0, 3.5),
        span("b", "train", "service-0", 4.0, 4.5),
        span("b", "train", "service-0", 4.4, 5.0, "swap"),
    ]
    idle = arms.idle_reasons(spans)
    assert idle == pytest.approx({"tools": 1.0, "tools+verify": 1.0, "verify": 0.5, "nothing running": 0.5})
    assert arms.format_idle(idle, top=2) == "3.0 s: tools 1.0 s, tools+verify 1.0 s, other 1.0 s"
    assert arms.switches(spans) == [("a", "b", 4.0)] and arms.job_ends(spans) == {"a": 3.0, "b": 5.0}


def test_an_openrl_job_pays_its_base_out_and_in_at_each_of_its_hand_overs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand-overs lora -> full at 2 s and full -> lora at 5 s, base out 0.5 s, in 1.0 s: the makespan grows by
    1.5 s, the full job (last span at 4 s) finishes 0.5 s later, the LoRA job (last span at 9 s) 1.5 s later."""
    openrl = load("_openrl", monkeypatch)
    mux = load("multiplex", monkeypatch)
    run = mux.Mux({"lora": 10.0, "full": 4.0}, {}, 1.0, ["done", "done"], hand_overs=[(0.1, 0.2), (0.1, 0.2)],
                  duty=0.8, switches=[("lora", "full", 2.0), ("full", "lora", 5.0)],
                  ends={"lora": 9.0, "full": 4.0}, makespan=10.0)  # fmt: skip
    moves = {100: openrl.BaseMove(100, 0.5, 1.0, 0.25)}
    out = openrl.with_base_moves(run, {"lora": 100}, moves)
    assert out.makespan == 11.5 and out.cps == pytest.approx(1.15) and out.duty == pytest.approx(0.8 / 1.15)
    assert out.completion == {"lora": 11.5, "full": 4.5}
    assert out.hand_overs == [(0.6, 0.7), (1.1, 1.2)] and out.swap[0] == 1.5 and out.swap[3] == 200
    assert openrl.with_base_moves(run, {"lora": 100}, moves, bound=True).makespan == 10.5
    assert "1 out + 1 in over 2 hand-overs" in openrl.base_line(run, {"lora": 100}, moves)


def test_the_timed_tool_waits_its_drawn_seconds_in_the_sandbox() -> None:
    from plexrl.job.tasks.timed_calls import TimedPythonExpression, wait_seconds

    waits = [wait_seconds(f"{i}*7", 0.5, 3.0) for i in range(200)]
    assert all(0.5 <= w <= 3.0 for w in waits) and max(waits) - min(waits) > 2.0
    assert wait_seconds("12*7", 0.5, 3.0) == wait_seconds("12*7", 0.5, 3.0)  # the same call waits as long
    with pytest.raises(ValueError, match="min_s <= max_s"):
        TimedPythonExpression(min_s=2.0, max_s=1.0)
    result = TimedPythonExpression(min_s=0.3, max_s=0.3).execute("e", {"expression": "347*58"})
    assert result.ok and result.output == "20126" and result.latency_s >= 0.3, result
