"""What `plexrl simulate` reads: accelerators, models, parallel layouts, the workload of one RLVR step,
deployments, and a trace of job arrivals. One typed source of truth (pydantic, `extra="forbid"`); every
constant lives in YAML (`configs/sim/`) with a comment that names its source, never in code.

A scenario YAML names an accelerator profile and a model profile from `configs/sim/profiles.yaml` (or gives
them inline), and may override any field of the profile with `accelerator_set:` / `model_set:`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from plexrl.errors import ConfigError, Problem
from plexrl.job.model_config import StrictModel
from plexrl.yamlio import load_yaml_file

GB = 1e9


class Accelerator(StrictModel):
    """One accelerator and its links, as the cost models use them."""

    name: str = Field(description="A label, e.g. 'H800-SXM5-80GB'.")
    peak_tflops: float = Field(gt=0, description="Dense bf16 peak, TFLOP/s.")
    hbm_gb: float = Field(gt=0, description="Device memory, GB.")
    hbm_tbps: float = Field(gt=0, description="Device memory bandwidth, TB/s.")
    host_gbps: float = Field(gt=0, description="Device<->host copy bandwidth per accelerator with all of a node's "
                             "accelerators copying at once, GB/s.")  # fmt: skip
    disk_gbps: float = Field(gt=0, description="Local NVMe bandwidth per accelerator, GB/s.")
    net_gbps: float = Field(gt=0, description="Inter-node network bandwidth per accelerator, GB/s.")
    host_gb: float = Field(256, gt=0, description="Host DRAM per accelerator (a node's DRAM / its accelerators), "
                           "GB: what offloaded and swapped-out states must fit in.")  # fmt: skip
    per_node: int = Field(8, ge=1, description="Accelerators per node (they share one host's DRAM and CPUs).")


class Model(StrictModel):
    """A transformer's size and its KV-cache geometry (dense: `active_b == params_b`)."""

    name: str = Field(description="A label, e.g. 'Qwen2.5-7B'.")
    params_b: float = Field(gt=0, description="Total parameters, billions.")
    active_b: float = Field(gt=0, description="Parameters used per token, billions (MoE: the activated ones).")
    layers: int = Field(ge=1, description="Decoder layers.")
    kv_heads: int = Field(ge=1, description="Key/value heads (GQA).")
    head_dim: int = Field(ge=1, description="Dimension of one head.")
    experts: int = Field(0, ge=0, description="Routed experts per MoE layer (0: dense).")
    experts_per_token: int = Field(0, ge=0, description="Routed experts each token uses (MoE).")

    @model_validator(mode="after")
    def _moe(self) -> Model:
        if self.active_b > self.params_b:
            raise ValueError("active_b cannot exceed params_b")
        if (self.experts == 0) != (self.experts_per_token == 0) or self.experts_per_token > self.experts:
            raise ValueError("give both experts and experts_per_token (<= experts), or neither (dense)")
        return self

    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2.0  # K and V, bf16

    def expert_params_b(self) -> float:
        """Parameters in routed experts (billions): total - active = experts * (1 - k / E)."""
        if not self.experts:
            return 0.0
        return (self.params_b - self.active_b) / (1 - self.experts_per_token / self.experts)


class TrainLayout(StrictModel):
    """How the training job is split (Megatron-style). Accelerators = tp * pp * dp; EP lives inside dp * tp."""

    tp: int = Field(1, ge=1, description="Tensor parallel size.")
    pp: int = Field(1, ge=1, description="Pipeline parallel size.")
    dp: int = Field(1, ge=1, description="Data parallel size.")
    ep: int = Field(1, ge=1, description="Expert parallel size (MoE).")
    zero: Literal[0, 1, 2, 3] = Field(2, description="ZeRO stage: 1 shards optimizer states, 2 also gradients.")
    offload: bool = Field(False, description="Optimizer states live in host memory (ZeRO-Offload).")
    microbatches: int = Field(32, ge=1, description="Pipeline micro-batches per step (sets the PP bubble).")

    @property
    def accelerators(self) -> int:
        return self.tp * self.pp * self.dp


