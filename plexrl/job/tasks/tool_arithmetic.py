"""Multiplication too large to do in the head, solved with a calculator tool: `"347*58="` -> `"20126"`.

A 2-layer model cannot multiply a 3-digit by a 2-digit number by itself, but it can copy: write the
expression into a tool call, read the tool's output, and copy it into the answer. An episode in the tag
format of `plexrl.episodes`:

    <bos>347*58=<call>347*58</call><out>20126</out>20126<eos>
            model:  ^^^^^^^^^^^^^^^^^^                ^^^^^^^^^^^   (trained; the tool output is not)

The answer may also be written directly (`347*58=20126<eos>`), which the model mostly gets wrong. The
supervised warm start shows both (a `tool_demo_frac` share of calls), so the tool-use rate starts low and
RL can raise it. Splits are generated from a seed and disjoint; the verifier is the exact-match verifier of
`arithmetic`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from plexrl.episodes import CALL, CALL_END, OUT, OUT_END, TAGS
from plexrl.job.config import TaskConfig
from plexrl.job.tasks._columns import columnar_reduce
from plexrl.job.tasks.arithmetic import Problem, verify_answers

TOOL_ALPHABET = "0123456789*+=?"


@dataclass(slots=True)
class ToolArithmeticTask:
    """Train and held-out splits of `digits` x `digits_b` digit multiplications, with calculator demos."""

    digits: int
    digits_b: int
    train: list[Problem]
    held_out: list[Problem]
    tool_demo_frac: float = 0.2

    alphabet: ClassVar[str] = TOOL_ALPHABET
    special_tokens: ClassVar[tuple[str, ...]] = TAGS
    tool: ClassVar[str | None] = "calculator"  # what `call_tools` uses unless the pipeline names another

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return columnar_reduce(self)  # fast to ship to the workers: plexrl/job/tasks/_columns.py

    @property
    def max_answer_chars(self) -> int:
        return self.digits + self.digits_b

    @property
    def max_turn_tokens(self) -> int:
        """Tokens of the longest model turn: a call `<call>a*b</call>` or an answer with its eos."""
        return max(self.digits + self.digits_b + 3, self.max_answer_chars + 1)

    def verify(self, completions: list[str], answers: list[str]) -> list[float | None]:
        return verify_answers(completions, answers)

    def demonstration(self, problem: Problem, use_tool: bool) -> list[tuple[str, bool]]:
        """The warm start's target after the prompt, as (text, written by the model) segments; the eos is
        appended by the caller. With `use_tool`: call, tool output (not trained on), answer.

        >>> task = ToolArithmeticTask(3, 2, [], [])
        >>> task.demonstration(Problem("347*58=", "20126"), True)
        [('<call>347*58</call>', True), ('<out>20126</out>', False), ('20126', True)]
        >>> task.demonstration(Problem("347*58=", "20126"), False)
        [('20126', True)]
        """
        if not use_tool:
            return [(problem.answer, True)]
        expression = problem.prompt.removesuffix("=")
        call, output = f"{CALL}{expression}{CALL_END}", f"{OUT}{problem.answer}{OUT_END}"
        return [(call, True), (output, False), (problem.answer, True)]


def operand_range(digits: int) -> tuple[int, int]:
    return (10 ** (digits - 1) if digits > 1 else 0), 10**digits - 1


def make_tool_task(cfg: TaskConfig) -> ToolArithmeticTask:
    """Generate the splits of `cfg.digits` x `cfg.digits_b` multiplication; the same config gives the same
    problems. Raises ValueError when the splits ask for more distinct problems than exist."""
    digits_b = cfg.digits_b or cfg.digits
    (lo_a, hi_a), (lo_b, hi_b) = operand_range(cfg.digits), operand_range(digits_b)
    space = (hi_a - lo_a + 1) * (hi_b - lo_b + 1)
    want = cfg.train_size + cfg.eval_size
    if want > space:
        raise ValueError(f"task.train_size + task.eval_size = {want} exceeds the {space} distinct problems")
    rng = random.Random(cfg.seed)
    seen: set[tuple[int, int]] = set()
    pairs: list[tuple[int, int]] = []
    while len(pairs) < want:
        a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
        if (a, b) not in seen:
            seen.add((a, b))
            pairs.append((a, b))
    probs = [Problem(f"{a}*{b}=", str(a * b)) for a, b in pairs]
    return ToolArithmeticTask(cfg.digits, digits_b, probs[cfg.eval_size :], probs[: cfg.eval_size], cfg.tool_demo_frac)
