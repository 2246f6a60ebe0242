"""The typed config of a job's data from files and of its rewards (pydantic, `extra="forbid"`).

`DataConfig` names the files, their columns, the prompt's framing and the reward terms; it is plain data:
validating it reads no file and calls no function (a user reward's dotted path is only checked for its
form here; `plexrl.rewards.build_reward` resolves it through `plexrl.roles`). Kept free of heavy imports and
of `plexrl.job.config` (which may hold a `data: DataConfig | None` field), so either module imports the other's
names without a cycle.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from plexrl.roles import parse_ref

BUILTIN_REWARDS = ("math", "numeric", "exact", "regex", "choice", "format")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ColumnMap(_Strict):
    """Which columns hold the prompt and the ground truth; unset: detected from the layout (see
    `plexrl/data/files.py`: verl's `prompt` + `reward_model.ground_truth`, or TRL's `prompt` + one of
    `answer`, `solution`, `ground_truth`)."""

    prompt: str | None = Field(
        None,
        min_length=1,
        description="Column of the prompt: a string, or a list of chat messages {role, content}. Default: `prompt`.",
    )
    answer: str | None = Field(
        None,
        min_length=1,
        description="Column of the ground truth; a dot reads a field of a struct column, e.g. "
        "`reward_model.ground_truth` (verl's layout, the default when a `reward_model` column exists).",
    )


class RewardTerm(_Strict):
    """One term of the reward: a built-in `name` or a user's `ref`, scaled by `weight`."""

    name: Literal["math", "numeric", "exact", "regex", "choice", "format"] | None = Field(
        None,
        description="Built-in reward: math (math-verify; \\boxed{} and GSM8K's `#### N`), numeric (final "
        "number within tolerance), exact (stripped text equality), regex (a pattern's capture group equals the "
        "ground truth, or any match scores 1), choice (multiple-choice letter), format (the completion has "
        "the required shape). See docs/data-and-rewards.md.",
    )
    ref: str | None = Field(
        None,
        description="A user reward as a dotted path `pkg.module:fn`, declared with "
        '`@plexrl.roles.declare("reward")` (per row) or `@plexrl.rewards.batched_reward` (batched).',
    )
    label: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="The term's name in metrics (`reward/<label>`); default: `name`, or the function name of `ref`.",
    )
    weight: float = Field(1.0, ge=-100, le=100, description="Weight of the term in the total reward.")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Parameters of the reward: checked against the built-in's parameter model, or passed as "
        "keyword arguments to a user reward.",
    )
    timeout_s: float = Field(
        5.0,
        gt=0,
        le=600,
        description="The term's time limit per call (a row; a whole batch for a batched user reward), built-in or "
        "user: the call runs in the term's worker process, which is killed when it passes the limit (the call "
        "scores 0 and is counted in reward_timeouts; 5 in a row fail the job).",
    )

    @model_validator(mode="after")
    def _one_of(self) -> RewardTerm:
        if (self.name is None) == (self.ref is None):
            raise ValueError(f"give either `name` (a built-in: {', '.join(BUILTIN_REWARDS)}) or `ref`, not both")
        if self.ref is not None and parse_ref(self.ref) is None:
            raise ValueError(f"ref {self.ref!r} is not a dotted path of the form 'pkg.module:fn' (no spaces)")
        if self.name is not None:
            from plexrl.reward_builtins import check_params  # the built-ins' parameter models: no user code runs

            check_params(self.name, self.params)
        return self

    @property
    def key(self) -> str:
        """The term's metric name: `label`, else `name`, else the attribute of `ref`."""
        if self.label:
            return self.label
        if self.name:
            return self.name
        assert self.ref is not None
        return self.ref.rsplit(":", 1)[1]


class DataConfig(_Strict):
    """A job's prompts and ground truths from files, with a held-out split and the reward that scores them."""

    train: str = Field(
        min_length=1,
        description="Train data: a .jsonl, .parquet or .csv file, or a directory written by "
        "`datasets.Dataset.save_to_disk`.",
    )
    held_out: str | None = Field(
        None, description="Held-out data in a file of the same kinds; unset: a seeded `held_out_fraction` of train."
    )
    held_out_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of train rows held out (seeded by `split_seed`) when `held_out` is unset; 0: none.",
    )
    split_seed: int = Field(0, description="Seed of the held-out draw (independent of the job seed).")
    columns: ColumnMap = Field(default_factory=ColumnMap, description="Prompt and answer columns (default: detected).")  # type: ignore[arg-type]
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="Drop rows whose rendered prompt has more tokens than this (counted and logged); unset: keep all.",
    )
    system_prompt: str | None = Field(
        None, description="A system message put before the prompt (rows that have their own system message keep it)."
    )
    format_instruction: str | None = Field(
        None,
        description="Text appended to the last user message, e.g. 'Put the final answer after \"Answer:\".'",
    )
    rewards: list[RewardTerm] = Field(
        default_factory=lambda: [RewardTerm.model_validate({"name": "math"})],
        min_length=1,
        description="The reward: a weighted sum of these terms, each logged by its label.",
    )
    cache_dir: str | None = Field(
        None,
        description="Where row indexes and Arrow copies of parquet/csv files are kept; default <run_dir>/cache/data.",
    )

    @model_validator(mode="after")
    def _unique_labels(self) -> DataConfig:
        keys = [t.key for t in self.rewards]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"reward labels {dup} repeat; give each term a distinct `label`")
        if self.held_out is not None and self.held_out_fraction:
            raise ValueError("give either `held_out` (a file) or `held_out_fraction`, not both")
        return self


__all__ = ["BUILTIN_REWARDS", "ColumnMap", "DataConfig", "RewardTerm"]
