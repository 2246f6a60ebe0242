"""The size a service reports for a job's state at its load (`StateMeasured`: what the planner budgets from then
on) is the size the state keeps through training: AdamW's moments, and a PPO job's critic with its moments,
exist from the load. Were they made at the first training step, the planner would budget a full fine-tune's
state at half its size (weights + reference, no moments) and keep three states resident on a device budget for
two, holding more bytes than the budget: the planner's count and the bytes resident must agree at every step."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY

from plexrl.job.load import load_job
from plexrl.job.spec import JobSpec, prepare_job
from plexrl.planner.state import Move, StateManager
from plexrl.services.service import Service
from plexrl.services.swap import nbytes

GRPO = {"name": "grpo", "params": {"batch_size": 4, "n": 4, "max_new_tokens": 4, "kl": {"coef": 0.05}}}
PPO = {"name": "ppo", "params": {"batch_size": 4, "n": 4, "max_new_tokens": 4}}


def tiny(run_dir: Path, name: str, seed: int, pipeline: dict[str, Any]) -> JobSpec:
    """A tiny job with no warm start: its engine starts from fresh weights with no optimizer state, as a
    pretrained model does (a warm start would leave its moments behind and hide a late one)."""
    cfg: dict[str, Any] = copy.deepcopy(TINY)
    cfg.update(name=name, seed=seed, run_dir=str(run_dir), warm_start={"enabled": False}, pipeline=pipeline)
    cfg["tracking"]["mlflow"] = False
    return prepare_job(load_job(cfg))


def train(engine: Any, critic: bool = False) -> None:
    """One AdamW step of the policy (and of the critic) on a fixed batch."""
    ids = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mask": torch.ones_like(ids).float()}
    engine.train_step(batch, lambda mb, logp, *_: (-(logp * mb["mask"]).mean(), {}), temperature=1.0, lr=1e-2,
                      weight_decay=0.01, max_grad_norm=1.0, minibatches=1)  # fmt: skip
    if critic:
        engine.train_critic_step(batch, lambda mb, v, *_: ((v**2).mean(), {}), lr=1e-2, max_grad_norm=1.0,
                                 minibatches=1)  # fmt: skip


@pytest.mark.parametrize("pipeline", [GRPO, PPO], ids=["grpo-kl", "ppo"])
def test_the_size_reported_at_the_load_is_the_size_the_state_keeps(pipeline: dict[str, Any], tmp_path: Path) -> None:
    job = tiny(tmp_path / "runs", "sized", 0, pipeline)
    svc = Service("s0")
    loaded = svc.load_job(job)
    engine = svc.engines[job.job_id]
    before = set(engine.state_tensors())
    train(engine, critic=pipeline is PPO)
    assert set(engine.state_tensors()) == before, "training made state tensors the load did not report"
    assert loaded == nbytes(engine.state_tensors())
    svc.apply([Move(job.job_id, "device", "host", 0)])
    (out,) = svc.move_log.drain()
    assert out.nbytes == loaded and out.copies == 1  # what a move carries: one flat buffer of those bytes
    svc.close()


def fewest_swap_ins(schedule: list[str], slots: int, resident: set[str]) -> int:
    """Swap-ins a device of `slots` equal states needs for `schedule`, evicting the state needed furthest
    ahead (Belady's rule: the fewest possible)."""
    held, count = set(resident), 0
    for i, job in enumerate(schedule):
        if job in held:
            continue
        count += 1
        if len(held) == slots:
            ahead = {j: schedule.index(j, i) if j in schedule[i:] else math.inf for j in held}
            held.remove(max(sorted(held), key=lambda j: ahead[j]))
        held.add(job)
    return count


def test_a_device_budget_for_two_states_holds_two_through_training(tmp_path: Path) -> None:
    """Three equal jobs, a device budget for two (and a half): the two first admitted stay resident while they
    alone run, the third comes in only by moving one out, and at every step the planner's device bytes are the
    bytes the resident states hold, within the budget; the bytes moved are those of the fewest moves the
    schedule needs."""
    jobs = {s.job_id: s for s in (tiny(tmp_path / "runs", f"j{i}", i, GRPO) for i in range(3))}
    a, b, c = jobs
    svc = Service("s0")
    probe = svc.load_job(jobs[a])  # one state's size, to size the budget
    svc.release(a)
    sm = StateManager("s0", {"device": 2 * probe + probe // 2, "host": None, "disk": None})
    for j, spec in jobs.items():  # at the size the service reports at the load (`StateMeasured`)
        tier = sm.admit(j, probe)
        assert tier is not None and svc.load_job(spec, tier) == probe
    assert sm.size == {a: probe, b: probe, c: probe} and sm.where == {a: "device", b: "device", c: "host"}
    svc.move_log.drain()
    schedule = [a, b, a, b, c, a, b, c, c, a, b, c]
    for i, j in enumerate(schedule):
        ahead = {k: float(schedule.index(k, i + 1)) if k in schedule[i + 1 :] else math.inf for k in jobs}
        svc.apply(sm.make_resident(j, ahead, {j}))
        train(svc.engines[j])
        resident = [k for k in jobs if svc.tier(k) == "device"]
        assert sorted(resident) == sorted(k for k, t in sm.where.items() if t == "device")
        held = sum(nbytes(svc.engines[k].state_tensors()) for k in resident)
        assert held == sm.used("device") <= sm.budgets["device"]  # type: ignore[operator]
    moves = svc.move_log.drain()
    swap_ins = [m for m in moves if m.dst == "device"]
    assert len(swap_ins) == fewest_swap_ins(schedule, 2, {a, b}) == 4
    assert sum(m.nbytes for m in moves) == (2 * len(swap_ins)) * probe  # each swap-in, and the swap-out it needed
    svc.close()


def test_a_worker_group_rank_reports_its_moments_at_the_load(tmp_path: Path) -> None:
    """The same on a worker group's rank (FSDP2 shards; one rank in this process, a 1-rank gloo group, as
    tests/test_rank_service.py does): the bytes a rank reports at the load are the bytes it holds after a step."""
    import socket

    from plexrl.ranks import GroupSpec, join, leave
    from plexrl.services.group import RankService, _storages

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    key = f"test/{tmp_path.name}"
    rank = join(GroupSpec(key, 1, "127.0.0.1", port, timeout_s=30), 0, "cpu")
    try:
        job = tiny(tmp_path / "runs", "ranked", 0, GRPO)
        svc = RankService("service-0", rank, spill_dir=tmp_path / "spill")
        loaded = svc.load_job(job)
        engine = svc.engines[job.job_id]
        train(engine)
        held, _ = _storages(engine.state_tensors())
        assert loaded == sum(s.nbytes() for s in held.values())
        svc.close()
    finally:
        leave(key)
