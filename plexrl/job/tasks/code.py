"""Program synthesis from input/output examples, rewarded by running the program in the sandbox.

A problem shows a function at three inputs and asks for it as one Python expression in `x`:

    f(0)=4;f(1)=7;f(2)=10;f=      ->   3*x+4

The hidden function is `a*x+b` with `digits`-digit a and b (the splits are disjoint sets of (a, b)). The
completion is run by `plexrl.verifiers.code_unit_tests` as `def f(x): return <completion>` on inputs the
prompt does not show (`HIDDEN_INPUTS`); the expected values stay in the trainer, so a completion scores 1.0
only by computing them. Any expression that does (`4+x*3`, `(x+1)*3+1`) is right.

Not done here: functions beyond the linear family, or examples at other inputs than 0, 1, 2.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from plexrl.job.config import TaskConfig
from plexrl.job.tasks._columns import columnar_reduce
from plexrl.verifiers import code_unit_tests, unit_tests

CODE_ALPHABET = "0123456789x*+-()=;f"
SHOWN_INPUTS = (0, 1, 2)
HIDDEN_INPUTS = (3, 5, 10, -4)


@dataclass(frozen=True, slots=True)
class CodeProblem:
    """prompt: the examples; answer: the `UnitTests` JSON on the hidden inputs; solution: one right answer
    (the warm start's target)."""

    prompt: str
    answer: str
    solution: str


@dataclass(slots=True)
class CodeTask:
    """Train and held-out splits of linear functions to write as Python expressions."""

    digits: int
    train: list[CodeProblem]
    held_out: list[CodeProblem]

    alphabet: ClassVar[str] = CODE_ALPHABET
    special_tokens: ClassVar[tuple[str, ...]] = ()
    tool: ClassVar[str | None] = None
    tool_demo_frac: ClassVar[float] = 0.0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return columnar_reduce(self)  # fast to ship to the workers: plexrl/job/tasks/_columns.py

    @property
    def max_answer_chars(self) -> int:
        return 2 * self.digits + 3  # a*x+b

    def verify(self, completions: list[str], answers: list[str]) -> list[float | None]:
        """1.0 where `def f(x): return <completion>` gives the expected values on the hidden inputs (run in
        the sandbox, compared outside), 0.0 otherwise, None where the answer is empty.

        >>> task = make_code_task(TaskConfig(name="code", digits=1, train_size=16, eval_size=8))
        >>> p = task.held_out[0]
        >>> task.verify([p.solution, "x", ""], [p.answer, p.answer, ""])
        [1.0, 0.0, None]
        """
        programs = [f"def f(x):\n    return {c.strip()}\n" if isinstance(c, str) else "" for c in completions]
        return code_unit_tests(programs, [a or None for a in answers])

    def demonstration(self, problem: CodeProblem, use_tool: bool) -> list[tuple[str, bool]]:
        """The warm start's target after the prompt: the canonical expression."""
        return [(problem.solution, True)]


def make_code_problem(a: int, b: int) -> CodeProblem:
    """The problem of f(x) = a*x + b.

    >>> make_code_problem(3, 4).prompt, make_code_problem(3, 4).solution
    ('f(0)=4;f(1)=7;f(2)=10;f=', '3*x+4')
    """
    prompt = "".join(f"f({x})={a * x + b};" for x in SHOWN_INPUTS) + "f="
    answer = unit_tests("f", [((x,), a * x + b) for x in HIDDEN_INPUTS])
    return CodeProblem(prompt, answer, f"{a}*x+{b}")


def make_code_task(cfg: TaskConfig) -> CodeTask:
    """Generate the splits; the same config always gives the same problems. Raises ValueError when the splits
    ask for more distinct (a, b) than exist, or for `digits_b` (not used here)."""
    if cfg.digits_b is not None:
        raise ValueError("digits_b applies to task tool_arithmetic only; remove it (code uses `digits`)")
    lo, hi = (10 ** (cfg.digits - 1) if cfg.digits > 1 else 0), 10**cfg.digits - 1
    want = cfg.train_size + cfg.eval_size
    if want > (hi - lo + 1) ** 2:
        raise ValueError(f"task.train_size + task.eval_size = {want} exceeds the {(hi - lo + 1) ** 2} functions")
    rng = random.Random(cfg.seed)
    seen: set[tuple[int, int]] = set()
    pairs: list[tuple[int, int]] = []
    while len(pairs) < want:
        pair = (rng.randint(lo, hi), rng.randint(lo, hi))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    probs = [make_code_problem(a, b) for a, b in pairs]
    return CodeTask(cfg.digits, probs[cfg.eval_size :], probs[: cfg.eval_size])
