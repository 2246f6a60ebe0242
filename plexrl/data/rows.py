"""Normalised rows of data files, their layouts, and `DataError` (see plexrl/data/files.py for the formats).

What this module does NOT do: read files (plexrl/data/files.py, plexrl/data/arrow.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from plexrl.cache_files import write_atomic
from plexrl.data.config import ColumnMap
from plexrl.errors import ConfigError, Problem
from plexrl.paths import current_policy

ANSWER_COLUMNS = ("answer", "solution", "ground_truth")
MAX_PROBLEMS = 20  # problems listed in one DataError (the count of the rest is given)


class DataError(ConfigError):
    """Bad data: each problem's `where` names the file, the row and the column; its message says the fix."""


def data_problem(path: Path | str, message: str, row: int | None = None, column: str | None = None) -> Problem:
    """A `Problem` located at `path`, `row`, `column` (any of the last two may be None)."""
    where = str(path)
    if row is not None:
        where += f", row {row}"
    if column is not None:
        where += f", column {column!r}"
    return Problem(where, message)


@dataclass(frozen=True, slots=True)
class Row:
    """One normalised row. `prompt`: a string or chat messages `[{"role", "content"}]`; `ground_truth`: text
    (numbers written as text, lists and dicts as JSON); `extra`: what a user reward may read (verl:
    `extra_info`'s fields plus `data_source` and `style`; other layouts: the row's other columns)."""

    prompt: str | list[dict[str, str]]
    ground_truth: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a file's prompt and ground truth are: `answer` is a path into nested fields."""

    kind: Literal["verl", "trl", "mapped"]
    prompt: str
    answer: tuple[str, ...]

    @property
    def answer_name(self) -> str:
        return ".".join(self.answer)


def _shown(columns: Sequence[str]) -> str:
    """The file's columns for a message: listed for `plexrl run`; not where a server's file policy is in force
    (a refusal there says what is missing, never what another file holds)."""
    return "" if current_policy() is not None else f" (columns: {list(columns)})"


def detect_layout(columns: Sequence[str], mapping: ColumnMap, path: Path | str) -> Layout:
    """The layout of a file with these top-level `columns`; raises `DataError` naming the missing column.

    >>> detect_layout(["data_source", "prompt", "reward_model", "extra_info"], ColumnMap(), "f.parquet")
    Layout(kind='verl', prompt='prompt', answer=('reward_model', 'ground_truth'))
    >>> detect_layout(["question", "final"], ColumnMap(prompt="question", answer="final"), "f.csv").kind
    'mapped'
    """
    mapped = mapping.prompt is not None or mapping.answer is not None
    prompt = mapping.prompt or "prompt"
    problems = []
    if prompt not in columns:
        fix = "set data.columns.prompt to the column that holds the prompt" if mapping.prompt is None else "fix it"
        problems.append(data_problem(path, f"no prompt column {prompt!r}{_shown(columns)}; {fix}", 0, prompt))
    if mapping.answer is not None:
        answer = tuple(mapping.answer.split("."))
        kind: Literal["verl", "trl", "mapped"] = "mapped"
    elif "reward_model" in columns:
        answer, kind = ("reward_model", "ground_truth"), "mapped" if mapped else "verl"
    else:
        found = [c for c in ANSWER_COLUMNS if c in columns]
        answer, kind = (found[0],) if found else ("answer",), "mapped" if mapped else "trl"
        if not found:
            problems.append(
                data_problem(
                    path,
                    f"no answer column: none of reward_model, {', '.join(ANSWER_COLUMNS)}{_shown(columns)}"
                    "; set data.columns.answer to the column of the ground truth",
                    0,
                    "answer",
                )
            )
    if answer[0] not in columns and not problems:
        problems.append(
            data_problem(
                path,
                f"no answer column {answer[0]!r}{_shown(columns)}; fix data.columns.answer",
                0,
                ".".join(answer),
            )
        )
    if problems:
        raise DataError(problems, str(path))
    return Layout(kind, prompt, answer)


