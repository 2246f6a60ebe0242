"""Verifiable tasks: seeded problem generators with train and held-out splits, and pure verifiers.

`make_task(cfg)` dispatches on `cfg.name`: `arithmetic` (addition, answered directly), `tool_arithmetic`
(multiplication solved with a calculator tool call, see `plexrl.episodes` for the tag format), `code` (a
Python expression written from input/output examples, run in the sandbox by `code_unit_tests`) or `copy` (a
digit sequence of heavy-tailed length copied: long-tailed rollouts). A job's data from files is a
`DatasetTask` (`make_dataset_task(cfg.data, tokenizer, ...)`, plexrl/job/tasks/dataset.py).
"""

from __future__ import annotations

from plexrl.job.config import TaskConfig
from plexrl.job.tasks.arithmetic import ArithmeticTask, Problem, verify_answers
from plexrl.job.tasks.arithmetic import make_task as make_arithmetic_task
from plexrl.job.tasks.code import CodeProblem, CodeTask, make_code_task
from plexrl.job.tasks.copy import CopyTask, make_copy_task
from plexrl.job.tasks.dataset import DatasetProblem, DatasetTask, make_dataset_task
from plexrl.job.tasks.tool_arithmetic import ToolArithmeticTask, make_tool_task

Task = ArithmeticTask | ToolArithmeticTask | CodeTask | CopyTask
SPECIALS = ["<pad>", "<bos>", "<eos>"]  # the first ids of every task's character tokenizer (`models.build_tokenizer`)


def tokenizer_size(name: str) -> int:
    """Tokens of the character-level tokenizer built for the task named `name` (`models.build_tokenizer`): the
    specials (pad, bos, eos), the task's extra special tokens and its alphabet. No problem is generated."""
    kinds: dict[str, type[Task]] = {"tool_arithmetic": ToolArithmeticTask, "code": CodeTask, "copy": CopyTask}
    kind = kinds.get(name, ArithmeticTask)
    return len(SPECIALS) + len(kind.special_tokens) + len(kind.alphabet)


def make_task(cfg: TaskConfig) -> Task:
    """Generate the task named by `cfg.name`; the same config always gives the same problems."""
    if cfg.name == "tool_arithmetic":
        return make_tool_task(cfg)
    if cfg.name == "code":
        return make_code_task(cfg)
    if cfg.name == "copy":
        return make_copy_task(cfg)
    return make_arithmetic_task(cfg)


__all__ = [
    "ArithmeticTask",
    "CodeProblem",
    "CodeTask",
    "CopyTask",
    "DatasetProblem",
    "DatasetTask",
    "Problem",
    "Task",
    "ToolArithmeticTask",
    "make_dataset_task",
    "make_task",
    "tokenizer_size",
    "verify_answers",
]