class Efficiency(StrictModel):
    """Achieved fractions of peak, and fixed overheads."""

    train_mfu: float = Field(gt=0, le=1, description="Model FLOPs utilisation of a training step.")
    prefill_mfu: float = Field(0.5, gt=0, le=1, description="MFU of rollout prefill.")
    decode_bw: float = Field(gt=0, le=1, description="Fraction of HBM bandwidth a decode step reaches.")
    decode_mfu: float = Field(0.5, gt=0, le=1, description="Cap on decode compute (large batches).")
    decode_step_ms: float = Field(ge=0, description="Fixed cost of one decode step (scheduling, sampling, "
                                  "kernel launches, TP all-reduce latency), ms.")  # fmt: skip
    internode_step_ms: float = Field(10, ge=0, description="Extra cost of one decode step when a rollout replica's "
                                     "TP spans nodes (its all-reduces cross the network), ms.")  # fmt: skip
    max_num_seqs: int = Field(256, ge=1, description="Concurrent sequences per rollout replica (vLLM max_num_seqs).")
    memory_utilization: float = Field(0.9, gt=0, le=1, description="Share of HBM the rollout engine may use.")
    sync_fixed_s: float = Field(ge=0, description="Fixed cost of pushing new weights to the rollout engines, s.")
    switch_fixed_s: float = Field(ge=0, description="Colocated: fixed cost of switching the accelerators between "
                                  "the training and the rollout engine (each way), s.")  # fmt: skip
    train_reserve_gb: float = Field(ge=0, description="Device memory a training step needs beyond the job's state "
                                    "(activations, buffers), GB per accelerator.")  # fmt: skip
    cpu_adam_gparams_s: float = Field(3.9, gt=0, description="ZeRO-Offload: billions of parameters one node's "
                                      "CPUs update per second with CPU-Adam.")  # fmt: skip


class LengthDist(StrictModel):
    """Response lengths in tokens: lognormal(median, sigma), capped at `max_tokens` (the long tail), or an
    empirical list (e.g. fitted from a recorded run) drawn with replacement."""

    median: float = Field(1000, gt=0, description="Median response length, tokens.")
    sigma: float = Field(0.8, ge=0, description="Lognormal shape: larger = a longer tail.")
    max_tokens: int = Field(16384, ge=1, description="Generation cap (max_tokens / max_response_length).")
    empirical: list[int] | None = Field(None, description="Observed lengths to resample instead of the lognormal.")


class Latency(StrictModel):
    """A lognormal latency (seconds): median and shape."""

    median: float = Field(ge=0, description="Median, s.")
    sigma: float = Field(0.3, ge=0, description="Lognormal shape.")


class Workload(StrictModel):
    """One RLVR step of one job."""

    prompts: int = Field(ge=1, description="Prompts per step.")
    samples: int = Field(ge=1, description="Responses per prompt (group size).")
    prompt_tokens: int = Field(ge=1, description="Mean prompt length, tokens.")
    response: LengthDist = Field(default_factory=LengthDist, description="Response lengths.")  # type: ignore[arg-type]
    verify: Latency = Field(description="Reward verification of the whole batch (CPU pool), s.")
    tool_stall: Latency | None = Field(None, description="Agentic jobs: time the episode waits on tools per step "
                                       "(the accelerators hold the job but compute nothing), s.")  # fmt: skip
    forward_passes: float = Field(1.0, ge=0, description="Extra forward passes per step over the batch (old-policy "
                                  "log-probs: 1; plus a reference model for KL: 2).")  # fmt: skip
    steps: int = Field(20, ge=1, description="Training steps per job in the scenario.")


class LoRA(StrictModel):
    """Every job of the scenario is a LoRA job: the base is frozen (bf16), only the adapter trains, and its
    optimizer holds the adapter's state only (so ZeRO-Offload's optimizer offload does not apply)."""

    rank: int = Field(32, ge=1, description="Adapter rank (a label: the size is `params_b`).")
    params_b: float = Field(gt=0, description="Adapter parameters, billions (all linear layers at `rank`).")
    decode_overhead: float = Field(0.25, ge=0, description="Extra decode-step time when the rollout applies "
                                   "adapters unmerged (several adapters in one batch, Punica/S-LoRA kernels); "
                                   "a single job's rollout merges its adapter into its weights: none.")  # fmt: skip


