"""GPU checks (skipped where no CUDA device is present)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plexrl.config import ModelConfig
from plexrl.engines.torch_engine import TorchEngine
from plexrl.models import build_model, build_tokenizer

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
