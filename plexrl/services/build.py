"""Building a job's training engine on its service: a `TorchEngine` for a full-weight job (built on the host
when the job is admitted off the device: `plexrl.devices.build_device`), or a `LoRAEngine` whose adapter sits on
the service's shared base for its model (loaded on first use; the service frees it with the last LoRA job on
it). Split from `plexrl.services.service`, which owns the engines once built and moves their states."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plexrl.sizes import uses_reference

if TYPE_CHECKING:
    import torch

    from plexrl.job.spec import JobSpec


def build_engine(job: JobSpec, device: torch.device, tier: str, bases: dict[str, Any]) -> tuple[Any, str]:
    """The job's engine and the device it was built on (the service's, or the host for a full-weight job
    admitted to host or disk). `bases`: the service's shared LoRA bases by base key (added to here)."""
    from plexrl.devices import build_device
    from plexrl.engines.torch_engine import TorchEngine
    from plexrl.job.models import engine_options

    if job.config.model.lora is not None:
        return lora_engine(job, device, bases), str(device)
    tok = job.tokenizer
    built_on = build_device(str(device), tier)
    engine = TorchEngine(
        job.model_path,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        device=str(device),
        with_reference=uses_reference(job.graph),
        attention=job.config.model.attention,
        load_on=built_on,
        **engine_options(job.config.model),  # dtype, gradient_checkpointing
    )
    return engine, built_on


def lora_engine(job: JobSpec, device: torch.device, bases: dict[str, Any]) -> Any:
    """The job's LoRAEngine: its adapter on the shared base for its model and settings (plexrl/engines/lora.py)."""
    from plexrl.engines.lora import LoRAEngine, SharedBase, base_key
    from plexrl.job.models import engine_options

    lora = job.config.model.lora
    assert lora is not None
    options = engine_options(job.config.model)  # dtype, gradient_checkpointing: the base's (one per setting)
    key = base_key(job.model_path, **options)
    if key not in bases:
        bases[key] = SharedBase(job.model_path, device, job.config.model.attention, **options)
    tok = job.tokenizer
    return LoRAEngine(
        bases[key], job.job_id, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, r=lora.r,
        alpha=lora.alpha, dropout=lora.dropout, targets=list(lora.target_modules), seed=job.config.seed,
    )  # fmt: skip
