"""Batches: the typed, columnar records that flow along the edges of a pipeline.

Every edge carries one of these types; the graph checks at build time that a node's output type matches
the input type it feeds. Shapes use `P` = prompts in the batch, `G` = samples per prompt, `N = P*G`
rows of a rollout, `L` = padded sequence length (prompt + response), `T` = response length.

Tensors are torch tensors, but this module does not import torch, so that validating a pipeline stays fast.
A batch type may define `metrics()` to report per-iteration scalars; the driver prefixes them with the
node name (`verify/reward_mean`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


class Batch:
    """Base of all edge types. Subclasses are dataclasses; `metrics()` returns scalars worth logging."""

    def metrics(self) -> dict[str, float]:
        return {}


def chunk_rows(rows: int, chunk: int, chunks: int) -> tuple[int, int]:
    """The rows [start, stop) that chunk `chunk` of `chunks` takes of `rows` (contiguous, in order, sizes
    differing by at most one; a chunk may be empty when rows < chunks).

    >>> [chunk_rows(4, k, 3) for k in range(3)]
    [(0, 1), (1, 2), (2, 4)]
    >>> [chunk_rows(2, k, 3) for k in range(3)]
    [(0, 0), (0, 1), (1, 2)]
    """
    if not 0 <= chunk < chunks:
        raise ValueError(f"chunk {chunk} of {chunks}: need 0 <= chunk < chunks")
    return chunk * rows // chunks, (chunk + 1) * rows // chunks


@dataclass(slots=True)
class Prompts(Batch):
    """P prompts of a verifiable task.

    `token_ids[i]` is the tokenized prompt (bos included, no padding); `answers[i]` is the ground truth the
    verifier checks against; `texts[i]` the prompt text; `positions[i]` the prompt's row in the task's train
    split (a task on data files: a user reward gets that row's prompt and extra fields), or empty where the
    task has no rows to point at (the generated tasks).
    """

    texts: list[str]
    token_ids: list[list[int]]
    answers: list[str]
    positions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.texts)

    def rows(self, start: int, stop: int) -> Prompts:
        """Prompts [start, stop) (a chunk of a chunked rollout: `chunk_rows`); may be empty."""
        return Prompts(
            self.texts[start:stop], self.token_ids[start:stop], self.answers[start:stop], self.positions[start:stop]
        )


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
    - `group_size` G; `answers[i]` ground truth per row; `weight_version` of the policy that sampled every
      row (one generate call samples all rows at one version; on-policy `train` checks it is the latest).
    - `token_versions` [N, L] long or None: the weight version that sampled each response token (-1 elsewhere),
      from a rollout run in slices of decode steps (`slices:`); `weight_version` is then the oldest of them.
      None: every token at `weight_version`.
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
    positions: list[int] = field(default_factory=list)
    token_versions: Tensor | None = None

    def __len__(self) -> int:
        return len(self.completions)

    @staticmethod
    def concat(parts: Sequence[Rollouts], pad_id: int) -> Rollouts:
        """The rows of `parts`, in order, re-padded to one layout: prompts left-padded to the longest padded
        prompt (`prompt_len`), responses right-padded to the widest response part, with `pad_id` in
        `input_ids` and 0 in the masks and log-probs. Rows of a part keep their tokens; only padding is
        added. Empty parts (0 rows, e.g. a chunk without prompts) are dropped; all empty: the first part.
        Every part must be a plain `Rollouts` from the same sampler: group size, temperature and weight
        version agree (else ValueError). Used by chunked rollouts and dynamic sampling's pool."""
        import torch

        if not parts:
            raise ValueError("no rollouts to concatenate")
        first = parts[0]
        for x in parts:
            if type(x) is not Rollouts:
                raise TypeError(f"only plain Rollouts concatenate, not {type(x).__name__}")
            if (x.group_size, x.temperature, x.weight_version) != (
                first.group_size,
                first.temperature,
                first.weight_version,
            ):
                raise ValueError(
                    "cannot concatenate rollouts from different samplers (group size "
                    f"{first.group_size} vs {x.group_size}, temperature {first.temperature} vs {x.temperature}, "
                    f"weight version {first.weight_version} vs {x.weight_version})"
                )
        full = [x for x in parts if len(x)]
        if len(full) <= 1:
            return full[0] if full else first
        known = all(len(x.positions) == len(x) for x in full)  # one part without positions: none known
        lp = max(x.prompt_len for x in full)
        width = max(x.input_ids.shape[1] - x.prompt_len for x in full)

        def cat(name: str, value: float) -> Tensor:
            padded = []
            for x in full:
                t = getattr(x, name) if name != "token_versions" else x.versions()
                left, right = lp - x.prompt_len, width - (t.shape[1] - x.prompt_len)
                padded.append(torch.nn.functional.pad(t, (left, right), value=value))
            return torch.cat(padded)

        return Rollouts(
            input_ids=cat("input_ids", pad_id), attention_mask=cat("attention_mask", 0),
            response_mask=cat("response_mask", 0), behaviour_logprobs=cat("behaviour_logprobs", 0), prompt_len=lp,
            response_lengths=torch.cat([x.response_lengths for x in full]),
            finish_reasons=[r for x in full for r in x.finish_reasons],
            completions=[c for x in full for c in x.completions], answers=[a for x in full for a in x.answers],
            group_size=first.group_size, temperature=first.temperature, weight_version=first.weight_version,
            positions=[r for x in full for r in x.positions] if known else [],
            token_versions=cat("token_versions", -1) if any(x.token_versions is not None for x in full) else None,
        )  # fmt: skip

    def versions(self) -> Tensor:
        """[N, L] long: the weight version of each response token, -1 elsewhere (`token_versions`, or every
        response token at `weight_version`)."""
        import torch

        if self.token_versions is not None:
            return self.token_versions
        return torch.where(self.response_mask > 0, self.weight_version, -1).long()

    def metrics(self) -> dict[str, float]:
        n = max(len(self.completions), 1)
        return {
            "response_length": float(self.response_lengths.float().mean()),
            "tokens": float(self.response_lengths.sum()),
            "truncated_frac": sum(r == "length" for r in self.finish_reasons) / n,
        }


@dataclass(slots=True)
class Rewards(Batch):
    """One scalar reward per rollout row: `values` [N] float. `correct` [N] bool where the task defines it.
    `components`: batch-level figures of a reward made of named terms (`reward/<label>` means, failure
    counts; `plexrl.rewards.RewardResult.metrics`), logged with the node's metrics."""

    values: Tensor
    correct: Tensor | None = None
    components: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        out = {"reward_mean": float(self.values.float().mean())}
        if self.correct is not None:
            out["accuracy"] = float(self.correct.float().mean())
        out.update(self.components)
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


@dataclass(slots=True)
class Episodes(Batch):
    """N = P*G multi-turn tool-calling episodes in flight (rows grouped by prompt as in `Rollouts`); the
    tag format is documented in `plexrl.episodes`. Plain lists, one entry per row, so that a turn can
    grow each row by a different number of tokens:

    - `prompt_ids[i]`: the prompt's tokens (bos included); `tokens[i]`: everything after the prompt so far,
      model turns and tool outputs in order; `model_mask[i][j]` 1 where the policy wrote `tokens[i][j]`,
      0 on tool output (`<out>...</out>`); `logprobs[i][j]` the behaviour log-prob (temperature applied)
      of model tokens, 0.0 on tool output.
    - `pending[i]`: the body of a tool call the model just closed, waiting for the tool node, else None.
    - `status[i]`: "running", or why the episode ended: "answer" (eos), "length" (a turn hit its
      max_new_tokens), "budget" (the episode's `token_budget` of tokens after the prompt is used up);
      `finish_episodes` marks episodes still running after the last turn "turns".
    - per row: `turns` (model turns taken), `tool_calls`, `tool_errors`, `tool_latency_s` (summed).
    - `answers[i]` ground truth; `episode_ids[i]` unique per job, iteration and row (tool create/release).
    """

    prompt_ids: list[list[int]]
    tokens: list[list[int]]
    model_mask: list[list[int]]
    logprobs: list[list[float]]
    pending: list[str | None]
    status: list[str]
    turns: list[int]
    tool_calls: list[int]
    tool_errors: list[int]
    tool_latency_s: list[float]
    answers: list[str]
    episode_ids: list[str]
    group_size: int
    temperature: float
    token_budget: int
    weight_version: int = 0
    new_tokens: int = 0  # tokens the node that made this batch generated (0 for tool nodes)

    def __len__(self) -> int:
        return len(self.status)

    def metrics(self) -> dict[str, float]:
        n = max(len(self.status), 1)
        out = {"running_frac": sum(s == "running" for s in self.status) / n}
        if self.new_tokens:
            out["tokens"] = float(self.new_tokens)
        return out


@dataclass(slots=True)
class EpisodeRollouts(Rollouts):
    """Finished episodes as a `Rollouts` (so verify, advantage and train take them unchanged): the response
    part of row i is every token after the prompt, model turns and tool outputs interleaved.

    - `response_mask` [N, L] is 1 on model-written tokens only: tool output never enters the policy loss;
      `tool_mask` [N, L] float is 1 on tool-output tokens (`<out>`, output, `</out>`).
    - `response_lengths` [N] counts model-written tokens; `completions[i]` is the final answer (the text
      after the last tool output, "" unless the episode ended with eos); `transcripts[i]` the whole episode
      with its tags; `finish_reasons[i]` "stop" for an answer, else "length".
    - per row: `episode_end` ("answer", "length", "budget", "turns"), `turns`, `tool_calls`,
      `tool_errors`, `tool_latency_s`.
    """

    tool_mask: Tensor | None = None
    transcripts: list[str] = field(default_factory=list)
    episode_end: list[str] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    tool_errors: list[int] = field(default_factory=list)
    tool_latency_s: list[float] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        n = max(len(self.turns), 1)
        calls = max(sum(self.tool_calls), 1)
        rollout = {k: v for k, v in Rollouts.metrics(self).items() if k != "tokens"}  # counted per turn node
        return {
            **rollout,
            **episode_metrics(self.turns, self.tool_calls, self.tool_errors, self.tool_latency_s),
            "answered_frac": sum(e == "answer" for e in self.episode_end) / n,
            "tool_latency_s_per_call": sum(self.tool_latency_s) / calls,
        }


def episode_metrics(
    turns: list[int], tool_calls: list[int], tool_errors: list[int], tool_latency_s: list[float]
) -> dict[str, float]:
    """Means over episodes of the per-sample tool statistics, and the tool-use rate (share of episodes
    with at least one call).

    >>> episode_metrics([2, 1], [1, 0], [0, 0], [0.5, 0.0])["tool_use_rate"]
    0.5
    """
    n = max(len(turns), 1)
    return {
        "turns": sum(turns) / n,
        "tool_calls": sum(tool_calls) / n,
        "tool_errors": sum(tool_errors) / n,
        "tool_latency_s": sum(tool_latency_s) / n,
        "tool_use_rate": sum(c > 0 for c in tool_calls) / n,
    }


@dataclass(slots=True)
class AgentEvalStats(EvalStats):
    """Held-out evaluation of tool-calling episodes: accuracy plus the means of `episode_metrics`
    (`tool_use_rate`, `turns`, `tool_calls`, `tool_errors`, `tool_latency_s`) in `tools`."""

    tools: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        return {**EvalStats.metrics(self), **self.tools}
