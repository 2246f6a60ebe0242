"""A Service carrying out state moves on a real TorchEngine: bytes survive device -> host -> disk -> device,
checksums catch a corrupted copy, prefetch runs in the background, and a disagreement with the planner is
an error, not a silent overwrite."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY

from plexrl.config import load_job
from plexrl.job import JobSpec, prepare_job
from plexrl.planner.state import Move
from plexrl.services.service import Service
from plexrl.services.swap import StateCorrupted


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> JobSpec:
    cfg: dict[str, Any] = copy.deepcopy(TINY)
    cfg["run_dir"] = str(tmp_path_factory.mktemp("svc") / "runs")
    cfg["tracking"]["mlflow"] = False
    cfg["pipeline"]["params"]["kl_coef"] = 0.05  # a reference copy is part of the state too
    return prepare_job(load_job(cfg))


def snapshot(service: Service, job_id: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in service.engines[job_id].state_tensors().items()}


def test_state_round_trip_through_every_tier_is_bit_exact(job: JobSpec, tmp_path: Path) -> None:
    svc = Service("s0", spill_dir=tmp_path / "spill", validate=True)
    nbytes = svc.load_job(job)
    assert nbytes == sum(t.numel() * 4 for t in svc.engines[job.job_id].state_tensors().values())
    assert nbytes <= job.state_bytes()  # the planner's estimate is an upper bound
    names = set(svc.engines[job.job_id].state_tensors())
    assert any(n.startswith("reference.") for n in names) and any(n.startswith("optimizer.") for n in names)
    before = snapshot(svc, job.job_id)
    j = job.job_id
    assert svc.apply([Move(j, "device", "host", 0), Move(j, "host", "disk", 0)]) == 2 * nbytes
    assert (tmp_path / "spill" / f"{j}.safetensors").is_file()
    assert all(t.numel() == 0 for t in svc.engines[j].state_tensors().values())  # device storage freed
    svc.apply([Move(j, "disk", "device", 0)])
    assert not (tmp_path / "spill" / f"{j}.safetensors").exists()
    after = snapshot(svc, j)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert svc.report()["moves"] == 3 and svc.report()["bytes_to_tier"]["disk"] == nbytes
    svc.close()


def test_a_corrupted_host_copy_is_caught_at_swap_in(job: JobSpec) -> None:
    svc = Service("s0", validate=True)
    svc.load_job(job)
    svc.apply([Move(job.job_id, "device", "host", 0)])
    host = svc.states[job.job_id].host
    assert host is not None
    next(iter(host.values())).view(-1)[0] += 1.0  # a flipped value while the state sat in host memory
    with pytest.raises(StateCorrupted, match="checksum"):
        svc.apply([Move(job.job_id, "host", "device", 0)])
    svc.close()


def test_moves_that_disagree_with_the_actual_tier_are_refused(job: JobSpec) -> None:
    svc = Service("s0")
    svc.load_job(job, tier="host")
    assert svc.tier(job.job_id) == "host"
    with pytest.raises(StateCorrupted, match="is on host"):
        svc.apply([Move(job.job_id, "device", "disk", 0)])
    res = svc.run_node(job.job_id, 0, "evaluate", {})  # off device at run time: a clear node error
    assert not res.report.ok and "not device" in (res.report.error or "")
    svc.close()


def test_prefetch_runs_in_the_background_and_the_next_node_waits_for_it(job: JobSpec) -> None:
    svc = Service("s0", validate=True)
    svc.load_job(job, tier="host")
    res = svc.run_node(job.job_id, -1, "evaluate", {}, swaps=[Move(job.job_id, "host", "device", 0)])
    rep = res.report
    assert rep.ok and rep.swap_bytes > 0 and rep.swap_end >= rep.swap_start
    svc.apply([Move(job.job_id, "device", "host", 0)])
    svc._start_prefetch([Move(job.job_id, "host", "device", 0)])
    res = svc.run_node(job.job_id, -1, "evaluate", {})  # waits for the prefetch, then runs on device
    assert res.report.ok and svc.tier(job.job_id) == "device"
    assert svc.report()["prefetch_seconds"] > 0
    svc.close()
