"""A LoRA job's model options (plexrl/engines/lora.py), on a tiny random model with the real SmolLM2 tokenizer:

- `model.dtype: bfloat16` holds the shared base in bf16 while every adapter stays fp32 (its own master: no
  copy), trains, never changes the base, and round-trips through export/load; the planner counts the base at
  bf16 size and the adapter state unchanged;
- `model.gradient_checkpointing` on the base gives the same train step;
- a bf16 checkpoint's weights are counted at their fp32 size (`job.model_bytes` reads parameters, not bytes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plexrl.engines.lora import LoRAEngine, SharedBase, base_key
from plexrl.services.swap import checksum

CPU = torch.device("cpu")


def engine_on(base: SharedBase, job: str = "j") -> LoRAEngine:
    return LoRAEngine(base, job, eos_id=2, pad_id=2, r=4, alpha=8, dropout=0.0, targets=["q_proj", "v_proj"], seed=0)


def step(engine: LoRAEngine) -> dict[str, float]:
    ids = torch.tensor([[1, 520, 9531, 198, 33, 44], [1, 33, 44, 198, 520, 520]])

    def nll(mb: dict[str, torch.Tensor], logp: torch.Tensor, ent: torch.Tensor) -> Any:
        return -logp[:, 1:].mean(), {}

    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return engine.train_step(batch, nll, temperature=1.0, lr=0.05, weight_decay=0.0, max_grad_norm=1.0, minibatches=1)


def test_a_bf16_base_trains_fp32_adapters_and_never_changes(smol_tiny: Path) -> None:
    from plexrl.sizes import model_bytes

    base = SharedBase(smol_tiny, CPU, "eager", dtype="bfloat16")
    assert {t.dtype for t in base.base_tensors().values()} == {torch.bfloat16}
    assert base.nbytes() == model_bytes(smol_tiny, "bfloat16") == model_bytes(smol_tiny) // 2
    engine = engine_on(base)
    adapter = engine._adapter_params()
    assert adapter and all(p.dtype == torch.float32 and p.requires_grad for p in adapter.values())
    before = checksum(base.base_tensors())
    losses = [step(engine)["loss"] for _ in range(4)]
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0]
    assert checksum(base.base_tensors()) == before  # training steps the fp32 adapter only
    tensors = engine.state_tensors()
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    n = sum(p.numel() for p in adapter.values())
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == 12 * n  # adapter + 2 moments, no master
    twin = engine_on(SharedBase(smol_tiny, CPU, "eager", dtype="bfloat16"))
    twin.load_state(engine.export_state())
    assert step(twin)["loss"] == step(engine)["loss"]  # the state round-trips exactly
    out = engine.generate([[1, 520, 9531, 198]], n=2, temperature=1.0, max_new_tokens=4, seed=0)
    ids = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask], 1)
    for which in ("policy", "reference"):  # the reference of a LoRA job: the bf16 base
        assert torch.isfinite(engine.logprobs(ids, mask, which=which)).all()


def test_gradient_checkpointing_of_a_shared_base_gives_the_same_step(smol_tiny: Path) -> None:
    plain_base, ckpt_base = (
        SharedBase(smol_tiny, CPU, "eager"),
        SharedBase(smol_tiny, CPU, "eager", gradient_checkpointing=True),
    )
    assert ckpt_base.base.is_gradient_checkpointing and not plain_base.base.is_gradient_checkpointing
    plain, ckpt = engine_on(plain_base), engine_on(ckpt_base)
    a, b = step(plain), step(ckpt)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    pa, pb = plain._adapter_params(), ckpt._adapter_params()
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="model dtype 'float16' is not one of float32, bfloat16"):
        SharedBase(smol_tiny, CPU, "eager", dtype="float16")


def test_a_bf16_lora_job_shares_a_bf16_base_counted_at_its_size(smol_tiny: Path, tmp_path: Path) -> None:
    from test_lora import lora_job

    from plexrl.job.load import load_job
    from plexrl.job.spec import prepare_job
    from plexrl.services.service import Service
    from plexrl.sizes import lora_state_bytes, model_bytes

    cfg = lora_job(smol_tiny, tmp_path / "runs", "bf", 0)
    cfg["model"].update(dtype="bfloat16", gradient_checkpointing=True)
    spec = prepare_job(load_job(cfg))
    key = base_key(spec.model_path, "bfloat16", True)
    assert key not in {base_key(spec.model_path), base_key(spec.model_path, "bfloat16")}  # one base per setting
    assert spec.engine() == (key, model_bytes(smol_tiny) // 2)
    assert spec.state_bytes() == lora_state_bytes(smol_tiny, 4, ["q_proj", "v_proj"])  # fp32 adapter state
    svc = Service("s0", spill_dir=tmp_path / "spill")
    try:
        svc.load_job(spec)
        assert list(svc.bases) == [key]
        (base,) = svc.bases.values()
        assert base.dtype == torch.bfloat16 and base.base.is_gradient_checkpointing
    finally:
        svc.close()


def test_a_bf16_checkpoint_is_counted_at_its_fp32_size(smol_tiny: Path, tmp_path: Path) -> None:
    import shutil

    from transformers import AutoModelForCausalLM

    from plexrl.sizes import count_parameters, model_bytes

    half = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(str(smol_tiny), dtype=torch.bfloat16).save_pretrained(half)
    shutil.copy(smol_tiny / "tokenizer.json", half / "tokenizer.json")
    on_disk = sum(f.stat().st_size for f in half.glob("*.safetensors"))
    assert count_parameters(half) == count_parameters(smol_tiny)
    assert model_bytes(half) == model_bytes(smol_tiny) == 4 * count_parameters(half) > 1.9 * on_disk
    damaged = tmp_path / "damaged"  # an unreadable header: its size on disk (loading the job says what is wrong)
    damaged.mkdir()
    (damaged / "model.safetensors").write_bytes(b"\x00" * 4096)
    assert model_bytes(damaged) == 4096