Kind = Literal["colocated", "split-sync", "split-async", "plexrl", "plexrl-shared", "plexrl-engine", "time-slicing"]


class Deployment(StrictModel):
    """How a job's rollout and training are laid out on accelerators.

    - colocated: rollout and training time-share the job's own `train` accelerators (switch each way).
    - split-sync: rollout on `rollout_accelerators` of its own, training on its own pool; strictly alternating.
    - split-async: as split-sync, but one step off-policy: rollout of step k+1 overlaps training of step k.
    - plexrl: the paper's layout: each job's rollout on its own accelerators, training on a pool time-sliced
      by `jobs_per_pool` jobs by the planner (on-policy, like split-sync, unless `overlap: one-step`).
    - plexrl-shared: rollout and training of `jobs_per_pool` jobs on one shared pool (this system's own
      layout: colocated jobs multiplexed by the planner).
    - plexrl-engine: `jobs_per_pool` jobs share one rollout engine on the pool: their rollouts decode in the
      same continuous batches (another job's sequences fill a job's long tail), their trainings time-slice the
      pool (`plexrl.sim.engine`; an engine-level model, not the planner). LoRA scenarios: one base, resident
      once, each job's adapter; otherwise every job's rollout weights on the pool at once (if they fit).
    - time-slicing: exclusive time-slicing, the llm-d / OpenRL design: `jobs_per_pool` colocated jobs share one
      pool by a FIFO lock taken at each phase (rollout, then switch + train) and released after it; at each
      hand-over the holder's whole state goes to host and the next one's comes in, at the accelerator's host
      link bandwidth plus `switch_fixed_s` each way; nothing prefetched, no lookahead, no ordering
      (`plexrl.planner.policies.TimeSlicing`, `StateManager(exclusive=True)`). LoRA jobs do not share a base.
    """

    name: str = Field(description="Label in the report.")
    kind: Kind = Field(description="Layout kind (see the class docstring).")
    rollout_accelerators: int | None = Field(None, ge=1, description="Per job, split kinds and plexrl "
                                             "(default: the scenario's).")  # fmt: skip
    rollout_tp: int | None = Field(None, ge=1, description="Tensor parallel size of one rollout replica "
                                   "(default: the scenario's).")  # fmt: skip
    jobs_per_pool: int = Field(1, ge=1, description="plexrl kinds: jobs sharing one pool.")
    pool_scale: int = Field(1, ge=1, description="plexrl kinds: the pool is the training layout with dp x this "
                            "(a larger pool shared by more jobs: 3 jobs on 2x the accelerators).")  # fmt: skip
    overlap: Literal["none", "one-step"] = Field("none", description="plexrl: one-step off-policy overlap.")
    placement: str = Field("spread", description="Placement policy (plexrl kinds).")
    ordering: str = Field("hrrs", description="Ordering policy (plexrl kinds).")
    resident: bool = Field(False, description="Rollout on the pool (colocated, plexrl-shared): the training state "
                           "stays on device during rollout (no offload; it takes KV-cache room) instead of "
                           "being offloaded to host each step.")  # fmt: skip
    tail: float = Field(0.0, ge=0, lt=1, description="Rollout on the pool: once all but this share of the step's "
                        "sequences have ended, the rest move to `tail_accelerators` of the job's own and the pool "
                        "is free for other jobs (partial rollouts; 0: off).")  # fmt: skip
    tail_accelerators: int = Field(8, ge=1, description="With `tail`: the job's own accelerators for the tail.")
    tail_shared: bool = Field(False, description="With `tail`: one set of `tail_accelerators` per pool, shared by "
                              "its jobs' tails (which the pool's alternation puts in antiphase); the report gives "
                              "the share of tail time two overlapped, which this does not slow down.")  # fmt: skip
    tune: bool = Field(False, description="`plexrl simulate` searches this deployment's layout over the "
                       "scenario's `tune:` grid (rollout accelerators and TP; resident vs offloaded state) and "
                       "keeps the cheapest (GPU-hours per step).")  # fmt: skip

    @property
    def off_policy(self) -> bool:
        return self.kind == "split-async" or self.overlap == "one-step"

    @model_validator(mode="after")
    def _check(self) -> Deployment:
        if self.pool_scale != 1 and not self.kind.startswith("plexrl") and self.kind != "time-slicing":
            raise ValueError(f"kind {self.kind!r}: pool_scale is for the plexrl kinds and time-slicing")
        if self.kind in ("colocated", "split-sync", "split-async") and self.jobs_per_pool != 1:
            raise ValueError(f"kind {self.kind!r} gives each job its own accelerators: jobs_per_pool must be 1")
        if self.overlap == "one-step" and self.kind != "plexrl":
            raise ValueError("overlap: one-step is for kind plexrl (split-async is one-step already)")
        if self.tail_shared and (not self.tail or self.kind != "plexrl-shared"):
            raise ValueError("tail_shared needs tail > 0 and kind plexrl-shared (a pool of several jobs)")
        if self.tail and self.kind not in ("colocated", "plexrl-shared"):
            raise ValueError("tail is for kinds colocated and plexrl-shared (it moves the tail off the pool)")
        if self.kind == "plexrl-engine" and (self.tail or self.resident or self.overlap != "none" or self.tune):
            raise ValueError("kind plexrl-engine takes no tail, resident, overlap or tune (its rollout shares the "
                             "pool's engine; see docs/simulator.md)")  # fmt: skip
        if self.resident and self.kind not in ("colocated", "plexrl-shared", "time-slicing"):
            raise ValueError("resident is for kinds colocated, plexrl-shared and time-slicing (rollout on the pool)")
        return self


