"""A job at run time, in two parts kept apart: `JobSpec`, what the job is (frozen, shipped once), and
`JobRun`, what happened to it (status, metrics per iteration, artifacts), the runner's record."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plexrl.errors import ConfigError
from plexrl.graph import PipelineGraph
from plexrl.job.checks import chunk_problems
from plexrl.job.config import JobConfig
from plexrl.job.generation import GenerationSizes, generation_sizes, sizing_problems
from plexrl.job.load import LoadedJob
from plexrl.paths import resolve
from plexrl.planner.events import JobPlan, NodePlan, RetryPlan
from plexrl.planner.records import JobStatus
from plexrl.sizes import count_parameters, estimate_state_bytes, lora_state_bytes, model_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a job IS: its validated config and pipeline, task, tokenizer and starting model. Frozen: built
    once by `prepare_job`, shipped to the workers once, never changed after submission. What HAPPENS to the
    job is its `JobRun`, a record the runner owns."""

    job_id: str
    config: JobConfig
    graph: PipelineGraph
    raw: dict[str, Any]
    task: Any
    tokenizer: Any
    model_path: Path
    run_dir: Path
    warm_start: dict[str, Any] = field(default_factory=dict)
    generation: str = "torch"  # the rollout engine `engine:` resolved to: "vllm" or "torch"
    generation_reason: str = ""
    # resuming from a checkpoint (plexrl serve): the first iteration to run, the engine state to load (written
    # by `Service.checkpoint` after iteration first_iteration - 1), and the MLflow run to continue
    first_iteration: int = 0
    resume_state: Path | None = None
    resume_run_id: str | None = None
    user: str = ""  # who submitted it (a server's fair-share ordering)
    resume_costs: dict[str, float] = field(default_factory=dict)  # the cost model's node times at the checkpoint
    checkpoint_every: int = 0  # checkpoint it on its service after every k-th iteration (a server's; 0: never)
    attempt: int = 1  # its placement count with this one (a server's journal: a resumed job's is > 1)
    attempts: int = 1  # placements in all: a job of a lost service is placed again while attempt < attempts

    def plan(self) -> JobPlan:
        """The planner's view of this job's pipeline (`JobPlan.of`, the one construction of a plan). Iterations
        keep their real numbers everywhere (planner, operators' `OpContext.iteration`, hooks, journal): a resumed
        job's plan starts at `first_iteration`, with no baseline pass, so a periodic node (`every`) stays in phase.
        Its config's `retry` becomes the delays after each failed run of a cpu node."""
        chunks, sliced = self.config.chunks, self.config.slices
        nodes = {
            n.name: NodePlan(
                n.runs_on,
                tuple(self.graph.deps(n.name)),
                n.every,
                n.operator.inline,
                chunks.get(n.name, 1),
                hasattr(n.operator, "batched") and chunks.get(n.name, 1) == 1 and n.name not in sliced,
            )
            for n in self.graph.nodes
        }
        policy = self.config.retry
        retry = RetryPlan(policy.attempts, tuple(policy.delay(k) for k in range(1, policy.attempts)))
        return JobPlan.of(
            nodes, self.config.iterations, order=tuple(self.graph.order), baseline=tuple(self.baseline_nodes()),
            first_iteration=self.first_iteration, state_bytes=self.state_bytes(), engine=self.engine(),
            user=self.user, costs=self.resume_costs, retry=retry, batch=self.batch_limit(),
            checkpoint_every=self.checkpoint_every, attempt=self.attempt, attempts=self.attempts,
        )  # fmt: skip

    def batch_limit(self) -> int:
        """How many jobs' rollouts its engine runs in one call (`JobPlan.batch`): a LoRA job on vLLM, the
        adapters one engine step mixes (`vllm_lora.MAX_LORAS`); 0 for every other job (it rolls out alone)."""
        if self.config.model.lora is None or self.generation != "vllm":
            return 0
        from plexrl.engines.vllm_lora import MAX_LORAS

        return MAX_LORAS

    def engine(self) -> tuple[str, int] | None:
        """The shared engine this job needs on its service: (key, device bytes), or None (a torch job of its
        own). Jobs with the same key share one per service: a vLLM engine (one copy of the weights plus the KV
        cache), or a LoRA base (its weights in `model.dtype`, read-only). A LoRA job that rolls out on vLLM needs
        both its base and a LoRA-enabled vLLM engine (the fp32 base, the KV cache, its adapter slots: see
        `vllm_lora.lora_engine_bytes`): one key for the pair, so the jobs of one base and one vLLM setting count
        both once per service. (A torch-rollout and a vLLM-rollout LoRA job of the same base on one service have
        two keys: the planner counts that base twice, an over-estimate.)"""
        from plexrl.job.devices import vllm_weight_dtype

        sizes = self.generation_sizes()
        model, budget, kv = self.config.model, sizes.max_model_len, sizes.kv_cache_bytes
        block = self.config.vllm.block_size
        if model.lora is not None:  # a LoRA job shares its base: one copy per service
            from plexrl.engines.lora import base_key

            base = base_key(self.model_path, model.dtype, model.gradient_checkpointing)
            base_bytes = model_bytes(self.model_path, model.dtype)
            if self.generation != "vllm":
                return base, base_bytes
            from plexrl.engines.vllm_lora import lora_engine_bytes, lora_generator_key

            key = lora_generator_key(self.model_path, model.lora.r, budget, block, model.dtype)
            vllm = lora_engine_bytes(self.model_path, model.lora.r, kv, vllm_weight_dtype(model.dtype))
            return f"{base}+{key}", base_bytes + vllm
        if self.generation != "vllm":
            return None
        from plexrl.engines.vllm_engine import generator_key

        key = generator_key(self.model_path, budget, block, model.dtype)
        return key, model_bytes(self.model_path, vllm_weight_dtype(model.dtype)) + kv

    def generation_sizes(self) -> GenerationSizes:
        """The vLLM engine's context and KV cache for this job (`plexrl.job.generation`): the prompt bound
        (`data.max_prompt_tokens`, else the data's longest rendered prompt) + the longest generation, and a
        cache that holds the rollout batch (unless `vllm.kv_cache_mb` is set)."""
        longest = getattr(self.task, "longest_prompt", None)
        return generation_sizes(self.config, self.graph, self.model_path, longest)

    def state_bytes(self) -> int:
        """Upper bound of the bytes the StateManager moves for this job (see `estimate_state_bytes`; a LoRA
        job's: its adapter and two AdamW moments, `lora_state_bytes`)."""
        lora = self.config.model.lora
        if lora is not None:
            return lora_state_bytes(self.model_path, lora.r, list(lora.target_modules))
        return estimate_state_bytes(model_bytes(self.model_path), self.graph, self.config.model.dtype)

    def inputs(self, node: str) -> dict[str, str]:
        """Input port -> the node whose output feeds it."""
        return dict(self.graph.node(node).inputs)

    @property
    def model_dir(self) -> Path | None:
        """Where the runner saves the final model when the job is done (None: not saved)."""
        return self.run_dir / "jobs" / self.job_id / "model" if self.config.tracking.log_model else None

    def baseline_nodes(self) -> list[str]:
        """Periodic nodes that read no data (evaluations) also run once before the first iteration; their
        metrics are logged at step 0, the starting point of every curve."""
        return [n.name for n in self.graph.nodes if n.every is not None and not n.inputs]

    def eval_metric(self) -> str | None:
        """The held-out accuracy metric of this job's pipeline, if it has an evaluation node."""
        from plexrl.batch import EvalStats

        for n in self.graph.nodes:
            if issubclass(n.operator.output, EvalStats):
                return f"{n.name}/accuracy"
        return None


