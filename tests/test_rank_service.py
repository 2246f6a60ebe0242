"""A worker group's rank side without a Dask cluster: the choices an NCCL group gets (docs/gpu.md, "Worker groups
on NCCL"; decided by `group_plan` and checked here without a GPU), the gloo side group of the control plane, and a
group job's model saved from host or disk (it assigned flat byte storages to named parameters before).

One rank in this process (a 1-rank gloo group), as tests/test_worker_group.py's swap test does."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_worker_group import job

from plexrl.planner.state import Move
from plexrl.ranks import GroupSpec, RankState, agree, group_plan, join, leave


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> Iterator[RankState]:
    key = f"test/{request.node.name}"
    state = join(GroupSpec(key, 1, "127.0.0.1", _port(), timeout_s=30), 0, "cpu")
    try:
        yield state
    finally:
        leave(key)


def test_an_nccl_group_aborts_its_communicator_instead_of_killing_the_worker_and_talks_over_gloo() -> None:
    nccl = group_plan("nccl")
    # torch's default (3) tears the whole Dask worker down at a collective timeout: every job on it is lost
    assert nccl.env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert nccl.side == "gloo" and nccl.broken_teardown == "abort" and nccl.bind_device
    gloo = group_plan("gloo")
    assert gloo.env == {} and gloo.side == "gloo" and gloo.broken_teardown == "destroy" and not gloo.bind_device


def test_the_error_exchange_runs_over_the_gloo_side_group(rank: RankState) -> None:
    import torch.distributed as dist

    assert rank.side is not None and dist.get_backend(rank.side) == "gloo"
    assert agree(rank, None) is None
    assert agree(rank, "ValueError: x") == "rank 0: ValueError: x"


def test_leaving_a_broken_group_tears_it_down_and_the_next_join_forms_a_fresh_one() -> None:
    import torch.distributed as dist

    state = join(GroupSpec("test/broken", 1, "127.0.0.1", _port(), timeout_s=30), 0, "cpu")
    state.broken = "all-reduce: timed out"
    leave("test/broken")
    assert not dist.is_initialized()
    again = join(GroupSpec("test/broken", 1, "127.0.0.1", _port(), timeout_s=30, epoch=1), 0, "cpu")
    assert agree(again, None) is None
    leave("test/broken")


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_group_jobs_model_is_saved_from_host_or_disk_without_moving_it(
    rank: RankState, tmp_path: Path, tier: str
) -> None:
    from transformers import LlamaForCausalLM

    from plexrl.services.group import RankService

    spec = job(tmp_path / "runs", "s", 3)
    svc = RankService("service-0", rank, spill_dir=tmp_path / "spill")
    svc.load_job(spec)
    engine = svc.engines["s"]
    assert engine.full is not None
    weights = {k: v.detach().clone() for k, v in engine.full.policy.state_dict().items()}
    svc.apply([Move("s", "device", "host", 0)] + ([Move("s", "host", "disk", 0)] if tier == "disk" else []))
    path = svc.save_model("s", tmp_path / "model")
    assert svc.tier("s") == tier
    assert all(t.untyped_storage().nbytes() == 0 for t in engine.state_tensors().values())  # still swapped out
    saved = LlamaForCausalLM.from_pretrained(str(path)).state_dict()
    assert "model.embed_tokens.weight" in saved
    assert all(torch.equal(saved[k], weights[k]) for k in weights if k in saved)
    svc.apply([Move("s", tier, "device", 0)])  # type: ignore[arg-type]
    now = engine.full.policy.state_dict()
    assert all(torch.equal(now[k], weights[k]) for k in weights)
    svc.close()