class Tune(StrictModel):
    """The grid `plexrl simulate` searches for each deployment with `tune: true` (the baselines)."""

    rollout_accelerators: list[int] = Field(default_factory=list, description="Rollout accelerators per job to "
                                            "try (split kinds; empty: the scenario's).")  # fmt: skip
    rollout_tp: list[int] = Field(default_factory=list, description="Rollout TP sizes to try (empty: the scenario's).")
    resident: list[bool] = Field([False, True], description="Colocated: offloaded and/or resident training state.")
    jobs: int = Field(2, ge=1, description="Jobs simulated per candidate (the baselines' jobs do not interact, so "
                      "a few stand for all; the winner is rerun with every job).")  # fmt: skip


class Scenario(StrictModel):
    """A fixed set of identical jobs of one model under several deployments (`plexrl simulate`)."""

    kind: Literal["scenario"] = Field("scenario", description="This file is a deployment comparison.")
    name: str = Field(description="Scenario label.")
    description: str = Field("", description="What it models and where the numbers come from.")
    accelerator: Accelerator = Field(description="The accelerator (a profile name or a mapping).")
    model: Model = Field(description="The model (a profile name or a mapping).")
    train: TrainLayout = Field(description="Training layout (one pool).")
    rollout_accelerators: int = Field(ge=1, description="Rollout accelerators per job in split deployments.")
    rollout_tp: int = Field(1, ge=1, description="Tensor parallel size of one rollout replica.")
    efficiency: Efficiency = Field(description="Achieved efficiencies and fixed overheads.")
    workload: Workload = Field(description="One step of one job.")
    cluster_accelerators: int = Field(2048, ge=1, description="Accelerators booked: sets the number of jobs "
                                      "(as many as the `baseline` deployment fits).")  # fmt: skip
    baseline: str = Field("split-async", description="Deployment name the savings are measured against.")
    jobs: int | None = Field(None, ge=1, description="Number of jobs (default: from cluster_accelerators).")
    deployments: list[Deployment] = Field(min_length=1, description="Deployments to compare.")
    rollout_samples: int = Field(32, ge=1, description="Rollout durations simulated per layout and drawn from.")
    seed: int = Field(0, description="Seed of every random draw.")
    sweep_accelerators: list[str] = Field(default_factory=list, description="Other accelerator profiles to "
                                          "rerun the comparison on (how the saving moves with the GPU).")  # fmt: skip
    tune: Tune = Field(default_factory=Tune, description="Layout grid of the deployments with `tune: true`.")  # type: ignore[arg-type]
    lora: LoRA | None = Field(None, description="Every job is a LoRA job (its baselines too: the same LoRA job on "
                              "its own allocation); none: full fine-tuning.")  # fmt: skip
    matched_step: float = Field(1.1, ge=1, description="Headline: the best saving among layouts whose step time is "
                                "at most this multiple of the strongest baseline's.")  # fmt: skip

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        names = [d.name for d in self.deployments]
        if len(set(names)) != len(names):
            raise ValueError(f"deployment names must be unique: {names}")
        if self.baseline not in names:
            raise ValueError(f"baseline {self.baseline!r} is not one of the deployments {names}")
        return self


