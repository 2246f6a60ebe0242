"""Rewards of a job from data: built-in verifiers and users' functions, combined as a weighted sum.

A reward is a list of terms (`plexrl.data.config.RewardTerm`: a built-in `name` or a user's `ref`, a
`weight`, `params`). `build_reward(terms)` checks and resolves them once; calling the `Reward` on a batch
returns a `RewardResult`: the weighted total per row, every term's scores by its label (logged as
`reward/<label>`, e.g. `verify/reward/math` under a node named verify), and the count of calls
that raised (`reward_errors`) or ran out of time (`reward_timeouts`); those rows score 0 in that term, and
the job goes on. The FIRST term is the accuracy term: `RewardResult.correct` is whether it scored 1.

Built-ins (pure, batched, one score per row, None where the ground truth is None; plexrl/reward_builtins.py):
`math` (math-verify via `plexrl.verifiers.math_answer`; a GSM8K ground truth `... #### 72` counts as 72),
`numeric` (`plexrl.verifiers.exact_numeric`), `exact`, `regex`, `choice` (a letter A-E), `format` (the
completion has an `Answer: ...` line, a `\\boxed{}`, or matches a pattern).

User rewards, named by dotted path and resolved ONLY through `plexrl.roles.resolve(ref, "reward")` (the
allow-list and the declared role apply):

    @plexrl.roles.declare("reward")              # per row
    def my_reward(prompt: str, response: str, ground_truth: str, extra: dict, **params) -> float | dict[str, float]

    @plexrl.rewards.batched_reward               # batched: lists in, one value per row out
    def my_rewards(prompts, responses, ground_truths, extras, **params) -> list[float | dict[str, float]]

`prompt` is the text the model was given (chat template applied), `extra` the row's extra fields (verl:
`extra_info` plus `data_source`, `style`), `params` the term's `params`. A dict's values are components,
logged as `reward/<label>/<key>`; the term scores their sum. A value that is not a finite number is an error.

Time limits. Every term, built-in or user, runs in a worker process of its own (`plexrl.reward_workers`),
one call per row (a batched user reward: one call per batch), each call limited to the term's `timeout_s`.
A call that passes it is ended by killing its worker, scores 0 in that term and is counted in
`reward_timeouts`; the other rows go to a fresh worker, and the other terms, in their own workers, keep
their scores. A term whose calls time out `MAX_TIMEOUTS_IN_A_ROW` times in a row (across batches) raises
`RewardHung`, naming it: the job fails loudly rather than train on zeros. A call that raises, returns a value
that is not a finite number, or crashes its worker scores 0 and is counted in `reward_errors`.

Built-ins also bound their own work: patterns given in a config (`regex`, `format: regex`) run on RE2, whose
matching time is linear in the text (no catastrophic backtracking; backreferences and lookarounds are
refused when the config is validated), on the last `MAX_CHARS` of a completion; math-verify runs with its
own limits (on the worker's main thread, where its signal-based timeout works).

What this module does NOT do: render prompts or read files (plexrl/data/), or sandbox a user reward (it is
trusted code named through the allow-list; the worker is an ordinary process: see docs/security.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from plexrl.data.config import RewardTerm
from plexrl.errors import ConfigError, Problem
from plexrl.logs import REPEATS
from plexrl.reward_builtins import (
    BUILTINS,
    ChoiceParams,
    ExactParams,
    FormatParams,
    MathParams,
    NumericParams,
    RegexParams,
    Scores,
    check_params,
    choice_letter,
    gsm8k_truth,
)
from plexrl.reward_workers import POOL, Outcome, TermWorker, score_term
from plexrl.roles import current_allowed, declare, resolve

log = logging.getLogger(__name__)
log.addFilter(REPEATS)  # a warning per failed call: a few lines a minute per kind, then a count (plexrl/logs.py)

BATCHED_ATTR = "__plexrl_reward_batched__"
MAX_TIMEOUTS_IN_A_ROW = 5  # a term whose calls time out this many times in a row fails its job
F = TypeVar("F", bound=Callable[..., Any])


def batched_reward(fn: F) -> F:
    """Declare `fn` a batched user reward: `fn(prompts, responses, ground_truths, extras, **params)` returns
    one float or dict per row (see the module docstring). Same role as `@plexrl.roles.declare("reward")`."""
    declare("reward")(fn)
    setattr(fn, BATCHED_ATTR, True)
    return fn


# ---- the combined reward --------------------------------------------------------------------------------


@dataclass(slots=True)
class RewardResult:
    """Per row: `total` (the weighted sum), `correct` (the first term scored 1); per term label (and
    `label/key` for a user reward's dict): the scores, None where not scored; call counts that failed."""

    total: list[float]
    correct: list[bool]
    components: dict[str, list[float | None]] = field(default_factory=dict)
    errors: int = 0
    timeouts: int = 0

    def metrics(self) -> dict[str, float]:
        """`reward/<label>`: the mean over the rows it scored; `reward_errors`, `reward_timeouts`."""
        out = {}
        for key, scores in self.components.items():
            got = [s for s in scores if s is not None]
            if got:
                out[f"reward/{key}"] = sum(got) / len(got)
        out["reward_errors"], out["reward_timeouts"] = float(self.errors), float(self.timeouts)
        return out


class RewardHung(RuntimeError):
    """A reward term kept timing out (`MAX_TIMEOUTS_IN_A_ROW` calls in a row): the job stops, naming it."""


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"a reward must be a finite number, not {value!r}")
    return float(value)