def _messages(value: Any) -> str | None:
    """Why `value` is not a list of chat messages, or None when it is one."""
    if not value:
        return "an empty list of messages"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {i} is not {{role: str, content: str}} (got {str(m)[:80]!r})"
    return None


def to_row(record: Any, layout: Layout, path: Path | str, row: int) -> tuple[Row | None, list[Problem]]:
    """Normalise one record (a dict of column values) to a `Row`, or the problems that prevent it."""
    if not isinstance(record, dict):
        return None, [data_problem(path, f"a row must be a JSON object, not {type(record).__name__}", row)]
    problems = []
    prompt = record.get(layout.prompt)
    if prompt is None:
        what = "missing" if layout.prompt not in record else "null"
        problems.append(data_problem(path, f"the prompt is {what}; give every row a prompt", row, layout.prompt))
    elif isinstance(prompt, list):
        why = _messages(prompt)
        if why:
            problems.append(data_problem(path, f"the prompt is {why}", row, layout.prompt))
        else:
            prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    elif not isinstance(prompt, str):
        problems.append(
            data_problem(
                path,
                f"the prompt is {type(prompt).__name__}; expected a string or a list of {{role, content}} messages",
                row,
                layout.prompt,
            )
        )
    truth: Any = record
    for part in layout.answer:
        truth = truth.get(part) if isinstance(truth, dict) else None
    if truth is None:
        problems.append(
            data_problem(
                path, "the ground truth is null or missing; fill it in or drop the row", row, layout.answer_name
            )
        )
    elif isinstance(truth, bool) or not isinstance(truth, str | int | float | list | dict):
        problems.append(
            data_problem(
                path,
                f"the ground truth is {type(truth).__name__}; expected a string or a number",
                row,
                layout.answer_name,
            )
        )
    if problems:
        return None, problems
    text = truth if isinstance(truth, str) else json.dumps(truth) if isinstance(truth, list | dict) else str(truth)
    return Row(prompt, text, _extra(record, layout)), []  # type: ignore[arg-type]


def _extra(record: dict[str, Any], layout: Layout) -> dict[str, Any]:
    if layout.kind == "verl" or layout.answer[0] == "reward_model":
        extra = dict(record.get("extra_info") or {})
        for key in ("data_source", "ability"):
            if record.get(key) is not None:
                extra.setdefault(key, record[key])
        style = (record.get("reward_model") or {}).get("style")
        if style is not None:
            extra.setdefault("style", style)
        return extra
    return {k: v for k, v in record.items() if k not in (layout.prompt, layout.answer[0])}


class RowSource(Protocol):
    """The rows of one file: `len()` and `row(i)`; pickles as a few paths."""

    path: Path
    layout: Layout

    def __len__(self) -> int: ...

    def row(self, i: int) -> Row: ...


def file_key(path: Path) -> str:
    """A cache key of a file or directory: its resolved path, size and modification time."""
    st = path.stat()
    blob = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def raise_problems(problems: list[Problem], path: Path) -> None:
    if problems:
        more = len(problems) - MAX_PROBLEMS
        shown = problems[:MAX_PROBLEMS]
        if more > 0:
            shown.append(Problem(str(path), f"... and {more} more problem(s)"))
        raise DataError(shown, str(path))


def save_npy(path: Path, array: Any) -> None:
    """`array` saved to `path` whole (a unique temporary file renamed over it: plexrl/cache_files.py)."""
    import numpy as np

    def write(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            np.save(fh, array)

    write_atomic(path, write)


__all__ = [
    "ANSWER_COLUMNS",
    "DataError",
    "Layout",
    "Row",
    "RowSource",
    "data_problem",
    "detect_layout",
    "file_key",
    "raise_problems",
    "save_npy",
    "to_row",
]
