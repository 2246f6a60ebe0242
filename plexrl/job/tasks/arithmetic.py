"""Multi-digit addition: `"123+456="` -> `"579"`, checked exactly.

Problems are generated from a seed; the train and held-out splits are disjoint. The verifier is a pure,
batched function with no trainer state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from plexrl.job.config import TaskConfig
from plexrl.job.tasks._columns import columnar_reduce

ALPHABET = "0123456789+="


@dataclass(frozen=True, slots=True)
class Problem:
    prompt: str
    answer: str


@dataclass(slots=True)
class ArithmeticTask:
    """Train and held-out splits of `digits`-digit addition problems."""

    digits: int
    train: list[Problem]
    held_out: list[Problem]

    alphabet: ClassVar[str] = ALPHABET  # characters of the tokenizer
    special_tokens: ClassVar[tuple[str, ...]] = ()  # extra special tokens (tool tags) of the tokenizer
    tool: ClassVar[str | None] = None  # no tool calls
    tool_demo_frac: ClassVar[float] = 0.0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return columnar_reduce(self)  # fast to ship to the workers: plexrl/job/tasks/_columns.py

    @property
    def max_answer_chars(self) -> int:
        return self.digits + 1

    def verify(self, completions: list[str], answers: list[str]) -> list[float | None]:
        return verify_answers(completions, answers)

    def demonstration(self, problem: Problem, use_tool: bool) -> list[tuple[str, bool]]:
        """The warm start's target after the prompt as (text, trained) segments: the answer."""
        return [(problem.answer, True)]


def make_task(cfg: TaskConfig) -> ArithmeticTask:
    """Generate the splits; the same config always gives the same problems."""
    rng = random.Random(cfg.seed)
    lo, hi = 10 ** (cfg.digits - 1) if cfg.digits > 1 else 0, 10**cfg.digits - 1
    space = (hi - lo + 1) ** 2
    want = cfg.train_size + cfg.eval_size
    if want > space:
        raise ValueError(f"task.train_size + task.eval_size = {want} exceeds the {space} distinct problems")
    seen: set[tuple[int, int]] = set()
    pairs: list[tuple[int, int]] = []
    while len(pairs) < want:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if (a, b) not in seen:
            seen.add((a, b))
            pairs.append((a, b))
    probs = [Problem(f"{a}+{b}=", str(a + b)) for a, b in pairs]
    return ArithmeticTask(cfg.digits, probs[cfg.eval_size :], probs[: cfg.eval_size])


def verify_answers(completions: list[str], answers: list[str]) -> list[float | None]:
    """1.0 where the completion is exactly the answer (surrounding whitespace ignored), else 0.0.

    Malformed output (letters, empty, extra tokens) scores 0 and never raises. `None` marks a row with no
    reference answer (not applicable).

    >>> verify_answers(["579", " 579 ", "57", "5a9", "", "579=1"], ["579"] * 6)
    [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    >>> verify_answers(["1"], [""])
    [None]
    """
    out: list[float | None] = []
    for text, answer in zip(completions, answers, strict=True):
        if not answer:
            out.append(None)
            continue
        out.append(1.0 if isinstance(text, str) and text.strip() == answer else 0.0)
    return out
