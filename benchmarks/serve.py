"""Server load: N tiny jobs submitted at once to a real `plexrl serve` (a separate process, its default
driver: a local Dask cluster with 2 services), while this client polls `GET /jobs/{id}` and `GET /jobs` until
every job has ended. Prints the submit, status and list latencies (p50 / p99 / max) and the wall time.
Goal: status p99 < 200 ms.

    .venv/bin/python benchmarks/serve.py [--jobs 50] [--iterations 4] [--smoke]

`--smoke`: 2 jobs of 1 iteration (the test suite runs it; the server's start-up dominates).

Runs in a temporary directory (its own journal, run dir and MLflow store). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import _tiny
import yaml

from plexrl.server.client import Client

# the tiny job of every benchmark's smoke mode, on `engine: auto` with the machine's threads and MLflow on (a
# user's defaults); each job runs `--iterations`
TINY_JOB = {k: v for k, v in _tiny.TINY_JOB.items() if k not in ("engine", "threads", "iterations")}
TINY_JOB["tracking"] = {"progress": False, "log_model": False}


def quantile_ms(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 1)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="2 jobs of 1 iteration (for the tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.jobs, args.iterations = 2, 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        job = {**TINY_JOB, "iterations": args.iterations}
        if args.smoke:  # no MLflow store, no vLLM, and a client that leaves the 2 cores to the server
            job["tracking"] = {**TINY_JOB["tracking"], "mlflow": False}
            job["engine"] = "torch"  # no vLLM import
        (work / "job.yaml").write_text(yaml.safe_dump(job))
        server = subprocess.Popen(
            [sys.executable, "-m", "plexrl.cli", "serve", "--port", "0", "--set", "journal=runs/journal.db",
             "--set", "run_dir=runs", "--set", "cluster.services.count=2"],
            cwd=work, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert server.stdout is not None
            client = Client(server.stdout.readline().split()[4])
            t0 = time.perf_counter()
            submit, ids = [], []
            for i in range(args.jobs):
                s = time.perf_counter()
                ids.append(client.submit(work / "job.yaml", [f"seed={i % 2}"])["job_id"])
                submit.append(time.perf_counter() - s)
            status: list[float] = []
            listing: list[float] = []
            while True:
                s = time.perf_counter()
                client.status(ids[len(status) % len(ids)])
                status.append(time.perf_counter() - s)
                s = time.perf_counter()
                rows = client.jobs()
                listing.append(time.perf_counter() - s)
                if all(r["status"] in ("done", "failed", "cancelled") for r in rows):
                    break
                if args.smoke:
                    time.sleep(0.02)
            wall = time.perf_counter() - t0
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(120)
            if server.stdout is not None:
                server.stdout.close()
    result = {
        "jobs": args.jobs, "done": sum(r["status"] == "done" for r in rows), "wall_s": round(wall, 1),
        "submit_ms_p50": quantile_ms(submit, 0.5), "submit_ms_max": round(max(submit) * 1000, 1),
        "status_calls": len(status), "status_ms_p50": quantile_ms(status, 0.5),
        "status_ms_p99": quantile_ms(status, 0.99), "status_ms_max": round(max(status) * 1000, 1),
        "list_ms_p50": quantile_ms(listing, 0.5), "list_ms_p99": quantile_ms(listing, 0.99),
    }  # fmt: skip
    print(json.dumps(result))
    verdict = "meets" if result["status_ms_p99"] < 200 else "BELOW"
    print(f"status p99 {result['status_ms_p99']} ms ({verdict} the < 200 ms goal)")
    if result["done"] != args.jobs:
        raise SystemExit(f"only {result['done']} of {args.jobs} jobs ended done")


if __name__ == "__main__":
    main()
