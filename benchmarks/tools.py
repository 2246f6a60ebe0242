"""Latency and throughput of tool calls, side by side in one run: the calculator, the sandboxed python tool
alone (with and without its hardening), a code_unit_tests verdict, and the python tool while the CPU pool is
busy.

* calculator: `--calc-calls` sequential calls of a small expression, median and p99 latency;
* python (idle machine): `--calls` sequential calls of `print(1)`, median and p99 latency; each call is a
  fresh sandbox (launcher process, namespaces, read-only root, rlimits, keyring, seccomp filter, then a new
  Python interpreter). The cost of the hardening is printed side by side: the same calls without the
  seccomp filter and, with `--before REV`, with the launcher of git revision REV (e.g. the commit before
  the hardening), the configurations taking turns call by call so that load drifts hit them alike;
* code_unit_tests: one sample with 4 input/output cases, scored outside the sandbox (harness + comparison);
* throughput: python calls per second from a pool of `--concurrency` threads for `--seconds`, first with the
  machine otherwise idle, then with `--burners` processes spinning on the CPU (the busy CPU pool of a job
  whose other operators are computing). Reported: calls/s idle, calls/s busy, their ratio, and the latency
  of the busy calls.

The sandbox's isolation on this machine is printed first: without namespaces the numbers are not comparable.

    .venv/bin/python benchmarks/tools.py [--calls 100] [--concurrency 4] [--seconds 6] [--burners N] [--before REV]
        [--smoke]

`--smoke`: 2 calls of each kind, 0.3 s throughput phases with one thread and one burner (the test suite runs
it; a few seconds).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import plexrl.tools.sandbox as sandbox_module
from plexrl.tools import Calculator, PythonTool, Sandbox, ToolResult
from plexrl.tools.sandbox import SandboxLimits
from plexrl.verifiers import code_unit_tests, unit_tests


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latencies(call: Callable[[], ToolResult], n: int) -> list[float]:
    out = []
    for _ in range(n):
        result = call()
        if not result.ok:
            raise SystemExit(f"tool call failed: {result.error}")
        out.append(result.latency_s)
    return out


def side_by_side(configs: dict[str, tuple[Sandbox, Path]], n: int) -> dict[str, list[float]]:
    """`n` calls of `print(1)` per configuration (a sandbox and the launcher it runs), taking turns."""
    out: dict[str, list[float]] = {name: [] for name in configs}
    default = sandbox_module.LAUNCHER
    try:
        for _ in range(n):
            for name, (box, launcher) in configs.items():
                sandbox_module.LAUNCHER = launcher
                started = time.perf_counter()
                result = box.run("print(1)")
                out[name].append(time.perf_counter() - started)
                if not result.ok:
                    raise SystemExit(f"{name}: sandbox call failed: {result.error}")
    finally:
        sandbox_module.LAUNCHER = default
    return out


def launcher_at(rev: str, into: Path) -> Path:
    """The launcher script of git revision `rev`, written under `into`."""
    source = subprocess.run(
        ["git", "show", f"{rev}:plexrl/tools/_launcher.py"], check=True, capture_output=True, text=True
    ).stdout
    path = into / "_launcher_before.py"
    path.write_text(source)
    return path


def throughput(tool: PythonTool, concurrency: int, seconds: float) -> tuple[float, list[float]]:
    """Calls per second of `print(1)` from `concurrency` threads calling back to back for `seconds`."""
    deadline = time.perf_counter() + seconds

    def worker(_: int) -> list[float]:
        done = []
        while time.perf_counter() < deadline:
            result = tool.execute("bench", {"code": "print(1)"})
            if not result.ok:
                raise RuntimeError(result.error)
            done.append(result.latency_s)
        return done

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        per_thread = list(pool.map(worker, range(concurrency)))
    elapsed = time.perf_counter() - started
    calls = [latency for thread in per_thread for latency in thread]
    return len(calls) / elapsed, calls


def row(name: str, values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return f"{name:<50} {len(ms):>6} {statistics.median(ms):>10.2f} {percentile(ms, 0.99):>10.2f}"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=100, help="sequential python-tool calls for latency")
    ap.add_argument("--calc-calls", type=int, default=2000, help="sequential calculator calls for latency")
    ap.add_argument("--concurrency", type=int, default=4, help="threads calling the python tool at once")
    ap.add_argument("--seconds", type=float, default=6.0, help="duration of each throughput phase")
    ap.add_argument("--burners", type=int, default=os.cpu_count() or 1, help="CPU-spinning processes when busy")
    ap.add_argument("--before", help="git revision whose launcher to compare with (e.g. the commit before hardening)")
    ap.add_argument("--smoke", action="store_true", help="a few calls, short phases (for the tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.calls, args.calc_calls, args.concurrency, args.seconds, args.burners = 2, 20, 1, 0.3, 1
    logging.basicConfig(level=logging.ERROR)  # the unfiltered sandbox warns that it is degraded: on purpose here

    python, calculator = PythonTool(timeout_s=10), Calculator()
    print(f"sandbox isolation: {python.sandbox.isolation.summary()}")
    print(f"machine: {os.cpu_count()} cores; python {sys.version.split()[0]}")
    calc = latencies(lambda: calculator.execute("bench", {"expression": "(17 * 23 + 4) ** 3 / 7"}), args.calc_calls)
    latencies(lambda: python.execute("bench", {"code": "print(1)"}), min(5, args.calls))  # warm-up: page cache, imports
    limits = SandboxLimits(timeout_s=10)
    with tempfile.TemporaryDirectory() as scratch:
        configs = {
            "hardened (all, seccomp filter)": (python.sandbox, sandbox_module.LAUNCHER),
            "without the seccomp filter": (Sandbox(limits, syscall_filter=False), sandbox_module.LAUNCHER),
        }
        if args.before:
            configs[f"launcher of {args.before}"] = (
                Sandbox(limits, syscall_filter=False),
                launcher_at(args.before, Path(scratch)),
            )
        compared = side_by_side(configs, args.calls)
    py = compared["hardened (all, seccomp filter)"]
    cases = unit_tests("f", [((x,), 3 * x + 1) for x in range(4)])
    verdicts = []
    for _ in range(max(args.calls // 4, 1 if args.smoke else 5)):
        started = time.perf_counter()
        if code_unit_tests(["def f(x):\n    return 3 * x + 1"], [cases]) != [1.0]:
            raise SystemExit("code_unit_tests failed on a correct program")
        verdicts.append(time.perf_counter() - started)
    idle_rate, _ = throughput(python, args.concurrency, args.seconds)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    try:
        busy_rate, busy = throughput(python, args.concurrency, args.seconds)
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()

    print(f"\n{'latency':<50} {'calls':>6} {'median ms':>10} {'p99 ms':>10}")
    print(row("calculator", calc))
    for name, values in compared.items():
        print(row(f"python print(1), {name}", values))
    hardened = statistics.median(py)
    for name, values in compared.items():
        if values is not py:
            delta = (hardened - statistics.median(values)) * 1000
            print(f"  hardened - {name}: {delta:+.1f} ms per call (median)")
    print(row("code_unit_tests, 1 sample x 4 cases", verdicts))
    print(row(f"python print(1), {args.burners} burners, x{args.concurrency}", busy))
    print(f"\n{'python throughput':<34} {'calls/s':>10}")
    print(f"{f'idle, {args.concurrency} threads':<34} {idle_rate:>10.1f}")
    print(f"{f'busy ({args.burners} burners), {args.concurrency} threads':<34} {busy_rate:>10.1f}")
    print(f"ratio busy / idle = {busy_rate / idle_rate:.2f}")
    print(f"ratio python / calculator median latency = {statistics.median(py) / statistics.median(calc):.0f}x")


if __name__ == "__main__":
    main()
