"""Rewards of a job from data: built-in verifiers and users' functions, combined as a weighted sum.

A reward is a list of terms (`plexrl.data.config.RewardTerm`: a built-in `name` or a user's `ref`, a
`weight`, `params`). `build_reward(terms)` checks and resolves them once; calling the `Reward` on a batch
returns a `RewardResult`: the weighted total per row, every term's scores by its label (logged as
`reward/<label>`, e.g. `verify/reward/math` under a node named verify), and the count of user-reward calls
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

Time limit, per call (a row, or a whole batch for a batched reward): the call runs on a daemon thread and the
caller waits `timeout_s`. Why a thread and not a process (`ProcessPoolExecutor`): no start-up or pickling
cost per call, the function may close over anything, and it works inside a daemonic Dask worker (which may not
start child processes). The price: a thread cannot be killed, so a reward that hangs keeps its thread (and
any CPU it burns) until it returns; it is abandoned and scored 0, and once `MAX_STUCK` abandoned threads are
still alive, further user-reward calls are not started and count as timeouts (the pool is not drained by one
bad function). A reward that must be killable (unbounded loops, native code that holds the GIL) belongs in a
process: the sandbox (`plexrl.verifiers.code_unit_tests`) is the model for that.

What this module does NOT do: render prompts or read files (plexrl/data/), or run built-ins with a timeout
(they bound their own work: math-verify's limits, the last `MAX_CHARS` of a completion for patterns).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from plexrl.data.config import RewardTerm
from plexrl.errors import ConfigError, Problem
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
from plexrl.roles import declare, resolve

log = logging.getLogger(__name__)

BATCHED_ATTR = "__plexrl_reward_batched__"
MAX_STUCK = 8  # abandoned (timed-out) user-reward threads alive at once before calls are refused
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


_stuck: list[threading.Thread] = []
_stuck_lock = threading.Lock()


def stuck_threads() -> int:
    """Abandoned user-reward threads that are still running."""
    with _stuck_lock:
        _stuck[:] = [t for t in _stuck if t.is_alive()]
        return len(_stuck)


def call_with_timeout(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], timeout_s: float
) -> tuple[Literal["ok", "error", "timeout"], Any]:
    """`("ok", value)`, `("error", exception)` or `("timeout", None)` of `fn(*args, **kwargs)` run on a daemon
    thread for at most `timeout_s` (see the module docstring: a thread that overruns is abandoned)."""
    if stuck_threads() >= MAX_STUCK:
        return "timeout", None
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # the user's function: any failure scores 0
            box["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=target, name=f"plexrl-reward-{getattr(fn, '__name__', 'fn')}", daemon=True)
    thread.start()
    if not done.wait(timeout_s):
        with _stuck_lock:
            _stuck.append(thread)
        return "timeout", None
    return ("error", box["error"]) if "error" in box else ("ok", box.get("value"))


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
    """The terms of a job's reward, resolved; call it on a batch. Pickles as its terms (user functions are
    resolved again where it is loaded)."""

    def __init__(self, terms: Sequence[RewardTerm]) -> None:
        if not terms:
            raise ValueError("a reward needs at least one term")
        self.terms = list(terms)
        self._fns: list[Any] = []
        problems = []
        for i, term in enumerate(self.terms):
            if term.name is not None:
                self._fns.append(check_params(term.name, term.params))
                continue
            assert term.ref is not None
            try:
                self._fns.append(resolve(term.ref, "reward"))
            except LookupError as exc:
                problems.append(Problem(f"data.rewards[{i}].ref", str(exc)))
        if problems:
            raise ConfigError(problems, "the reward")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return Reward, (self.terms,)

    @property
    def labels(self) -> list[str]:
        return [t.key for t in self.terms]

    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        truths: Sequence[str | None],
        extras: Sequence[dict[str, Any]] | None = None,
    ) -> RewardResult:
        """Score a batch of N rows (every sequence of length N; `extras` None: {} per row)."""
        n = len(responses)
        extra_rows = list(extras) if extras is not None else [{} for _ in range(n)]
        if not len(prompts) == len(truths) == len(extra_rows) == n:
            raise ValueError(
                f"{len(prompts)} prompts, {n} responses, {len(truths)} ground truths and "
                f"{len(extra_rows)} extras: pass one of each per row"
            )
        result = RewardResult(total=[0.0] * n, correct=[False] * n)
        for k, (term, fn) in enumerate(zip(self.terms, self._fns, strict=True)):
            if term.name is not None:
                scores = BUILTINS[term.name][1](responses, truths, fn)
                result.components[term.key] = scores
            else:
                scores = self._user(term, fn, list(prompts), list(responses), list(truths), extra_rows, result)
            for i, s in enumerate(scores):
                result.total[i] += term.weight * (s or 0.0)
                if k == 0:
                    result.correct[i] = s is not None and s >= 1.0
        return result

    def _user(
        self,
        term: RewardTerm,
        fn: Any,
        prompts: list[str],
        responses: list[str],
        truths: list[Any],
        extras: list[dict[str, Any]],
        result: RewardResult,
    ) -> Scores:
        n = len(responses)
        values: list[Any] = [None] * n
        failed = [False] * n
        if getattr(fn, BATCHED_ATTR, False):
            status, got = call_with_timeout(fn, (prompts, responses, truths, extras), term.params, term.timeout_s)
            if status == "ok" and not (isinstance(got, list | tuple) and len(got) == n):
                status, got = (
                    "error",
                    TypeError(
                        f"returned {type(got).__name__} of length "
                        f"{len(got) if hasattr(got, '__len__') else '?'}, not a list of {n}"
                    ),
                )
            if status == "ok":
                values = list(got)
            else:
                failed = [True] * n
                self._count(term, status, got, result, n)
        else:
            for i in range(n):
                args = (prompts[i], responses[i], truths[i], extras[i])
                status, got = call_with_timeout(fn, args, term.params, term.timeout_s)
                if status == "ok":
                    values[i] = got
                else:
                    failed[i] = True
                    self._count(term, status, got, result, 1)
        scores: Scores = [0.0] * n
        parts: dict[str, list[float | None]] = {}
        for i, value in enumerate(values):
            if failed[i]:
                continue
            try:
                split = _parts(value)
            except TypeError as exc:
                self._count(term, "error", exc, result, 1)
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
        if status == "timeout":
            result.timeouts += rows
            log.warning("reward %s: timed out after %.3gs on %d row(s); scored 0", term.ref, term.timeout_s, rows)
        else:
            result.errors += rows
            log.warning("reward %s: %s: %s on %d row(s); scored 0", term.ref, type(got).__name__, got, rows)


def build_reward(terms: Sequence[RewardTerm]) -> Reward:
    """The job's `Reward` from its terms; raises `ConfigError` naming a ref that does not resolve (not
    declared for the role "reward", outside the allow-list, not importable)."""
    return Reward(terms)


__all__ = [
    "BUILTINS",
    "ChoiceParams",
    "ExactParams",
    "FormatParams",
    "MathParams",
    "NumericParams",
    "RegexParams",
    "Reward",
    "RewardResult",
    "RewardTerm",
    "batched_reward",
    "build_reward",
    "call_with_timeout",
    "check_params",
    "choice_letter",
    "gsm8k_truth",
    "stuck_threads",
]
