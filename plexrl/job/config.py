"""The one typed source of truth for job configuration (pydantic, `extra="forbid"` everywhere): `JobConfig`
and its sections (the model's in `plexrl.job.model_config`, data files' in `plexrl.data.config`). Schema
only: reading, overriding, validating and compiling a job is `plexrl.job.load.load_job`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from plexrl.data.config import DataConfig
from plexrl.job.model_config import LoRAConfig as LoRAConfig  # re-exported: the config models have one home
from plexrl.job.model_config import ModelConfig, StrictModel


class TaskConfig(StrictModel):
    """A verifiable task generated from a seed, with disjoint train and held-out splits."""

    name: Literal["arithmetic", "tool_arithmetic", "code", "copy"] = Field(
        "arithmetic",
        description="Task family: `arithmetic` (multi-digit addition, answered directly), `tool_arithmetic` "
        "(multiplication, solved by calling the calculator tool; see plexrl/episodes.py for the tag format), "
        "`code` (write a Python expression in x from input/output examples of a*x+b with `digits`-digit a and "
        "b, rewarded by code_unit_tests in the sandbox on other inputs; see plexrl/job/tasks/code.py) or `copy` "
        "(copy a digit sequence of heavy-tailed length: long-tailed rollouts; see plexrl/job/tasks/copy.py).",
    )
    digits: int = Field(3, ge=1, le=9, description="Digits per operand (tool_arithmetic: of the first operand).")
    digits_b: int | None = Field(
        None, ge=1, le=9, description="tool_arithmetic: digits of the second operand (default: `digits`)."
    )
    tool_demo_frac: float = Field(
        0.2,
        ge=0,
        le=1,
        description="tool_arithmetic: share of warm-start demonstrations that call the tool (the rest answer "
        "directly), so that RL has a tool-use rate to raise.",
    )
    length_alpha: float = Field(
        1.2,
        gt=0,
        le=10,
        description="copy: Pareto shape of the sequence length, P(L >= k) = k**-alpha (smaller: heavier tail).",
    )
    max_length: int = Field(96, ge=1, le=4096, description="copy: longest sequence (the tail is clipped here).")
    train_size: int = Field(200000, ge=16, description="Problems in the train split.")
    eval_size: int = Field(500, ge=8, le=100000, description="Problems in the held-out split.")
    seed: int = Field(1234, description="Seed of the data generator (independent of the job seed).")

    @model_validator(mode="after")
    def _enough_problems(self) -> TaskConfig:
        def count(digits: int) -> int:
            return 10**digits - (10 ** (digits - 1) if digits > 1 else 0)

        if self.name == "copy":
            if self.digits_b is not None:
                raise ValueError("digits_b applies to task tool_arithmetic only; remove it (copy uses max_length)")
            return self  # sequences may repeat (plexrl/job/tasks/copy.py): no count of distinct problems
        if self.name == "arithmetic" and self.digits_b is not None:
            raise ValueError("digits_b applies to task tool_arithmetic only; remove it (addition uses `digits`)")
        space = count(self.digits) * count(self.digits_b or self.digits)
        if self.train_size + self.eval_size > space:
            shape = f"{self.digits}x{self.digits_b}-digit" if self.digits_b else f"{self.digits}-digit"
            raise ValueError(
                f"train_size + eval_size = {self.train_size + self.eval_size} exceeds the {space} distinct "
                f"{shape} problems; lower them or raise digits"
            )
        return self


class WarmStartConfig(StrictModel):
    """Supervised warm start on the train split, stopped once held-out greedy accuracy reaches a target."""

    enabled: bool = Field(True, description="Run the warm start (cached under run_dir/cache).")
    max_steps: int = Field(3000, ge=0, description="Upper bound on optimizer steps.")
    batch_size: int = Field(128, ge=1, description="Sequences per step.")
    lr: float = Field(1e-3, gt=0, lt=1, description="AdamW learning rate (the peak, with a schedule).")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up from 0 over this many steps.")
    decay_steps: int = Field(
        0,
        ge=0,
        description="Cosine decay of the learning rate over this many steps after the warm-up, down to "
        "`lr * min_lr_ratio`, then held there; 0: constant after the warm-up.",
    )
    min_lr_ratio: float = Field(0.05, ge=0, le=1, description="Final learning rate of the decay, as a share of lr.")
    decay_from_accuracy: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Hold the peak learning rate after the warm-up until an accuracy check reaches this, then "
        "start the decay there (so a seed whose loss plateaus longer is not decayed before it learns); None: "
        "decay right after the warm-up.",
    )
    adam_beta2: float = Field(0.98, ge=0, lt=1, description="AdamW beta2.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping.")
    stop_at_accuracy: float = Field(
        0.25, gt=0, le=1, description="Stop when held-out greedy accuracy reaches this (checks every eval_every)."
    )
    eval_every: int = Field(10, ge=1, description="Steps between accuracy checks.")
    eval_size: int = Field(500, ge=8, description="Held-out problems used by the checks.")
    keep_optimizer: bool = Field(True, description="Hand the warm start's AdamW state on to RL training.")


class NodeConfig(StrictModel):
    """One node of an explicitly listed pipeline."""

    name: str = Field(description="Unique node name.")
    op: str = Field(description="Built-in operator name, or dotted path `pkg.module:operator`.")
    params: dict[str, Any] = Field(default_factory=dict, description="Operator parameters.")
    inputs: dict[str, str] = Field(default_factory=dict, description="Input port -> source node (the edges).")
    after: list[str] = Field(default_factory=list, description="Extra ordering edges: run after these nodes.")
    every: int | None = Field(None, description="Run only every N iterations (and on the last).")


class PipelineConfig(StrictModel):
    """Either a built-in (or dotted-path) pipeline `name` with `params`, or an explicit list of `nodes`."""

    name: str | None = Field(
        None, description="Built-in pipeline or `pkg.module:builder`; grpo when neither name nor nodes is given."
    )
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the pipeline builder.")
    nodes: list[NodeConfig] | None = Field(None, description="Explicit nodes; edges come from their inputs.")

    @model_validator(mode="after")
    def _one_of(self) -> PipelineConfig:
        if self.name is None and self.nodes is None:
            self.name = "grpo"  # the default algorithm
        if self.name is not None and self.nodes is not None:
            raise ValueError("give either `name` (a built-in pipeline such as grpo) or `nodes`, not both")
        if self.nodes is not None and self.params:
            raise ValueError("`params` applies to a named pipeline; with `nodes`, put params on each node")
        return self


class TrackingConfig(StrictModel):
    """MLflow tracking. The default store is a sqlite file under the run directory; the environment
    variable MLFLOW_TRACKING_URI, or `uri`, overrides it."""

    mlflow: bool = Field(True, description="Log params, metrics and artifacts to MLflow.")
    experiment: str = Field("plexrl", min_length=1, description="MLflow experiment name.")
    uri: str | None = Field(None, description="Tracking URI; default sqlite:///<run_dir>/mlflow.db.")
    log_model: bool = Field(True, description="Log the final model as an artifact.")
    progress: bool = Field(
        True, description="Show progress: a bar on a terminal, else a line every 30 s (a log file, CI, tmux)."
    )


class RetryConfig(StrictModel):
    """Retries of a cpu node whose operator raised (or whose CPU worker died): the node runs again on the same
    inputs after `backoff_s`, then `backoff_s * factor`, ... (at most `max_backoff_s`), up to `attempts` runs in
    all; then the job alone fails with the operator's last error. Exact: a cpu node's randomness comes from
    (seed, iteration, node), so a retry computes what the first run would have. Service nodes are not
    retried (one that raised may have changed the job's weights or optimizer half-way); a server resumes such
    a job from its checkpoint only when its service is lost."""

    attempts: int = Field(1, ge=1, le=20, description="Runs of a cpu node in all (1: no retry).")
    backoff_s: float = Field(1.0, ge=0, le=3600, description="Seconds before the first retry.")
    factor: float = Field(2.0, ge=1, le=10, description="Each later wait is this many times the previous one.")
    max_backoff_s: float = Field(60.0, ge=0, le=3600, description="Longest wait between two runs.")

    def delay(self, failures: int) -> float:
        """Seconds to wait after the `failures`-th failed run (1-based) before the next one.

        >>> RetryConfig(attempts=4, backoff_s=0.5, factor=2, max_backoff_s=1.5).delay(3)
        1.5
        """
        return min(self.backoff_s * self.factor ** (failures - 1), self.max_backoff_s)


# engine: auto's size threshold. Evidence (docs/benchmarks.md, "Which engine for which model"), measured on 2
# CPU cores, one torch thread: the main job's 0.53M-parameter model ran its rollouts (64 x 8, <= 6 tokens) in
# 0.072 s on torch and 0.193 s on vLLM (2.7x slower; `make demo` 157 s vs 246 s); a 31.6M-parameter model
# generated 1.6x (greedy) to 3.9x (sampled) faster on vLLM. The crossover lies between: 10M until
# benchmarks/engine_choice.py is re-measured alone on the sizes in between.
AUTO_MIN_PARAMS = 10_000_000


def auto_engine_rule(params: int, min_params: int) -> str | None:
    """Why `engine: auto` keeps a model of `params` parameters on the torch engine, or None when its size
    does not rule vLLM out (vLLM may still be missing or unable to serve the model). Pure.

    >>> auto_engine_rule(530_000, 10_000_000) is not None
    True
    >>> auto_engine_rule(31_600_000, 10_000_000) is None
    True
    """
    if params >= min_params:
        return None
    return (
        f"the model has {params / 1e6:.2f}M parameters, under vllm.auto_min_params ({min_params / 1e6:g}M): "
        "the torch engine generates faster for models this small (benchmarks/engine_choice.py)"
    )


class VLLMConfig(StrictModel):
    """The vLLM generation engine (used when `engine` resolves to vllm)."""

    kv_cache_mb: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="KV cache size (MiB); counted in the service's device budget. None: sized from the job, to "
        "hold its rollout batch (batch_size x n sequences of the longest prompt + max_new_tokens; "
        "plexrl/job/generation.py).",
    )
    block_size: int | None = Field(
        None,
        ge=16,
        le=256,
        multiple_of=16,
        description="KV-cache block size in tokens (None: vLLM's default, 128 on CPU). Prefix caching reuses whole "
        "blocks only: a shared prefix shorter than a block (a system prompt, worked examples, the n samples of "
        "one prompt) is recomputed; 32 (the CPU attention's smallest; 16 on CUDA) lets it be reused.",
    )
    auto_min_params: int = Field(
        AUTO_MIN_PARAMS,
        ge=0,
        description="engine: auto runs rollouts on vLLM only for models with at least this many parameters; "
        "smaller ones generate faster on the torch engine (vLLM's per-step scheduling costs more than their "
        "forward). 0: vLLM whenever it can serve the model. See auto_engine_rule.",
    )


class JobConfig(StrictModel):
    """One RLVR job: pipeline + model + data + hyper-parameters + iterations + seed."""

    name: str = Field("grpo-arithmetic", description="Job name (MLflow run name).")
    seed: int = Field(0, description="Seed of everything random in the job.")
    iterations: int = Field(600, ge=1, description="Pipeline iterations to run.")
    run_dir: str = Field("runs", description="Directory for caches, MLflow store, timelines and models.")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: all cores).")
    engine: Literal["auto", "vllm", "torch"] = Field(
        "auto",
        description="Generation (rollout) engine: vllm, torch, or auto = vllm when installed and the model is "
        "supported (and large enough: vllm.auto_min_params), else torch. Training always runs on torch; the rollout "
        "side gets its weights after each update (a LoRA job's: its adapter only, under a vLLM LoRARequest).",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)  # type: ignore[arg-type]
    model: ModelConfig = Field(default_factory=ModelConfig)  # type: ignore[arg-type]
    task: TaskConfig = Field(default_factory=TaskConfig)  # type: ignore[arg-type]
    data: DataConfig | None = Field(
        None,
        description="Prompts, ground truths and rewards from files (plexrl/data/, plexrl/rewards.py; "
        "docs/data-and-rewards.md) instead of the generated `task`.",
    )
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)  # type: ignore[arg-type]
    pipeline: PipelineConfig = Field(default_factory=lambda: PipelineConfig(name="grpo", nodes=None))
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)  # type: ignore[arg-type]
    retry: RetryConfig = Field(default_factory=RetryConfig)  # type: ignore[arg-type]
    chunks: dict[str, Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=dict,
        description="Function-level preemption: pipeline node name -> number of chunks it runs as, e.g. "
        "`{rollout: 4}`. Each chunk runs on a slice of the node's prompts (whole groups) with its own seed; "
        "between two chunks the service may run another job's node. Only service nodes of chunkable "
        "operators (`rollout`); 1 or absent: the node runs whole. Chunking changes the samples (per-chunk "
        "seeds), not what multiplexing does to them.",
    )
    slices: dict[str, Annotated[int, Field(ge=1, le=1_000_000)]] = Field(
        default_factory=dict,
        description="Decode-step preemption: pipeline node name -> decode steps per slice, e.g. `{rollout: 16}`. "
        "The node's generation runs K steps at a time and pauses in between (its KV cache kept on the service, "
        "its job kept on device), so the service may run another job's node between two slices. Only sliceable "
        "service operators (`rollout`). The torch engine samples exactly what an unsliced run samples; vLLM "
        "resubmits unfinished rows with their prefix (partial rollouts: same distribution, other samples).",
    )

    @model_validator(mode="after")
    def _warm_start_fits(self) -> JobConfig:
        if self.data is not None:
            if self.model.path is None and self.model.pretrained is None:
                raise ValueError(
                    "a job on data files trains an existing model: set model.pretrained (e.g. "
                    "smollm2-135m-instruct) or model.path (a local HF directory)"
                )
            if self.warm_start.enabled:
                raise ValueError(
                    "a job on data files has no demonstrations to warm-start on: set warm_start.enabled: false"
                )
            return self
        if self.warm_start.enabled and self.warm_start.batch_size > self.task.train_size:
            raise ValueError(
                f"warm_start.batch_size ({self.warm_start.batch_size}) exceeds task.train_size "
                f"({self.task.train_size}); lower the batch or raise the train split"
            )
        return self


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts to dotted keys (lists kept as values), for MLflow params."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
