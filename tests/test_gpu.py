"""GPU checks (marked `gpu`, skipped where no CUDA device is present; `benchmarks/gpu_check.sh` runs them on a
GPU machine). On CUDA equality is not bitwise between devices or between runs (docs/gpu.md: the same
distribution, not the same bits), so CPU-vs-CUDA comparisons take a tolerance; state moves stay bit-exact.

- the torch engine generates like the CPU one (log-probs within 1e-4) and TRAINS on CUDA: the loss falls over
  a few steps on one batch and the weights change;
- a service on CUDA moves states between its compute stream and its copy stream without a race: a job
  trained and evicted at once in the background has the host copy of its state after the step, and another
  job swapped in right after keeps its state (docs/gpu.md, "Streams and swaps");
- swaps go through pinned flat host buffers whose pinned bytes are counted exactly (docs/gpu.md, "Pinned memory");
- bf16 training keeps fp32 masters and moments (14 bytes a parameter) and trains; a LoRA job on a CUDA
  service trains its adapter only.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from plexrl.job.model_config import ModelConfig
    from plexrl.job.models import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("gpu-model")
    tok = build_tokenizer(path)
    build_model(ModelConfig(layers=2, hidden=64, heads=4, intermediate=128), tok, path, seed=0)
    return path, tok


def spec(tmp_path: Path, name: str, **model: Any) -> Any:
    from plexrl.job.load import load_job
    from plexrl.job.spec import prepare_job

    cfg: dict[str, Any] = copy.deepcopy(TINY)
    cfg.update(name=name, run_dir=str(tmp_path / "runs"), engine="torch")
    cfg["model"] = {**cfg["model"], **model}
    cfg["tracking"]["mlflow"] = False
    return prepare_job(load_job(cfg))


def batch(tok: Any, rows: int = 4) -> dict[str, torch.Tensor]:
    enc = tok(["12+34=46", "5+6=11", "70+8=78", "9+9=18"][:rows], padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def nll(mb: dict[str, torch.Tensor], logp: torch.Tensor, entropy: torch.Tensor) -> tuple[torch.Tensor, dict]:
    mask = mb["attention_mask"][:, 1:].float()
    return -(logp[:, 1:] * mask).sum() / mask.sum(), {}


def step(engine: Any, b: dict[str, torch.Tensor], lr: float = 1e-2) -> dict[str, float]:
    out: dict[str, float] = engine.train_step(b, nll, temperature=1.0, lr=lr, weight_decay=0.0, max_grad_norm=1.0,
                                              minibatches=1)  # fmt: skip
    return out


def test_engine_generates_like_the_cpu_one_and_trains_on_cuda(model: tuple[Path, Any]) -> None:
    from plexrl.engines.torch_engine import TorchEngine

    path, tok = model
    cpu = TorchEngine(path, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    gpu = TorchEngine(path, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, device="cuda")
    b = batch(tok)
    lp_cpu = cpu.logprobs(b["input_ids"], b["attention_mask"])
    lp_gpu = gpu.logprobs(b["input_ids"], b["attention_mask"])
    assert torch.allclose(lp_cpu, lp_gpu, atol=1e-4)
    out = gpu.generate([tok("12+34=")["input_ids"]], n=4, temperature=1.0, max_new_tokens=4, seed=0)
    assert out.response_ids.shape[0] == 4
    before = {k: v.detach().clone() for k, v in gpu.policy.state_dict().items()}
    losses = [step(gpu, b)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.1, losses  # it learns the batch
    after = gpu.policy.state_dict()
    assert all(t.is_cuda for t in after.values())
    assert any(not torch.equal(after[k], before[k]) for k in before)


def test_background_moves_on_cuda_neither_tear_nor_overwrite_a_state(model: tuple[Path, Any], tmp_path: Path) -> None:
    from plexrl.planner.state import Move
    from plexrl.services.service import Service
    from plexrl.services.streams import CudaOrder

    path, tok = model
    job = spec(tmp_path, "bg", path=str(path))
    a, b = (dataclasses.replace(job, job_id=n) for n in ("a", "b"))
    svc = Service("s0", "cuda")
    assert isinstance(svc.order, CudaOrder)
    svc.load_job(a)
    svc.load_job(b)
    step(svc.engines["b"], batch(tok))
    svc.node_end(["b"], None)
    svc.apply([Move("b", "device", "host", 0)])
    host_b = svc.states["b"].host
    assert host_b is not None and host_b.buffer.is_pinned()
    want_b = {k: v.clone() for k, v in host_b.tensors().items()}
    for r in range(5):
        step(svc.engines["a"], batch(tok))
        state = [t.detach() for t in svc.engines["a"].state_tensors().values()]
        for _ in range(20):  # device work on a's state still queued when the "node" returns
            torch._foreach_add_(state, 1.0)
            torch._foreach_add_(state, -1.0)
        ref = {k: v.detach().clone() for k, v in svc.engines["a"].state_tensors().items()}  # after it, in stream order
        svc.node_end(["a"], None)
        svc.background.queue([Move("a", "device", "host", 0), Move("b", "host", "device", 0)]).result()
        torch.cuda.synchronize()
        host_a = svc.states["a"].host
        assert host_a is not None
        got = host_a.tensors()
        assert all(torch.equal(got[k], ref[k].cpu()) for k in ref), f"round {r}: a torn host copy"
        live_b = svc.engines["b"].state_tensors()
        assert all(torch.equal(live_b[k].cpu(), want_b[k]) for k in want_b), f"round {r}: b's state overwritten"
        svc.background.queue([Move("b", "device", "host", 0), Move("a", "host", "device", 0)]).result()
    report = svc.report()
    assert report["pinned_bytes"] > 0 and report["copies"] >= 20
    svc.close()
    assert svc.host_pool.pinned_bytes == 0


def test_swap_round_trip_on_cuda_is_pinned_counted_and_frees_device_memory(tmp_path: Path) -> None:
    from plexrl.services import swap as sw
    from plexrl.services.host import HostPool, covered_bytes
    from plexrl.services.streams import CudaOrder

    device = torch.device("cuda")
    live = {f"w{i}": torch.randn(1024, 1024 + i, device=device) for i in range(8)}  # ~32 MiB, odd sizes
    want = {k: v.clone() for k, v in live.items()}
    pool, order = HostPool(pin=True), CudaOrder(device)
    before = torch.cuda.memory_allocated(device)
    host, copies = sw.device_to_host("j", live, device, pool, order)
    assert copies == 8 and host.buffer.is_pinned()
    assert pool.pinned_bytes == covered_bytes(host.buffer.data_ptr(), host.layout.nbytes)  # no power-of-two rounding
    assert torch.cuda.memory_allocated(device) <= before - 32 * 2**20
    sw.host_to_disk(host, tmp_path / "s.spill")
    pool.give(host.buffer)
    host = sw.disk_to_host(tmp_path / "s.spill", host.layout, pool)
    assert host.buffer.is_pinned() and pool.made == 1  # read straight into the kept pinned buffer
    assert sw.host_to_device("j", live, host, device, order) == 1
    pool.give(host.buffer)
    assert all(torch.equal(live[k], want[k]) for k in want)
    host, copies = sw.device_to_host("j", live, device, pool, order)
    assert copies == 1  # one device buffer now: one copy
    pool.give(host.buffer)
    pool.clear()
    assert pool.pinned_bytes == 0


def test_bf16_training_on_cuda_keeps_fp32_masters_and_learns(model: tuple[Path, Any]) -> None:
    from plexrl.engines.torch_engine import TorchEngine

    path, tok = model
    engine = TorchEngine(path, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, device="cuda", dtype="bfloat16")
    b = batch(tok)
    losses = [step(engine, b)["loss"] for _ in range(5)]
    assert all(abs(x) < float("inf") for x in losses) and losses[-1] < losses[0], losses
    state = engine.state_tensors()
    params = sum(p.numel() for p in engine.policy.parameters())
    assert {t.dtype for k, t in state.items() if k.startswith("policy.")} == {torch.bfloat16}
    assert {t.dtype for k, t in state.items() if not k.startswith("policy.")} == {torch.float32}
    assert sum(t.numel() * t.element_size() for t in state.values()) == 14 * params


def test_a_lora_job_on_a_cuda_service_trains_its_adapter_only(model: tuple[Path, Any], tmp_path: Path) -> None:
    from plexrl.planner.state import Move
    from plexrl.services.service import Service

    path, tok = model
    job = spec(tmp_path, "lora", path=str(path), lora={"r": 4, "alpha": 8})
    svc = Service("s0", "cuda")
    svc.load_job(job)
    engine = svc.engines[job.job_id]
    base = {k: v.detach().clone() for k, v in engine.shared.model.state_dict().items() if "lora_" not in k}
    adapter = {k: v.detach().clone() for k, v in engine.state_tensors().items()}
    for _ in range(3):
        step(engine, batch(tok))
    svc.node_end([job.job_id], None)
    now = engine.state_tensors()
    assert any(not torch.equal(now[k], adapter[k]) for k in adapter if k in now)
    kept = {k: v for k, v in engine.shared.model.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(kept[k], base[k]) for k in base)
    svc.apply([Move(job.job_id, "device", "host", 0), Move(job.job_id, "host", "device", 0)])
    assert all(torch.equal(engine.state_tensors()[k], now[k]) for k in now)
    svc.close()
