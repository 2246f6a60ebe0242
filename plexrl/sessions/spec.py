"""A session as a job: its config (`SessionConfig`: what the server journals), the `JobConfig` every other part
of PlexRL reads (services, MLflow, the journal's job row), and its spec (`SessionSpec`, built by
`prepare_session`): a `JobSpec` whose plan is open (`plexrl/planner/sessions.py`), one service node per call
kind, the calls that change the trained weights marked (`commits`: an open plan's checkpoints count them)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from plexrl.job.config import JobConfig, TrackingConfig, VLLMConfig
from plexrl.job.model_config import ModelConfig
from plexrl.job.spec import JobSpec, resolve_engine
from plexrl.planner.events import JobPlan
from plexrl.sessions.calls import CALL_KINDS

COMMITS = ("optim_step", "load")  # the calls that change a session's trained weights
# the calls several LoRA sessions on one base run in one engine call (`sampling.sample_many`,
# `training.forward_backward_many`), each kind with its own kind only (`planner.batches.batch_key`)
BATCHED = ("sample", "forward_backward", "forward")
OPEN_ITERATIONS = 1_000_000_000  # a session's calls are numbered below this (its plan is open)


class SessionConfig(BaseModel):
    """A session (a job driven by its client's calls), as the server journals it."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["session"] = Field("session", description="Marks a session among the journal's jobs.")
    name: str = Field(description="The session job's id (MLflow run name).")
    seed: int = Field(0, description="Seed of the adapter's initial weights and of samples that name no seed.")
    run_dir: str = Field("runs", description="Where its MLflow store and caches go.")
    engine: Literal["auto", "vllm", "torch"] = Field("auto", description="Generation engine of its samples.")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)  # type: ignore[arg-type]
    model: ModelConfig = Field(description="The base model (pretrained or path) and the LoRA adapter, if any.")
    tracking: TrackingConfig = Field(
        default_factory=lambda: TrackingConfig(progress=False, log_model=False),  # type: ignore[call-arg]
        description="MLflow: a run per session, a metrics row per call.",
    )
    client: dict[str, Any] = Field(
        default_factory=dict,
        description="What the Tinker API keeps of it: model id, session id, the base model as named, metadata.",
    )

    def job_config(self) -> JobConfig:
        """The equivalent job config: its model, engine and tracking, its calls as the pipeline's nodes."""
        nodes = [{"name": k, "op": "plexrl.sessions.operators:session_call"} for k in CALL_KINDS]
        return JobConfig.model_validate({
            "name": self.name, "seed": self.seed, "iterations": OPEN_ITERATIONS, "run_dir": self.run_dir,
            "engine": self.engine, "vllm": self.vllm.model_dump(),
            "model": self.model.model_dump(exclude_unset=True),  # (unset: the device's default, `prepare_session`)
            "warm_start": {"enabled": False}, "pipeline": {"nodes": nodes},
            "tracking": self.tracking.model_dump(),
        })  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class SessionSpec(JobSpec):
    """A session's spec: a `JobSpec` whose plan is open (see the module docstring)."""

    def plan(self) -> JobPlan:
        from plexrl.sessions.sampling import batch_limit  # (calls of sessions on one base: one engine call)

        plan = JobSpec.plan(self)
        nodes = {n: dataclasses.replace(p, commits=n in COMMITS, batchable=p.batchable and n in BATCHED)
                 for n, p in plan.nodes.items()}  # fmt: skip
        batch = batch_limit(self.config.model.lora is not None, self.generation, plan.batch)
        return dataclasses.replace(plan, nodes=nodes, baseline=(), open=True, batch=batch)

    def session_engine(self, engine: Any) -> Any:
        """Its engine on its service (`Service.load_job`): the job engine wrapped (`SessionEngine`: gradients
        kept between calls, the calls themselves)."""
        from plexrl.sessions.engine import SessionEngine

        return SessionEngine(engine)


def prepare_session(
    cfg: SessionConfig,
    *,
    job_id: str | None = None,
    user: str = "",
    first_call: int = 0,
    resume_state: Path | None = None,
    resume_run_id: str | None = None,
    cancel: threading.Event | None = None,
    device: str = "cpu",
) -> SessionSpec:
    """The spec of a session (job `job_id`, default its config's name): its base model found (a pretrained one
    converted on first use), its generation engine resolved by the job rule; resumed from `resume_state` (a
    checkpoint) with its calls numbered from `first_call`. `device`: the services' ("cpu" or "cuda"), whose
    defaults the session takes where its config leaves them unset, as a job does (`job_defaults`): on CUDA sdpa
    attention, and bfloat16 weights for a LoRA session (its frozen base; the adapter and its moments stay
    float32); a full fine-tuning session keeps float32 (its engine steps its weights in place, `SessionEngine`)."""
    from plexrl.job.devices import job_defaults
    from plexrl.job.models import check_cancelled, prepare_model
    from plexrl.sessions.operators import session_graph

    job = cfg.job_config()
    kind = device.split(":")[0]
    job = job_defaults(job, kind, group=job.model.lora is None)  # (`group`: float32 kept, as on a worker group)
    run_dir = Path(job.run_dir).resolve()
    check_cancelled(cancel, "the session's preparation")
    prepared = prepare_model(job.model, job.task, job.warm_start, None, job.seed, run_dir, cancel)
    generation, reason = resolve_engine(job, prepared.path)
    return SessionSpec(
        job_id=job_id or cfg.name, config=job, graph=session_graph(), raw=cfg.model_dump(mode="json"), task=None,
        tokenizer=prepared.tokenizer, model_path=prepared.path, run_dir=run_dir, generation=generation,
        generation_reason=reason, first_iteration=first_call, resume_state=resume_state, resume_run_id=resume_run_id,
        user=user,
    )  # fmt: skip


__all__ = ["BATCHED", "COMMITS", "OPEN_ITERATIONS", "SessionConfig", "SessionSpec", "prepare_session"]
