"""A Service carrying out state moves on a real TorchEngine: bytes survive device -> host -> disk -> device,
checksums catch a corrupted copy, prefetch runs in the background, and a disagreement with the planner is
an error, not a silent overwrite."""

from __future__ import annotations

import copy
import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY

from plexrl.job.load import load_job
from plexrl.job.spec import JobSpec, prepare_job
from plexrl.planner.state import Move
from plexrl.services.service import Service
from plexrl.services.swap import StateCorrupted


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> JobSpec:
    cfg: dict[str, Any] = copy.deepcopy(TINY)
    cfg["run_dir"] = str(tmp_path_factory.mktemp("svc") / "runs")
    cfg["tracking"]["mlflow"] = False
    cfg["pipeline"]["params"]["kl"] = {"coef": 0.05}  # a reference copy is part of the state too
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
    assert (tmp_path / "spill" / f"{j}.spill").is_file()
    assert all(t.numel() == 0 for t in svc.engines[j].state_tensors().values())  # device storage freed
    svc.apply([Move(j, "disk", "device", 0)])
    assert not (tmp_path / "spill" / f"{j}.spill").exists()
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
    next(iter(host.tensors().values())).view(-1)[0] += 1.0  # a flipped value while the state sat in host memory
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


def test_early_swaps_start_after_the_previous_node_passes_and_run_in_the_background(job: JobSpec) -> None:
    """A lookahead node's swaps queued before the node before it started (`start_early`) wait for that
    node's own swaps, then run on the background thread while it computes; the node then only waits. Every
    move keeps the device within two states; a late start is ignored and a failed early move fails the node."""
    a, b, c = (dataclasses.replace(job, job_id=name) for name in ("a", "b", "c"))
    svc = Service("s0", validate=True)
    svc.load_job(a)
    size = svc.load_job(b, tier="host")
    svc.load_job(c, tier="host")
    log: list[tuple[str, str, str, int]] = []  # (job, destination, thread, state bytes on device after it)
    move = svc._move

    def recording(m: Move) -> int:
        nbytes = move(m)
        on_device = sum(p.nbytes for p in svc.states.values() if p.tier == "device")
        log.append((m.job_id, m.dst, threading.current_thread().name, on_device))
        return nbytes

    svc._move = recording  # type: ignore[method-assign]
    running, go = threading.Event(), threading.Event()
    context = svc.context

    def held(*args: Any, **kwargs: Any) -> Any:  # node 0 "computes" until the test lets it go
        running.set()
        assert go.wait(30)
        return context(*args, **kwargs)

    # node 1 (job c) is sent while node 0 (job b) has not applied its swaps yet: its early swaps wait
    evict_in = [Move("a", "device", "host", 0), Move("c", "host", "device", 0)]
    assert svc.start_early(1, evict_in) == "staged"
    assert (svc.tier("a"), svc.tier("c")) == ("device", "host")
    svc.context = held  # type: ignore[method-assign]
    first: list[Any] = []
    node0 = threading.Thread(target=lambda: first.append(svc.run_node(
        "b", -1, "evaluate", {}, swaps=[Move("b", "host", "device", 0)], seq=0)))  # fmt: skip
    node0.start()
    try:
        assert running.wait(30)  # node 0 runs; node 1's swaps move in the background meanwhile
        svc.background.early[1].result(timeout=30)
        assert (svc.tier("a"), svc.tier("b"), svc.tier("c")) == ("host", "device", "device")
    finally:
        go.set()
        node0.join(30)
    svc.context = context  # type: ignore[method-assign]
    assert first[0].report.ok, first[0].report.error
    assert [(j, d) for j, d, _, _ in log] == [("b", "device"), ("a", "host"), ("c", "device")]
    assert not log[0][2].startswith("s0-prefetch")  # node 0 applied its own swaps
    assert all(t.startswith("s0-prefetch") for _, _, t, _ in log[1:])
    assert all(on_device <= 2 * size for *_, on_device in log)
    res = svc.run_node("c", -1, "evaluate", {}, swaps=evict_in, seq=1)
    assert res.report.ok, res.report.error
    assert res.report.swap_bytes == 0 and len(log) == 3  # nothing left to move: it only waited
    assert svc.start_early(1, evict_in) == "late"  # node 1 has begun: a late start is ignored
    stats = svc.report()
    assert stats["early_starts"] == stats["early_during_previous"] == 1
    assert 0 < stats["early_swap_seconds"] <= stats["prefetch_seconds"]
    # an early move that fails (a is on host, not disk) fails its node with the reason, no hang
    assert svc.start_early(2, [Move("a", "disk", "device", 0)]) == "started"
    res = svc.run_node("a", -1, "evaluate", {}, swaps=[Move("a", "disk", "device", 0)], seq=2)
    assert not res.report.ok and "swap failed: StateCorrupted" in (res.report.error or "")
    assert "is on host" in (res.report.error or "")
    svc.close()


