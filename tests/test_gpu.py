"""GPU checks (skipped where no CUDA device is present)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plexrl.engines.torch_engine import TorchEngine
from plexrl.job.model_config import ModelConfig
from plexrl.job.models import build_model, build_tokenizer

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_generates_and_trains_on_cuda(tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path)
    build_model(ModelConfig(layers=1, hidden=32, heads=2, intermediate=64), tok, tmp_path, seed=0)
    cpu = TorchEngine(tmp_path, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    gpu = TorchEngine(tmp_path, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, device="cuda")
    prompts = [tok("12+34=")["input_ids"], tok("5+6=")["input_ids"]]
    a = cpu.generate(prompts, n=1, temperature=1.0, max_new_tokens=4, seed=0, greedy=True)
    b = gpu.generate(prompts, n=1, temperature=1.0, max_new_tokens=4, seed=0, greedy=True)
    assert torch.equal(a.response_ids.cpu(), b.response_ids.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_swap_round_trip_on_cuda_frees_and_restores_device_memory(tmp_path: Path) -> None:
    from plexrl.services import swap as sw

    device = torch.device("cuda")
    live = {f"w{i}": torch.randn(1024, 1024, device=device) for i in range(8)}  # 32 MiB
    want = {k: v.clone() for k, v in live.items()}
    before = torch.cuda.memory_allocated(device)
    host = sw.device_to_host(live, device)
    assert all(v.is_pinned() for v in host.values())
    assert torch.cuda.memory_allocated(device) <= before - 32 * 2**20
    sw.host_to_disk(host, tmp_path / "s.safetensors")
    host = sw.disk_to_host(tmp_path / "s.safetensors", pin=True)
    sw.host_to_device(live, host, device)
    assert all(torch.equal(live[k], want[k]) for k in want)