class JobClass(StrictModel):
    """One kind of job in a trace: a model, its workload, and how long jobs of this kind run."""

    name: str = Field(description="Label.")
    weight: float = Field(gt=0, description="Relative frequency in the trace.")
    model: Model = Field(description="The model (a profile name or a mapping).")
    workload: Workload = Field(description="One step.")
    train_tp: int = Field(1, ge=1, description="Tensor parallel size of training within a service.")
    rollout_tp: int = Field(1, ge=1, description="Tensor parallel size of one rollout replica.")
    rollout_accelerators: int = Field(32, ge=1, description="deployment plexrl: the job's own rollout accelerators.")
    train_accelerators: int = Field(16, ge=1, description="`isolated`: the training accelerators a user books for "
                                    "one job of this class (its allocation is these plus its rollout's).")  # fmt: skip
    steps_median: float = Field(gt=0, description="Median steps per job (lognormal).")
    steps_sigma: float = Field(0.5, ge=0, description="Lognormal shape of steps per job.")


class Trace(StrictModel):
    """A seeded synthetic arrival trace replayed on one cluster under several placement policies."""

    kind: Literal["trace"] = Field("trace", description="This file is a trace replay.")
    name: str = Field(description="Trace label.")
    description: str = Field("", description="What it models.")
    accelerator: Accelerator = Field(description="The accelerator (a profile name or a mapping).")
    efficiency: Efficiency = Field(description="Achieved efficiencies and fixed overheads.")
    cluster_accelerators: int = Field(2048, ge=1, description="Accelerators in the cluster.")
    service_accelerators: int = Field(ge=1, description="Accelerators per service (one pool a job is placed on).")
    rollout_fleet: int = Field(0, ge=0, description="deployment plexrl: accelerators of the cluster set aside for the "
                               "jobs' own rollouts (a job is placed only when its rollout accelerators are free "
                               "there); the pools take the rest.")  # fmt: skip
    deployment: Literal["plexrl", "plexrl-shared"] = Field(
        "plexrl",
        description="plexrl: pools train, each job's rollout runs on accelerators of its own outside "
        "the pools (the paper's layout); plexrl-shared: rollout and training share the pool.",
    )
    steps_per_node: int = Field(1, ge=1, description="Steps one simulated node stands for (durations summed): "
                                "coarser is faster; docs/simulator.md measures the error.")  # fmt: skip
    days: float = Field(gt=0, description="Arrivals span this many days.")
    jobs: int = Field(ge=1, description="Jobs in the trace.")
    burst: float = Field(0.0, ge=0, le=1, description="Share of jobs arriving in weekday working hours bursts "
                         "(the rest uniformly).")  # fmt: skip
    classes: list[JobClass] = Field(min_length=1, description="The job mix.")
    placements: list[str] = Field(
        ["isolated", "pack", "spread", "spread+backfill"],
        description="Policies (and `time-slicing`: spread+backfill's admission, each pool run by the llm-d / OpenRL "
        "design: a FIFO lock per phase, whole-state switches).",
    )
    ordering: str = Field("hrrs", description="Ordering policy for every placement.")
    max_load: float = Field(1.0, gt=0, description="Load cap of pack and spread+backfill.")
    rollout_samples: int = Field(16, ge=1, description="Rollout durations simulated per class and drawn from.")
    seed: int = Field(0, description="Seed of the trace and every draw.")

    @property
    def services(self) -> int:
        return (self.cluster_accelerators - self.rollout_fleet) // self.service_accelerators

    @model_validator(mode="after")
    def _fleet(self) -> Trace:
        if self.services < 1:
            raise ValueError(
                f"rollout_fleet {self.rollout_fleet} leaves no pool of {self.service_accelerators} in "
                f"{self.cluster_accelerators} accelerators: shrink the fleet or the pools"
            )
        if self.deployment == "plexrl":
            need = max(c.rollout_accelerators for c in self.classes)
            if need > self.rollout_fleet:
                raise ValueError(
                    f"rollout_fleet {self.rollout_fleet} cannot hold one job's rollout ({need} accelerators): the "
                    "fleet is counted inside cluster_accelerators; raise it"
                )
        return self