@dataclass(slots=True, eq=False)
class JobRun:
    """What happened to one job: the client's record, owned by the runner (hooks may read it and add their
    own keys to `tracking` and `artifacts`; they never touch the spec)."""

    spec: JobSpec
    status: JobStatus = "queued"
    iterations_done: int = 0
    error: str = ""
    service: str | None = None  # where the planner placed it
    history: list[dict[str, float]] = field(default_factory=list)
    artifacts: dict[str, Path] = field(default_factory=dict)
    tracking: dict[str, Any] = field(default_factory=dict)
    submitted_at: float | None = None
    started_at: float | None = None  # placed on a service
    finished_at: float | None = None
    service_lost: bool = False  # it failed because its service was lost
    again: bool = False  # ... and the planner places it again (`FailJob.again`): its server resumes it elsewhere
    held: str = ""  # why the planner holds it queued for its user's limits ("" : it does not)

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def config(self) -> JobConfig:
        return self.spec.config

    @property
    def graph(self) -> PipelineGraph:
        return self.spec.graph

    def series(self, name: str) -> list[float]:
        """Values of metric `name` over the job's history (baseline row first, when there is one)."""
        return [row[name] for row in self.history if name in row]

    def final_metric(self, name: str) -> float | None:
        for row in reversed(self.history):
            if name in row:
                return row[name]
        return None


