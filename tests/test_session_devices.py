"""A Tinker session takes the defaults its services' device gives a job (`plexrl.job.devices.job_defaults`),
where its config leaves them unset: on CUDA sdpa attention, and bfloat16 weights for a LoRA session (its frozen
base; the adapter and its moments stay float32); a full fine-tuning session keeps float32, which its engine
needs. What a config sets is kept, on a CPU nothing changes, and a journalled session (the server records its
config with what was unset left unset) takes them too. CPU only: the decision, not a CUDA run."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

from plexrl.job.model_config import ModelConfig
from plexrl.server.entries import prepare_session_entry
from plexrl.sessions.spec import SessionConfig, prepare_session

DTYPE, ATTENTION = ModelConfig.model_fields["dtype"].default, ModelConfig.model_fields["attention"].default


def config(model_dir: Path, run_dir: Path, lora: bool, **model: Any) -> SessionConfig:
    m: dict[str, Any] = {"path": str(model_dir), **model}
    if lora:
        m["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    return SessionConfig.model_validate({
        "kind": "session", "name": "s", "run_dir": str(run_dir), "model": m,
        "tracking": {"mlflow": False, "progress": False, "log_model": False},
    })  # fmt: skip


def test_a_session_on_cuda_takes_the_job_defaults_and_a_full_session_keeps_float32(
    smol_tiny: Path, tmp_path: Path
) -> None:
    def model_of(cfg: SessionConfig, device: str) -> tuple[str, str]:
        m = prepare_session(cfg, device=device).config.model
        return m.dtype, m.attention

    assert (DTYPE, ATTENTION) == ("float32", "eager")  # (what a CPU keeps)
    assert model_of(config(smol_tiny, tmp_path, lora=True), "cuda") == ("bfloat16", "sdpa")
    assert model_of(config(smol_tiny, tmp_path, lora=False), "cuda:0") == ("float32", "sdpa")
    assert model_of(config(smol_tiny, tmp_path, lora=True, dtype="float32", attention="eager"), "cuda") == (
        "float32", "eager",
    )  # fmt: skip
    assert model_of(config(smol_tiny, tmp_path, lora=True), "cpu") == (DTYPE, ATTENTION)
    # the server's journal keeps what was unset unset, so a journalled session takes the defaults too
    recorded = config(smol_tiny, tmp_path, lora=True).model_dump(mode="json", exclude_unset=True)
    assert "dtype" not in recorded["model"]
    entry = types.SimpleNamespace(config=recorded, job_id="s", user="u", attempt=1, checkpoint=None,
                                  checkpoint_iteration=None, tracking={})  # fmt: skip
    spec = prepare_session_entry(entry, device="cuda")  # type: ignore[arg-type]
    assert (spec.config.model.dtype, spec.config.model.attention) == ("bfloat16", "sdpa")
    assert prepare_session_entry(entry).config.model.dtype == DTYPE  # type: ignore[arg-type]  # (a CPU server)
