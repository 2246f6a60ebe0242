"""The model part of a job's configuration: `ModelConfig` (the model to build or load, its dtype and
attention) and `LoRAConfig` (train an adapter instead of every weight), on `StrictModel` (pydantic,
`extra="forbid"`), the base of every config model. Re-exported by `plexrl.config`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoRAConfig(StrictModel):
    """Train a low-rank adapter (peft LoRA) instead of every weight: the job's state is the adapter and its
    optimizer; the base is loaded once per service and shared read-only by every LoRA job on it
    (plexrl/engines/lora.py). Rollouts run on the torch engine, or on vLLM with the job's adapter applied
    (`engine:`, the same rule as a full job; plexrl/engines/vllm_lora.py)."""

    r: int = Field(16, ge=1, le=1024, description="Rank of the adapter's matrices.")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator: the update is scaled by alpha / r.")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter's input. It draws from the global RNG: above 0, a job's metrics under "
        "multiplexing are no longer exactly those it has alone.",
    )
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the linear layers that get an adapter (Llama-family names: q_proj, k_proj, v_proj, "
        "o_proj, gate_proj, up_proj, down_proj).",
    )


class ModelConfig(StrictModel):
    """A small Llama-architecture model built locally (no hub): sizes, or `path` to an existing HF dir."""

    layers: int = Field(2, ge=1, le=64, description="Transformer layers.")
    hidden: int = Field(128, ge=8, le=8192, description="Hidden size; must be divisible by `heads`.")
    heads: int = Field(4, ge=1, le=128, description="Attention heads.")
    intermediate: int = Field(512, ge=8, le=32768, description="MLP inner size.")
    max_position: int = Field(64, ge=16, le=32768, description="Maximum sequence length (prompt + response).")
    tie_embeddings: bool = Field(True, description="Share the input embedding and the output head.")
    init_std: float = Field(0.02, gt=0, le=1, description="Std of the random initial weights (initializer_range).")
    attention: Literal["eager", "sdpa"] = Field(
        "eager", description="Attention kernel; eager is faster for tiny models on CPU, sdpa for larger ones."
    )
    path: str | None = Field(None, description="Load this local HF model directory instead of building one.")
    pretrained: str | None = Field(
        None,
        description="A real pretrained model by short name, shipped in a package and converted once into a local "
        "cache (plexrl/job/pretrained.py): smollm2-135m-instruct. Instead of `path` and the size fields.",
    )
    lora: LoRAConfig | None = Field(
        None, description="Train a LoRA adapter over a shared, frozen base instead of the whole model (None: full)."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Weights and compute of the policy and reference. bfloat16 halves them; training then steps "
        "fp32 master copies (the optimizer never sees bf16 weights). The critic stays fp32.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory, more train compute."
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        from plexrl.job.pretrained import PRETRAINED

        if self.pretrained is not None and self.pretrained not in PRETRAINED:
            raise ValueError(f"unknown pretrained model {self.pretrained!r}; known: {', '.join(sorted(PRETRAINED))}")
        if self.pretrained is not None and self.path is not None:
            raise ValueError("give either `path` (a local HF directory) or `pretrained` (a short name), not both")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads}); change one of them")
        if (self.hidden // self.heads) % 2:
            raise ValueError(
                f"head size hidden/heads = {self.hidden // self.heads} must be even (rotary embeddings); "
                "change hidden or heads"
            )
        return self
