"""Copy a digit sequence whose length is heavy-tailed: `"4071="` -> `"4071"`, checked exactly.

The task of the long-tailed-rollout job: most answers need a few tokens, a few need tens to a hundred, so one
slow row holds up its whole rollout batch (the idle source "long-tailed generations" of the PlexRL paper).
A sequence's length is a discrete Pareto draw, `L = min(max_length, floor(U ** (-1 / length_alpha)))` with U
uniform in (0, 1]: P(L >= k) = k ** -length_alpha. With the default alpha 1.2 and max_length 96, the mean
length is ~3.6 and about 0.4% of sequences are clipped at 96; a rollout batch of 64 prompts holds a sequence
of 30 or more digits in about half the batches (1 - (1 - 30 ** -1.2) ** 64).

Splits: train and held-out are drawn from the same seeded stream and are NOT disjoint for short lengths (there
are only 10 sequences of length 1); what is checked is copying, not recall. The verifier is the arithmetic
task's exact match, a pure batched function.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, ClassVar

from plexrl.job.config import TaskConfig
from plexrl.job.tasks._columns import columnar_reduce
from plexrl.job.tasks.arithmetic import Problem, verify_answers

COPY_ALPHABET = "0123456789="


def draw_length(rng: random.Random, alpha: float, max_length: int) -> int:
    """One heavy-tailed length in [1, max_length]: P(L >= k) = k ** -alpha for k <= max_length.

    >>> rng = random.Random(0)
    >>> lengths = [draw_length(rng, 1.2, 96) for _ in range(10000)]
    >>> min(lengths), max(lengths), sum(n >= 10 for n in lengths) / len(lengths) < 0.1
    (1, 96, True)
    """
    u = 1.0 - rng.random()  # (0, 1]
    return min(max_length, math.floor(u ** (-1.0 / alpha)))


@dataclass(slots=True)
class CopyTask:
    """Train and held-out splits of digit sequences to copy; lengths heavy-tailed up to `max_length`."""

    max_length: int
    train: list[Problem]
    held_out: list[Problem]

    alphabet: ClassVar[str] = COPY_ALPHABET
    special_tokens: ClassVar[tuple[str, ...]] = ()
    tool: ClassVar[str | None] = None
    tool_demo_frac: ClassVar[float] = 0.0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return columnar_reduce(self)  # fast to ship to the workers: plexrl/job/tasks/_columns.py

    @property
    def max_answer_chars(self) -> int:
        return self.max_length

    def verify(self, completions: list[str], answers: list[str]) -> list[float | None]:
        """1.0 where the completion is exactly the sequence (surrounding whitespace ignored), else 0.0.

        >>> task = make_copy_task(TaskConfig(name="copy", train_size=16, eval_size=8, max_length=12))
        >>> p = task.held_out[0]
        >>> task.verify([p.answer, p.answer + "0", ""], [p.answer, p.answer, ""])
        [1.0, 0.0, None]
        """
        return verify_answers(completions, answers)

    def demonstration(self, problem: Problem, use_tool: bool) -> list[tuple[str, bool]]:
        """The warm start's target after the prompt: the sequence itself."""
        return [(problem.answer, True)]


def make_copy_task(cfg: TaskConfig) -> CopyTask:
    """Generate the splits; the same config always gives the same problems.

    >>> task = make_copy_task(TaskConfig(name="copy", train_size=64, eval_size=8, max_length=40, seed=1))
    >>> p = task.train[0]
    >>> p.prompt == p.answer + "=" and 1 <= len(p.answer) <= 40
    True
    """
    rng = random.Random(cfg.seed)
    problems = []
    for _ in range(cfg.train_size + cfg.eval_size):
        n = draw_length(rng, cfg.length_alpha, cfg.max_length)
        seq = "".join(rng.choice("0123456789") for _ in range(n))
        problems.append(Problem(f"{seq}=", seq))
    return CopyTask(cfg.max_length, problems[cfg.eval_size :], problems[: cfg.eval_size])
