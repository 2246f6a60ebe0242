"""The built-in rewards of a job from data (`plexrl.rewards` combines them with users' functions): pure,
batched, one score per row, None where the ground truth is None, each with its parameter model.

`math` (math-verify via `plexrl.verifiers.math_answer`; a GSM8K ground truth `... #### 72` counts as 72),
`numeric` (`plexrl.verifiers.exact_numeric`), `exact`, `regex`, `choice` (a letter A-E), `format` (the
completion has an `Answer: ...` line, a `\\boxed{}`, or matches a pattern). `check_params(name, params)`
validates a term's parameters (no user code runs).

They bound their own work: a pattern from a config runs on RE2 (`compile_pattern`: matching time linear in
the text, whatever the pattern; Python's `re` can backtrack for ever on `(.|.)*X` and holds the GIL while it
does), on the last `MAX_CHARS` of a completion; math-verify has its own limits. `plexrl.rewards` runs them
in worker processes with a time limit per call all the same.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from plexrl.verifiers import exact_numeric, math_answer

log = logging.getLogger(__name__)

Scores = list[float | None]
MAX_CHARS = 20_000  # patterns look at the last this many characters of a completion


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MathParams(_Params):
    timeout_s: int = Field(5, ge=1, le=60, description="math-verify's limit per parse and comparison (main thread).")


class NumericParams(_Params):
    rel_tol: float = Field(1e-6, ge=0, le=1, description="Relative tolerance of the comparison.")
    abs_tol: float = Field(1e-9, ge=0, description="Absolute tolerance of the comparison.")


class ExactParams(_Params):
    ignore_case: bool = Field(False, description="Compare case-insensitively.")


def compile_pattern(pattern: str, ignore_case: bool = False) -> Any:
    """`pattern` compiled by RE2 (linear-time matching); ValueError naming what RE2 refuses (an invalid
    pattern, a backreference, a lookaround).

    >>> compile_pattern(r"Answer:\\s*(\\d+)").search("x Answer: 42").group(1)
    '42'
    """
    import re2

    options = re2.Options()
    options.log_errors = False
    options.case_sensitive = not ignore_case
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        why = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(
            f"not a valid regex for RE2 ({why}); patterns run on RE2, which has no backreferences or "
            "lookarounds (they can take exponential time): rewrite the pattern without them"
        ) from None


class RegexParams(_Params):
    pattern: str = Field(
        min_length=1,
        max_length=2000,
        description="A regex in RE2 syntax (Python's, less backreferences and lookarounds). With a capture group: "
        "the last match's group 1 (stripped) must equal the ground truth; without: any match scores 1.",
    )
    ignore_case: bool = Field(False, description="Match case-insensitively.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        compile_pattern(value)
        return value


class ChoiceParams(_Params):
    letters: str = Field("ABCDE", pattern=r"^[A-Z]{2,26}$", description="The choice letters, e.g. ABCD.")


class FormatParams(_Params):
    require: Literal["answer_line", "boxed", "regex"] = Field(
        "answer_line",
        description="answer_line: a line `Answer: <something>`; boxed: a non-empty \\boxed{...}; regex: `pattern`.",
    )
    pattern: str | None = Field(
        None, max_length=2000, description="The regex (RE2 syntax) a completion must match (require: regex)."
    )

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
    rx = compile_pattern(p.pattern, p.ignore_case)
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
    rx = (
        _ANSWER_LINE
        if p.require == "answer_line"
        else _BOXED
        if p.require == "boxed"
        else compile_pattern(p.pattern or "")
    )
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


__all__ = [
    "BUILTINS",
    "MAX_CHARS",
    "ChoiceParams",
    "ExactParams",
    "FormatParams",
    "MathParams",
    "NumericParams",
    "RegexParams",
    "Scores",
    "check_params",
    "choice_letter",
    "choice_reward",
    "compile_pattern",
    "exact_reward",
    "format_reward",
    "gsm8k_truth",
    "math_reward",
    "numeric_reward",
    "regex_reward",
]
