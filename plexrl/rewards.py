"""Rewards of a job from data: built-in verifiers and users' functions, combined as a weighted sum.

A reward is a list of terms (`plexrl.data.config.RewardTerm`: a built-in `name` or a user's `ref`, a
`weight`, `params`). `build_reward(terms)` checks and resolves them once; calling the `Reward` on a batch
returns a `RewardResult`: the weighted total per row, every term's scores by its label (logged as
`reward/<label>`, e.g. `verify/reward/math` under a node named verify), and the count of user-reward calls
that raised (`reward_errors`) or ran out of time (`reward_timeouts`); those rows score 0 in that term, and
the job goes on. The FIRST term is the accuracy term: `RewardResult.correct` is whether it scored 1.

Built-ins (pure, batched, one score per row, None where the ground truth is None; see each function):
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
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from plexrl.data.config import RewardTerm
from plexrl.errors import ConfigError, Problem
from plexrl.roles import declare, resolve
from plexrl.verifiers import exact_numeric, math_answer

log = logging.getLogger(__name__)

Scores = list[float | None]
BATCHED_ATTR = "__plexrl_reward_batched__"
MAX_CHARS = 20_000  # patterns look at the last this many characters of a completion
MAX_STUCK = 8  # abandoned (timed-out) user-reward threads alive at once before calls are refused
F = TypeVar("F", bound=Callable[..., Any])


def batched_reward(fn: F) -> F:
    """Declare `fn` a batched user reward: `fn(prompts, responses, ground_truths, extras, **params)` returns
    one float or dict per row (see the module docstring). Same role as `@plexrl.roles.declare("reward")`."""
    declare("reward")(fn)
    setattr(fn, BATCHED_ATTR, True)
    return fn


# ---- built-ins --------------------------------------------------------------------------------------------


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MathParams(_Params):
    timeout_s: int = Field(5, ge=1, le=60, description="math-verify's limit per parse and comparison (main thread).")


class NumericParams(_Params):
    rel_tol: float = Field(1e-6, ge=0, le=1, description="Relative tolerance of the comparison.")
    abs_tol: float = Field(1e-9, ge=0, description="Absolute tolerance of the comparison.")


class ExactParams(_Params):
    ignore_case: bool = Field(False, description="Compare case-insensitively.")


class RegexParams(_Params):
    pattern: str = Field(
        min_length=1,
        description="A Python regex. With a capture group: the last match's group 1 (stripped) must equal the "
        "ground truth; without: any match scores 1.",
    )
    ignore_case: bool = Field(False, description="Match case-insensitively.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regex: {exc}") from None
        return value


class ChoiceParams(_Params):
    letters: str = Field("ABCDE", pattern=r"^[A-Z]{2,26}$", description="The choice letters, e.g. ABCD.")


class FormatParams(_Params):
    require: Literal["answer_line", "boxed", "regex"] = Field(
        "answer_line",
        description="answer_line: a line `Answer: <something>`; boxed: a non-empty \\boxed{...}; regex: `pattern`.",
    )
    pattern: str | None = Field(None, description="The regex a completion must match (require: regex).")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        return None if value is None else RegexParams._compiles(value)


def gsm8k_truth(truth: str) -> str:
    """The final answer of a GSM8K-style solution (`... #### 1,234` -> `1234`); other text as it is.

    >>> gsm8k_truth("She has 3 + 4 = 7 apples.\\n#### 7"), gsm8k_truth("\\\\frac{1}{2}")
    ('7', '\\\\frac{1}{2}')
    """
    return truth.rsplit("####", 1)[1].strip().replace(",", "") if "####" in truth else truth


def math_reward(responses: Sequence[str], truths: Sequence[str | None], p: MathParams) -> Scores:
    """math-verify equality of the final answer (\\boxed{}, `#### N`, LaTeX, fractions) with the ground truth.

    >>> math_reward(["so \\\\boxed{\\\\frac{1}{2}}", "#### 72", "12"], ["0.5", "x\\n#### 72", "13"], MathParams())
    [1.0, 1.0, 0.0]
    """
    return math_answer(responses, [None if t is None else gsm8k_truth(t) for t in truths], timeout_s=p.timeout_s)


def numeric_reward(responses: Sequence[str], truths: Sequence[str | None], p: NumericParams) -> Scores:
    """The final number (boxed, `####`, `answer is`, else the last) within tolerance of the ground truth.

    >>> numeric_reward(["Answer: 1,000", "about 3", "x"], ["1000", "#### 4", "5"], NumericParams())
    [1.0, 0.0, 0.0]
    """
    gold = [None if t is None else gsm8k_truth(t) for t in truths]
    return exact_numeric(responses, gold, rel_tol=p.rel_tol, abs_tol=p.abs_tol)


def exact_reward(responses: Sequence[str], truths: Sequence[str | None], p: ExactParams) -> Scores:
    """1.0 where the completion, stripped, equals the ground truth, stripped.

    >>> exact_reward([" Paris ", "paris", "Paris!"], ["Paris", "Paris", "Paris"], ExactParams())
    [1.0, 0.0, 0.0]
    >>> exact_reward(["paris"], ["Paris"], ExactParams(ignore_case=True))
    [1.0]
    """

    def norm(text: str) -> str:
        return text.strip().casefold() if p.ignore_case else text.strip()

    return [
        None if t is None else float(isinstance(r, str) and norm(r) == norm(t)) for r, t in _rows(responses, truths)
    ]


def regex_reward(responses: Sequence[str], truths: Sequence[str | None], p: RegexParams) -> Scores:
    """With a capture group: 1.0 where the last match's group 1 equals the ground truth; without: any match.

    >>> p = RegexParams(pattern=r"Answer:\\s*(\\S+)")
    >>> regex_reward(["Answer: 4", "Answer: 3\\nAnswer: 5", "4"], ["4", "5", "4"], p)
    [1.0, 1.0, 0.0]
    >>> regex_reward(["<think>x</think>4", "4"], ["", ""], RegexParams(pattern="</think>"))
    [1.0, 0.0]
    """
    rx = re.compile(p.pattern, re.IGNORECASE if p.ignore_case else 0)
    out: Scores = []
    for r, t in _rows(responses, truths):
        if t is None:
            out.append(None)
            continue
        text = r[-MAX_CHARS:] if isinstance(r, str) else ""
        if rx.groups:
            matches = list(rx.finditer(text))
            got = matches[-1].group(1) if matches else None
            out.append(float(got is not None and got.strip() == t.strip()))
        else:
            out.append(float(rx.search(text) is not None))
    return out


def choice_letter(text: str, letters: str = "ABCDE") -> str | None:
    """The letter a completion chooses: `\\boxed{C}`, else `answer is (C)` / `Answer: C`, else a reply that is
    just the letter (`C`, `(C)`, `C.`), else the last `(C)`. None when there is none.

    >>> [choice_letter(t) for t in ["\\\\boxed{B}", "So the answer is (d).", " C. ", "I pick (A) over (E)", "maybe"]]
    ['B', 'D', 'C', 'E', None]
    """
    if not isinstance(text, str):
        return None
    text, cls = text[-MAX_CHARS:], f"[{letters}{letters.lower()}]"
    for pattern in (
        rf"\\boxed\s*\{{\s*\(?({cls})\)?\s*\}}",
        rf"(?i:answer)\s*(?:is|:)?\s*:?\s*\(?({cls})\)?(?![A-Za-z])",
        rf"^\s*\(?({cls})\)?[.:)]?\s*$",
        rf"\(([{letters}])\)",
    ):
        found = re.findall(pattern, text)
        if found:
            return str(found[-1]).upper()
    return None


def choice_reward(responses: Sequence[str], truths: Sequence[str | None], p: ChoiceParams) -> Scores:
    """1.0 where the chosen letter (`choice_letter`) is the ground truth's (`C`, `(C)`, `C) some text`).

    >>> choice_reward(["The answer is (B)", "A", "\\\\boxed{D}"], ["B", "(C)", "D) 42"], ChoiceParams())
    [1.0, 0.0, 1.0]
    """
    out: Scores = []
    for r, t in _rows(responses, truths):
        if t is None:
            out.append(None)
            continue
        m = re.match(rf"^\s*\(?([{p.letters}])(?![A-Za-z])", t.strip().upper())
        if m is None:
            log.warning("choice reward: ground truth %r is not one of the letters %s; scored 0.0", t, p.letters)
        out.append(float(m is not None and choice_letter(r, p.letters) == m.group(1)))
    return out


_ANSWER_LINE = re.compile(r"^[ \t*#]*answer[ \t*]*:[ \t*]*\S", re.IGNORECASE | re.MULTILINE)
_BOXED = re.compile(r"\\boxed\s*\{\s*[^\s}]")


def format_reward(responses: Sequence[str], truths: Sequence[str | None], p: FormatParams) -> Scores:
    """1.0 where the completion has the required shape (the ground truth is not looked at, only its None).

    >>> format_reward(["work\\nAnswer: 7", "answer 7", "\\\\boxed{7}"], ["7"] * 3, FormatParams())
    [1.0, 0.0, 0.0]
    >>> format_reward(["\\\\boxed{7}", "\\\\boxed{}"], ["7", "7"], FormatParams(require="boxed"))
    [1.0, 0.0]
    """
    rx = _ANSWER_LINE if p.require == "answer_line" else _BOXED if p.require == "boxed" else re.compile(p.pattern or "")
    return [
        None if t is None else float(isinstance(r, str) and rx.search(r[-MAX_CHARS:]) is not None)
        for r, t in _rows(responses, truths)
    ]


def _rows(responses: Sequence[str], truths: Sequence[str | None]) -> list[tuple[str, str | None]]:
    if len(responses) != len(truths):
        raise ValueError(f"{len(responses)} responses but {len(truths)} ground truths: pass one per response")
    return list(zip(responses, truths, strict=True))


BUILTINS: dict[str, tuple[type[_Params], Callable[..., Scores]]] = {
    "math": (MathParams, math_reward),
    "numeric": (NumericParams, numeric_reward),
    "exact": (ExactParams, exact_reward),
    "regex": (RegexParams, regex_reward),
    "choice": (ChoiceParams, choice_reward),
    "format": (FormatParams, format_reward),
}


def check_params(name: str, params: dict[str, Any]) -> _Params:
    """The built-in `name`'s parameters, validated; ValueError naming each bad parameter and the fix."""
    model = BUILTINS[name][0]
    try:
        parsed = model.model_validate(params)
    except ValidationError as exc:
        bad = "; ".join(f"params.{'.'.join(map(str, e['loc'])) or '?'}: {e['msg']}" for e in exc.errors())
        allowed = ", ".join(model.model_fields)
        raise ValueError(f"reward {name!r}: {bad} (its parameters: {allowed})") from None
    if isinstance(parsed, FormatParams) and (parsed.require == "regex") != (parsed.pattern is not None):
        raise ValueError(f"reward {name!r}: give params.pattern exactly when params.require is 'regex'")
    return parsed


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
