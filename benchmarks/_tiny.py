"""Tiny jobs and clusters for the benchmarks' `--smoke` modes (a helper, not a benchmark: no `main`).

A smoke run exercises a benchmark's whole code path in seconds so that the test suite can run it
(`tests/test_benchmarks_smoke.py`); its figures mean nothing. The job is `tests/conftest.py`'s TINY: a
1-layer model (hidden 32) on 2-digit addition, a 4-step warm start, 4 prompts x 4 samples, torch rollouts.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

TINY_JOB: dict[str, Any] = {
    "name": "tiny",
    "seed": 0,
    "iterations": 2,
    "engine": "torch",
    "threads": 1,
    "model": {"layers": 1, "hidden": 32, "heads": 2, "intermediate": 64},
    "task": {"digits": 2, "train_size": 200, "eval_size": 16},
    "warm_start": {"max_steps": 4, "batch_size": 16, "eval_every": 2, "eval_size": 16, "stop_at_accuracy": 0.9},
    "pipeline": {
        "name": "grpo",
        "params": {
            "batch_size": 4,
            "n": 4,
            "max_new_tokens": 4,
            "eval_every": 2,
            "eval_size": 16,
            "normaliser": {"skip_zero_advantage": False},
        },
    },
    "tracking": {"mlflow": False, "progress": False, "log_model": False},
}


def tiny_job(run_dir: str | Path, **overrides: Any) -> dict[str, Any]:
    """TINY_JOB with its run directory set and top-level keys replaced by `overrides` (a fresh dict)."""
    job = copy.deepcopy(TINY_JOB)
    job.update(run_dir=str(run_dir), **overrides)
    return job


def tiny_cluster_file(run_dir: str | Path, *, driver: str = "dask", jobs: int = 2) -> Path:
    """Write a cluster YAML under `run_dir`: `jobs` tiny jobs (seeds 0, 1, ...; the second waits on a remote
    verifier for 50 ms) on ONE service with 1 torch thread. Returns its path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for i in range(jobs):
        job = tiny_job(run_dir, name=f"tiny-{i}", seed=i)
        if i == 1:
            job["pipeline"]["params"]["verifier_latency_s"] = 0.05
        entries.append({"job": job})
    cluster = {
        "name": "smoke",
        "run_dir": str(run_dir),
        "driver": driver,
        "cpu_threads": 1,
        "services": {"count": 1, "threads": 1},
        "placement": "spread+backfill",
        "max_load": 4.0,
        "mlflow": False,
        "progress": False,
        "jobs": entries,
    }
    path = run_dir / "smoke-cluster.yaml"
    path.write_text("# a tiny cluster for --smoke runs\n" + yaml.safe_dump(cluster, sort_keys=False))
    return path
