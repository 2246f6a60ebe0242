"""Batches: the typed, columnar records that flow along the edges of a pipeline.

Every edge carries one of these types; the graph checks at build time that a node's output type matches
the input type it feeds. Shapes use `P` = prompts in the batch, `G` = samples per prompt, `N = P*G`
rows of a rollout, `L` = padded sequence length (prompt + response), `T` = response length.

Tensors are torch tensors, but this module does not import torch, so that validating a pipeline stays fast.
A batch type may define `metrics()` to report per-iteration scalars; the driver prefixes them with the
node name (`verify/reward_mean`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


class Batch:
    """Base of all edge types. Subclasses are dataclasses; `metrics()` returns scalars worth logging."""

    def metrics(self) -> dict[str, float]:
        return {}


@dataclass(slots=True)
class Prompts(Batch):
    """P prompts of a verifiable task.

    `token_ids[i]` is the tokenized prompt (bos included, no padding); `answers[i]` is the ground truth the
    verifier checks against; `texts[i]` the prompt text.
    """

    texts: list[str]
    token_ids: list[list[int]]
    answers: list[str]

    def __len__(self) -> int:
        return len(self.texts)


@dataclass(slots=True)
class Rollouts(Batch):
    """N = P*G sampled responses, rows grouped by prompt (rows `g*G .. g*G+G-1` share prompt g).

    - `input_ids` [N, L] long: left-padded prompt followed by the response, right-padded.
    - `attention_mask` [N, L] long: 1 on real tokens (prompt and response, eos included).
    - `response_mask` [N, L] float: 1 on response tokens that the policy produced and the loss may use
      (eos included; padding and tool output excluded).
    - `behaviour_logprobs` [N, L] float: log-prob of each response token under the sampling policy
      (temperature applied) at its position; 0 elsewhere.
    - `prompt_len`: L_p, the padded prompt length (responses start at column L_p).
    - `response_lengths` [N] long; `finish_reasons[i]` in {"stop", "length"}; `completions[i]` decoded text.
    - `group_size` G; `answers[i]` ground truth per row; `weight_version` of the policy that sampled.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    behaviour_logprobs: Tensor
    prompt_len: int
    response_lengths: Tensor
    finish_reasons: list[str]
    completions: list[str]
    answers: list[str]
    group_size: int
    temperature: float
    weight_version: int = 0

    def __len__(self) -> int:
        return len(self.completions)

    def metrics(self) -> dict[str, float]:
        n = max(len(self.completions), 1)
        return {
            "response_length": float(self.response_lengths.float().mean()),
            "tokens": float(self.response_lengths.sum()),
            "truncated_frac": sum(r == "length" for r in self.finish_reasons) / n,
        }


@dataclass(slots=True)
class Rewards(Batch):
    """One scalar reward per rollout row: `values` [N] float. `correct` [N] bool where the task defines it."""

    values: Tensor
    correct: Tensor | None = None

    def metrics(self) -> dict[str, float]:
        out = {"reward_mean": float(self.values.float().mean())}
        if self.correct is not None:
            out["accuracy"] = float(self.correct.float().mean())
        return out


@dataclass(slots=True)
class Advantages(Batch):
    """Advantages `values`: per row [N] (broadcast over response tokens by the loss) or per token [N, L]
    (GAE). `returns` [N, L]: value targets, set by estimators that use a critic."""

    values: Tensor
    returns: Tensor | None = None

    def metrics(self) -> dict[str, float]:
        return {"abs_mean": float(self.values.abs().mean())}


@dataclass(slots=True)
class LogProbs(Batch):
    """Per-token log-probs `values` [N, L] float of one policy (`which`: "policy" or "reference")."""

    values: Tensor
    which: str = "reference"


@dataclass(slots=True)
class Values(Batch):
    """Critic estimates `values` [N, L] float: column j is V of the state before token j (0 where masked)."""

    values: Tensor

    def metrics(self) -> dict[str, float]:
        return {"mean": float(self.values.mean())}


@dataclass(slots=True)
class TrainStats(Batch):
    """Scalars of one training node (loss, kl, clip_frac, entropy, grad_norm, ...)."""

    stats: dict[str, float] = field(default_factory=dict)
    weight_version: int = 0

    def metrics(self) -> dict[str, float]:
        return dict(self.stats)


@dataclass(slots=True)
class EvalStats(Batch):
    """Held-out evaluation: greedy accuracy and mean response length over `size` problems."""

    accuracy: float
    size: int
    response_length: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        return {"accuracy": self.accuracy, "response_length": self.response_length}