# -- loading ---------------------------------------------------------------------------------------------
PROFILES = Path(__file__).resolve().parents[2] / "configs" / "sim" / "profiles.yaml"


def load_profiles(path: Path = PROFILES) -> dict[str, dict[str, dict[str, Any]]]:
    """The named accelerator and model profiles (`accelerators:` and `models:` mappings)."""
    if not path.exists():
        return {"accelerators": {}, "models": {}}
    raw = load_yaml_file(path) or {}
    return {"accelerators": raw.get("accelerators", {}), "models": raw.get("models", {})}


def _resolve(raw: dict[str, Any], key: str, table: dict[str, dict[str, Any]], problems: list[Problem]) -> None:
    """Replace a profile name at raw[key] by its mapping, then apply raw[key + '_set'] overrides."""
    value = raw.get(key)
    if isinstance(value, str):
        if value not in table:
            problems.append(Problem(key, f"unknown profile {value!r}: use one of {sorted(table)} or a mapping"))
            return
        raw[key] = dict(table[value])
    overrides = raw.pop(f"{key}_set", None)
    if overrides is not None and isinstance(raw.get(key), dict):
        raw[key] = {**raw[key], **overrides}


def parse_sim(raw: Any, source: str = "", profiles: Path = PROFILES) -> Scenario | Trace:
    """Validate a scenario or trace mapping; raise one `ConfigError` naming every problem."""
    if not isinstance(raw, dict):
        raise ConfigError([Problem("(top)", "expected a mapping: see configs/sim/*.yaml")], source)
    raw = dict(raw)
    tables = load_profiles(profiles)
    problems: list[Problem] = []
    _resolve(raw, "accelerator", tables["accelerators"], problems)
    _resolve(raw, "model", tables["models"], problems)
    for i, cls in enumerate(raw.get("classes") or []):
        if isinstance(cls, dict):
            cls = raw["classes"][i] = dict(cls)
            _resolve(cls, "model", tables["models"], problems)
    if problems:
        raise ConfigError(problems, source)
    model = Trace if raw.get("kind") == "trace" else Scenario
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(
            [
                Problem(".".join(map(str, e["loc"])) or "(top)", f"{e['msg']} (see docs/simulator.md)")
                for e in exc.errors()
            ],
            source,
        ) from None


def load_sim(path: str | Path, overrides: dict[str, Any] | None = None) -> Scenario | Trace:
    """Load `configs/sim/NAME.yaml` (a scenario or a trace), with top-level overrides."""
    path = Path(path)
    if not path.exists():
        raise ConfigError([Problem("path", f"{path} does not exist: give a file under configs/sim/")], str(path))
    raw = load_yaml_file(path)  # bounded: no alias bombs, duplicate keys or huge numbers (plexrl.yamlio)
    if isinstance(raw, dict) and overrides:
        raw = {**raw, **overrides}
    return parse_sim(raw, str(path))