def test_an_early_start_waits_for_a_checkpoint_numbered_before_it(job: JobSpec, tmp_path: Path) -> None:
    """A checkpoint sent between two nodes holds back the next node's early swaps until it is written."""
    a, b = (dataclasses.replace(job, job_id=name) for name in ("a", "b"))
    svc = Service("s0")
    svc.load_job(a)
    svc.load_job(b, tier="host")
    assert svc.start_early(1, [Move("a", "device", "host", 0), Move("b", "host", "device", 0)]) == "staged"
    with svc.in_order(0):
        svc.checkpoint("a", tmp_path / "a.ckpt", {})
        assert (svc.tier("a"), svc.tier("b")) == ("device", "host") and 1 not in svc.background.early
    svc.background.early[1].result(timeout=30)
    assert (svc.tier("a"), svc.tier("b")) == ("host", "device")
    svc.close()


def test_blocking_swaps_wait_for_the_background_moves_queued_before_them(job: JobSpec) -> None:
    """A node that applies its swaps itself (no early start) runs them after the prefetch queued before it:
    the planner computed them assuming that prefetch had happened, so side by side the device could briefly
    hold one state too many (here: c still evicting while b swaps in)."""
    a, b, c = (dataclasses.replace(job, job_id=name) for name in ("a", "b", "c"))
    svc = Service("s0")
    svc.load_job(a)
    size = svc.load_job(b, tier="host")
    svc.load_job(c)
    log: list[tuple[str, str, int]] = []  # (job, destination, state bytes on device after the move)
    move, wait_all = svc._move, svc.background.wait_all
    go = threading.Event()  # released when the node waits (correct) or when it moves anyway (the bug)

    def recording(m: Move) -> int:
        if m.job_id == "c":
            assert go.wait(30)  # the prefetch's eviction is slow
        nbytes = move(m)
        log.append((m.job_id, m.dst, sum(p.nbytes for p in svc.states.values() if p.tier == "device")))
        go.set()
        return nbytes

    def waiting() -> None:
        go.set()
        wait_all()

    svc._move = recording  # type: ignore[method-assign]
    svc.background.wait_all = waiting  # type: ignore[method-assign]
    svc._start_prefetch([Move("c", "device", "host", 0)])  # queued by the node before
    res = svc.run_node("a", -1, "evaluate", {}, swaps=[Move("b", "host", "device", 0)])
    assert res.report.ok, res.report.error
    assert [(j, d) for j, d, _ in log] == [("c", "host"), ("b", "device")]
    assert max(on_device for *_, on_device in log) <= 2 * size
    svc.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_save_model_reads_a_swapped_out_state_without_moving_it(job: JobSpec, tmp_path: Path, tier: str) -> None:
    """A finished job's model is saved from whichever tier holds it: the device budget the planner keeps
    stays true (the state is not brought back to device behind its back)."""
    from transformers import LlamaForCausalLM

    svc = Service("s0", spill_dir=tmp_path / "spill")
    svc.load_job(job)
    weights = {k: v.detach().clone() for k, v in svc.engines[job.job_id].policy.state_dict().items()}
    svc.apply([Move(job.job_id, "device", tier, 0)])  # type: ignore[arg-type]
    path = svc.save_model(job.job_id, tmp_path / "model")
    assert svc.tier(job.job_id) == tier
    assert all(t.numel() == 0 for t in svc.engines[job.job_id].state_tensors().values())  # still swapped out
    saved = LlamaForCausalLM.from_pretrained(str(path)).state_dict()
    assert all(torch.equal(saved[k], weights[k]) for k in weights if k in saved)
    assert "model.embed_tokens.weight" in saved
    svc.close()