def _parts(value: Any) -> dict[str, float]:
    """A user reward's value as components ({} key "" for a plain number); TypeError if malformed."""
    if isinstance(value, dict):
        if not value or not all(isinstance(k, str) and k for k in value):
            raise TypeError(f"a reward dict needs non-empty string keys, got {list(value)[:5]!r}")
        return {k: _number(v) for k, v in value.items()}
    return {"": _number(value)}


class Reward:
    """The terms of a job's reward, resolved; call it on a batch. Pickles as its terms and the allow-list it
    was resolved under (user functions are resolved again where it is loaded, and in each term's worker)."""

    def __init__(self, terms: Sequence[RewardTerm], allowed: tuple[str, ...] | None = None) -> None:
        if not terms:
            raise ValueError("a reward needs at least one term")
        self.terms = list(terms)
        self.allowed = current_allowed() if allowed is None else tuple(allowed)
        self._batched: list[bool] = []
        self._in_a_row = [0] * len(self.terms)  # each term's timeouts in a row
        problems = []
        for i, term in enumerate(self.terms):
            if term.name is not None:
                check_params(term.name, term.params)
                self._batched.append(False)
                continue
            assert term.ref is not None
            try:
                fn = resolve(term.ref, "reward")
            except LookupError as exc:
                problems.append(Problem(f"data.rewards[{i}].ref", str(exc)))
                continue
            self._batched.append(bool(getattr(fn, BATCHED_ATTR, False)))
        if problems:
            raise ConfigError(problems, "the reward")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return Reward, (self.terms, self.allowed)

    @property
    def labels(self) -> list[str]:
        return [t.key for t in self.terms]

    @property
    def batched(self) -> list[bool]:
        """Per term: whether it is a batched user reward (one call per batch)."""
        return list(self._batched)

    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        truths: Sequence[str | None],
        extras: Sequence[dict[str, Any]] | None = None,
    ) -> RewardResult:
        """Score a batch of N rows (every sequence of length N; `extras` None: {} per row). Raises
        `RewardHung` when a term has now timed out `MAX_TIMEOUTS_IN_A_ROW` calls in a row."""
        n = len(responses)
        extra_rows = list(extras) if extras is not None else [{} for _ in range(n)]
        if not len(prompts) == len(truths) == len(extra_rows) == n:
            raise ValueError(
                f"{len(prompts)} prompts, {n} responses, {len(truths)} ground truths and "
                f"{len(extra_rows)} extras: pass one of each per row"
            )
        rows = [(p, r, t, e) for p, r, t, e in zip(prompts, responses, truths, extra_rows, strict=True)]
        result = RewardResult(total=[0.0] * n, correct=[False] * n)
        workers: list[TermWorker | None] = [POOL.acquire(t, self.allowed) if n else None for t in self.terms]
        try:  # the terms' workers start at once, then each term's calls run in its own
            for k, term in enumerate(self.terms):
                worker, workers[k] = workers[k], None
                outcomes = score_term(term, self.allowed, rows, self._batched[k], worker)
                self._check_hung(k, outcomes)
                scores = self._scores(term, outcomes, n, result, self._batched[k])
                for i, s in enumerate(scores):
                    result.total[i] += term.weight * (s or 0.0)
                    if k == 0:
                        result.correct[i] = s is not None and s >= 1.0
        finally:
            for unused in workers:
                if unused is not None:
                    POOL.release(unused)
        return result

    def _check_hung(self, k: int, outcomes: list[Outcome]) -> None:
        term = self.terms[k]
        for status, _ in outcomes:
            self._in_a_row[k] = self._in_a_row[k] + 1 if status == "timeout" else 0
            if self._in_a_row[k] >= MAX_TIMEOUTS_IN_A_ROW:
                self._in_a_row[k] = 0
                raise RewardHung(
                    f"reward term {term.key!r} ({term.name or term.ref}) timed out on {MAX_TIMEOUTS_IN_A_ROW} calls "
                    f"in a row (timeout_s {term.timeout_s:g} per call): the job stops rather than train on "
                    "zeros; fix the function, or raise the term's timeout_s"
                )

    def _scores(self, term: RewardTerm, outcomes: list[Outcome], n: int, result: RewardResult, batched: bool) -> Scores:
        """The term's score per row from its calls' outcomes (a batched reward: one outcome for all rows)."""
        values: list[Any] = [None] * n
        failed = [False] * n
        if batched and outcomes:
            status, got = outcomes[0]
            if status == "ok" and not (isinstance(got, list) and len(got) == n):
                shape = f"of length {len(got)}" if isinstance(got, list) else ""
                status, got = "error", f"TypeError: returned {type(got).__name__} {shape}, not a list of {n}"
            if status == "ok":
                values = list(got)
            else:
                failed = [True] * n
                self._count(term, status, got, result, n)
        else:
            for i, (status, got) in enumerate(outcomes):
                if status == "ok":
                    values[i] = got
                else:
                    failed[i] = True
                    self._count(term, status, got, result, 1)
        scores: Scores = [0.0] * n
        if term.name is not None:  # a built-in: a number, or None where it does not apply
            for i, value in enumerate(values):
                if not failed[i]:
                    scores[i] = None if value is None else float(value)
            result.components[term.key] = scores
            return scores
        parts: dict[str, list[float | None]] = {}
        for i, value in enumerate(values):
            if failed[i]:
                continue
            try:
                split = _parts(value)
            except TypeError as exc:
                self._count(term, "error", f"TypeError: {exc}", result, 1)
                continue
            scores[i] = sum(split.values())
            for key, v in split.items():
                if key:
                    parts.setdefault(key, [None] * n)[i] = v
        result.components[term.key] = scores
        for key, column in parts.items():
            result.components[f"{term.key}/{key}"] = column
        return scores

    @staticmethod
    def _count(term: RewardTerm, status: str, got: Any, result: RewardResult, rows: int) -> None:
        name = term.name or term.ref
        if status == "timeout":
            result.timeouts += rows
            log.warning("reward %s: timed out after %.3gs on %d row(s); scored 0", name, term.timeout_s, rows)
        else:
            result.errors += rows
            log.warning("reward %s: %s on %d row(s); scored 0", name, got, rows)


def build_reward(terms: Sequence[RewardTerm]) -> Reward:
    """The job's `Reward` from its terms; raises `ConfigError` naming a ref that does not resolve (not
    declared for the role "reward", outside the allow-list, not importable)."""
    return Reward(terms)


__all__ = [
    "BUILTINS",
    "MAX_TIMEOUTS_IN_A_ROW",
    "ChoiceParams",
    "ExactParams",
    "FormatParams",
    "MathParams",
    "NumericParams",
    "RegexParams",
    "Reward",
    "RewardHung",
    "RewardResult",
    "RewardTerm",
    "batched_reward",
    "build_reward",
    "check_params",
    "choice_letter",
    "gsm8k_truth",
]
