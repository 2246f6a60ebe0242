"""The `tinker:` section of the server's YAML: the Tinker-compatible API on `plexrl serve` (docs/tutorial-your-loop.md,
reference part). Limits bound what one call may ask for; the SDK learns the forward_backward ones from
`/api/v1/client/config` and splits a larger batch into several calls itself."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TinkerConfig(BaseModel):
    """The Tinker API of `plexrl serve` (the unmodified `tinker` SDK as client)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Serve the Tinker API under /api/v1 (sessions as jobs of the planner).")
    models: list[str] = Field(
        ["smollm2-135m-instruct"],
        description="Base models a session may train, by pretrained short name (plexrl/job/pretrained.py); any model "
        "directory under the server's allowed roots may be named by path as well.",
    )
    engine: str = Field(
        "auto",
        pattern="^(auto|vllm|torch)$",
        description="Generation engine of a session's samples (a job's `engine:` rule): auto, vllm or torch.",
    )
    max_lora_rank: int = Field(64, ge=1, le=1024, description="Largest LoRA rank a session may ask for.")
    lora_alpha: float = Field(
        32.0,
        gt=0,
        description="LoRA scaling numerator (alpha / r) of a session adapter created from now on; a session, its saved "
        "weights and exports keep the alpha they were created with (a server restarted with another included).",
    )
    full_finetuning: bool = Field(
        True,
        description="Allow full fine-tuning sessions (a PlexRL extension: create_lora_training_client with "
        "`user_metadata={'plexrl.full_finetune': 'true'}`); their state is the whole model, its optimizer and "
        "gradients (float32).",
    )
    max_body_bytes: int = Field(
        8 << 20,
        ge=1 << 16,
        le=256 << 20,
        description="Largest request body of the Tinker API (a forward_backward); also the bytes of forward_backward "
        "bodies decoded at once, all clients together (the others wait their turn).",
    )
    max_datums: int = Field(256, ge=1, le=65536, description="Datums of one forward_backward / forward call.")
    max_tokens_per_call: int = Field(
        65536, ge=16, description="Model-input tokens of one forward_backward / forward call, all datums together."
    )
    max_samples: int = Field(64, ge=1, le=4096, description="num_samples of one sample call.")
    max_sample_tokens: int = Field(4096, ge=1, description="max_tokens of one sample call.")
    max_sessions_per_user: int = Field(8, ge=1, description="Open training or sampling models of one user at once.")
    session_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A session whose client sent nothing (no call, no heartbeat) for this long, and has no call "
        "running or just answered, is ended and its state checkpointed; the SDK heartbeats every 10 s while its "
        "program runs.",
    )
    turn_wait_s: float = Field(
        60.0,
        ge=0,
        le=3600,
        description="How long a training request that came before its turn waits for a missing earlier seq id (one "
        "refused before its seq id was read, e.g. a body over max_body_bytes, or one the SDK gave up retrying) "
        "before its turn comes anyway: the missing one is skipped, and gets 400 (out of order) if it still comes.",
    )
    max_requests_per_user: int = Field(
        256,
        ge=1,
        description="Requests of one user not yet retrieved (in flight, held for their turn, queued, or done and "
        "never fetched); past it a request gets 429. A result never fetched is dropped after an hour.",
    )
    max_queued_bytes_per_user: int = Field(
        256 << 20,
        ge=1,
        description="Bytes of one user's decoded training inputs waiting to run (held for their turn or queued); "
        "past it a request gets 429 (the SDK retries it) until some have run. Bounds what a user's calls hold in "
        "the server's memory, however many are sent.",
    )
    max_open_sessions_per_user: int = Field(
        64, ge=1, description="Client sessions (ServiceClients) of one user not yet finished or timed out."
    )
    max_saved_bytes_per_user: int = Field(
        10 << 30,
        ge=0,
        description="Bytes of saved states and sampler weights (save_state, save_weights_for_sampler) one user "
        "may keep; a save past it gets 413.",
    )
    poll_s: float = Field(
        20.0, gt=0, le=40, description="How long a retrieve_future waits for a result before answering try_again."
    )
    max_polls_per_user: int = Field(
        64,
        ge=1,
        description="retrieve_future long polls of one user waiting at once (each holds a connection); one more "
        "gets 429, on which the SDK backs off and asks again. With http.max_connections: docs/security.md.",
    )


__all__ = ["TinkerConfig"]