def prepare_job(
    loaded: LoadedJob, job_id: str | None = None, cancel: threading.Event | None = None, device: str = "cpu"
) -> JobSpec:
    """Generate the task and build (or load from cache) the warm-started model of a validated job.
    `cancel` (a server's: set when the job is cancelled or the server stops) is checked between the stages and
    between warm-start steps; once set, `plexrl.job.models.PreparationCancelled` is raised. `device`: where a
    warm start trains (the job's device)."""
    from plexrl.job.models import check_cancelled, prepare_model
    from plexrl.job.tasks import make_task

    cfg = loaded.config
    problems = chunk_problems(cfg.chunks, loaded.graph)
    if problems:  # `load_job` finds them first; a LoadedJob built otherwise is checked here
        raise ConfigError(problems, loaded.source)
    run_dir = Path(cfg.run_dir).resolve()
    check_cancelled(cancel, "the preparation")
    task: Any
    if cfg.data is not None:  # data from files: the model (pretrained or a path) first, its tokenizer renders
        from plexrl.job.tasks.dataset import make_dataset_task

        prepared = prepare_model(cfg.model, cfg.task, cfg.warm_start, None, cfg.seed, run_dir, cancel, device)
        check_cancelled(cancel, "the preparation (after the model)")
        cache = resolve(cfg.data.cache_dir) if cfg.data.cache_dir else run_dir / "cache" / "data"
        task = make_dataset_task(cfg.data, prepared.tokenizer, tokenizer_dir=prepared.path, cache_dir=cache)
    else:
        task = make_task(cfg.task)
        check_cancelled(cancel, "the preparation (after the task's data)")
        prepared = prepare_model(cfg.model, cfg.task, cfg.warm_start, task, cfg.seed, run_dir, cancel, device)
    log.info(
        "model %s (%s): warm start %s steps, held-out accuracy %s, %.1fs",
        prepared.path,
        "cached" if prepared.cached else "built",
        prepared.warm_start_steps,
        prepared.warm_start_accuracy,
        prepared.warm_start_seconds,
    )
    generation, reason = resolve_engine(cfg, prepared.path)
    log.info("job %s: rollouts on %s (%s)", job_id or cfg.name, generation, reason)
    if generation == "vllm":  # PlexRL's sentence, before vLLM says it its own way
        problems = sizing_problems(cfg, loaded.graph, prepared.path, getattr(task, "longest_prompt", None))
        if problems:
            raise ConfigError(problems, loaded.source)
    return JobSpec(
        generation=generation,
        generation_reason=reason,
        job_id=job_id or cfg.name,
        config=cfg.model_copy(deep=True),  # the spec's own copy: later edits of `loaded` do not reach it
        graph=loaded.graph,
        raw=loaded.raw,
        task=task,
        tokenizer=prepared.tokenizer,
        model_path=prepared.path,
        run_dir=run_dir,
        warm_start={
            "steps": prepared.warm_start_steps,
            "accuracy": prepared.warm_start_accuracy,
            "seconds": prepared.warm_start_seconds,
            "cached": prepared.cached,
        },
    )


LORA_ON_VLLM_CPU = (
    "vLLM's CPU build generates with a LoRA adapter ~3x slower than the torch engine (SmolLM2-135M, r 16: 13.5 "
    "vs 43.3 tokens/s; benchmarks/engine_choice.py --lora 16); `engine: vllm` uses it anyway"
)


def resolve_engine(cfg: JobConfig, model_path: Path) -> tuple[str, str]:
    """The rollout engine for `engine: auto | vllm | torch`, with the reason: auto picks the torch engine for
    models under `vllm.auto_min_params` parameters (the faster one there; vLLM is not even imported), else
    vLLM when it is installed and can serve the model (and a LoRA job's adapter), else torch; a LoRA job stays
    on torch where vLLM is its CPU build (`LORA_ON_VLLM_CPU`)."""
    if cfg.engine == "torch":
        return "torch", "engine: torch"
    from plexrl.engines.vllm_engine import model_problem, vllm_cpu_build
    from plexrl.job.config import auto_engine_rule

    if cfg.engine == "auto":  # a LoRA job by the same rule, on its base's size
        small = auto_engine_rule(count_parameters(model_path), cfg.vllm.auto_min_params)
        if small:
            return "torch", f"engine: auto, and {small}"

    why = model_problem(model_path)
    lora = cfg.model.lora
    if lora is not None and not why:  # vLLM applies the job's adapter (plexrl/engines/vllm_lora.py)
        from plexrl.engines.vllm_lora import lora_vllm_problem

        # on CUDA in the job's dtype, where vLLM's LoRA kernels refuse fp32 (plexrl.devices.vllm_problem)
        why = lora_vllm_problem(lora.r, lora.target_modules, cfg.model.dtype, cuda=not vllm_cpu_build())
    if cfg.engine == "vllm":
        if why:
            raise ValueError(f"engine: vllm cannot serve {model_path}: {why}; or set `engine: torch`")
        return "vllm", "engine: vllm"
    if why:
        return "torch", f"engine: auto, and {why}"
    if lora is not None and vllm_cpu_build():
        return "torch", f"engine: auto, and {LORA_ON_VLLM_CPU}"
    return "vllm", "engine: auto, vLLM is installed and supports the model, which is large enough to gain from it"
