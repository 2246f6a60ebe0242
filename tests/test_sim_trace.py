"""Trace replay with the rollout fleet inside the cluster and isolated allocations sized as a user would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from plexrl.errors import ConfigError
from plexrl.runtime.sim import GB
from plexrl.sim.config import Trace, parse_sim
from plexrl.sim.costs import SampledCosts
from plexrl.sim.trace import allocation, alone_seconds, arrivals, load_sweep, run_policy, trace_jobs

SIM = Path(__file__).resolve().parents[1] / "configs" / "sim"


def trace(**changes: Any) -> Trace:
    raw = yaml.safe_load((SIM / "trace_3months.yaml").read_text())
    for c in raw["classes"]:
        c["steps_median"] = 30
        c["workload"].update(prompts=32, samples=4)
    raw.update({"jobs": 12, "days": 0.05, "burst": 0.0, "rollout_samples": 4, "steps_per_node": 5, **changes})
    tr = parse_sim(raw, "test")
    assert isinstance(tr, Trace)
    return tr


def test_the_rollout_fleet_is_inside_the_cluster_and_bounds_placement() -> None:
    tr = trace(cluster_accelerators=2048, rollout_fleet=1024, service_accelerators=64)
    assert tr.services == 16  # (2,048 - 1,024) / 64
    with pytest.raises(ConfigError, match="cannot hold one job's rollout"):
        trace(rollout_fleet=32)  # code-32b needs 64
    roomy = run_policy(tr, "spread+backfill")
    tight = run_policy(trace(cluster_accelerators=1088, rollout_fleet=64, service_accelerators=64), "spread+backfill")
    assert tight.fleet_peak <= 64 < roomy.fleet_peak  # the gate holds; without it the fleet use is larger
    assert max(tight.queue.values()) > 0 and max(roomy.queue.values()) == 0.0
    assert tight.makespan > roomy.makespan


def test_isolated_books_user_sized_allocations_first_come_first_served() -> None:
    tr = trace(cluster_accelerators=320, rollout_fleet=128, service_accelerators=64)
    cls = {a.job_id: tr.classes[a.cls] for a in arrivals(tr)}
    iso = run_policy(tr, "isolated")
    jobs, when = trace_jobs(tr, isolated=True)
    costs = SampledCosts(tr.seed, tr.accelerator.host_gbps * GB, tr.accelerator.disk_gbps * GB)
    span = {}
    for job in jobs:
        start = when[job.job_id] + iso.queue[job.job_id]
        span[job.job_id] = (start, start + alone_seconds(job, costs), allocation(tr, cls[job.job_id]))
        assert span[job.job_id][2] == cls[job.job_id].train_accelerators + cls[job.job_id].rollout_accelerators
    order = sorted(span, key=lambda j: (when[j], j))
    assert [span[j][0] for j in order] == sorted(span[j][0] for j in order)  # nobody overtakes an earlier arrival
    assert max(iso.queue.values()) > 0
    for t, _, _ in span.values():  # at every start, the allocations running fit in the cluster
        assert sum(n for s, e, n in span.values() if s <= t < e) <= tr.cluster_accelerators
    assert iso.makespan == pytest.approx(max(e for _, e, _ in span.values()) - min(when.values()))


def test_the_makespan_ratio_moves_with_the_load() -> None:
    tr = trace(cluster_accelerators=640, rollout_fleet=384, service_accelerators=64, jobs=8)
    ratios = dict(load_sweep(tr, [0.5, 2.0]))
    assert ratios[2.0] < ratios[0.5]  # the more loaded the cluster, the more sharing gains over isolated
