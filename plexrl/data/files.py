"""Rows of a data file, read by index where they are used: jsonl, parquet, csv, a `save_to_disk` directory.

Layouts (`detect_layout`; `data.columns` overrides either column):
- verl's RL parquet: `prompt` is a list of chat messages `[{role, content}]`, the ground truth is
  `reward_model.ground_truth` (with `reward_model.style`), plus `data_source` and `extra_info`;
- TRL style: `prompt` (a string or messages) and the first of `answer`, `solution`, `ground_truth`;
- any other: `columns: {prompt: question, answer: final}` (a dot reads a field of a struct column).

Readers pickle small: a job's spec carries `(path, index file)`, never the rows. `JsonlRows` keeps the byte
offset of every line in a `.npy` file (memory-mapped); `ArrowRows` memory-maps an Arrow IPC file: a copy of a
parquet or csv file written once into the cache directory, or the shards of a `save_to_disk` directory as
they are (read with pyarrow alone: the `datasets` package is not needed).

Every file is checked when opened (every jsonl line is parsed; parquet and csv columns are checked by type
and null count), and bad data raises one `DataError` listing each problem by file, row and column with the
fix: a missing column, a wrong type, a null ground truth, an empty file, bytes that are not UTF-8, a line that
is not JSON. Rows are numbered from 0 as data rows (a jsonl row's line is row + 1, blank lines aside).

What this module does NOT do: render prompts (plexrl/data/prompts.py), split or filter rows
(plexrl/data/dataset.py), or watch files for changes (a changed file gets a new cache key: size, mtime).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from plexrl.data.config import ColumnMap
from plexrl.errors import ConfigError, Problem

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
        problems.append(data_problem(path, f"no prompt column {prompt!r} (columns: {list(columns)}); {fix}", 0, prompt))
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
                    f"no answer column: none of reward_model, {', '.join(ANSWER_COLUMNS)} (columns: {list(columns)})"
                    "; set data.columns.answer to the column of the ground truth",
                    0,
                    "answer",
                )
            )
    if answer[0] not in columns and not problems:
        problems.append(
            data_problem(
                path,
                f"no answer column {answer[0]!r} (columns: {list(columns)}); fix data.columns.answer",
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


def _raise(problems: list[Problem], path: Path) -> None:
    if problems:
        more = len(problems) - MAX_PROBLEMS
        shown = problems[:MAX_PROBLEMS]
        if more > 0:
            shown.append(Problem(str(path), f"... and {more} more problem(s)"))
        raise DataError(shown, str(path))


class JsonlRows:
    """A jsonl file read by byte offset: the offsets of its non-blank lines live in a memory-mapped `.npy`."""

    __slots__ = ("_offsets", "index_path", "layout", "path")

    def __init__(self, path: Path, index_path: Path, layout: Layout) -> None:
        self.path, self.index_path, self.layout = path, index_path, layout
        self._offsets: Any = None

    @classmethod
    def open(cls, path: Path, cache_dir: Path, mapping: ColumnMap) -> JsonlRows:
        """Index and check every line of `path` (raises `DataError`), writing the offsets under `cache_dir`."""
        import numpy as np

        offsets: list[int] = []
        problems: list[Problem] = []
        layout: Layout | None = None
        pos = 0
        with path.open("rb") as fh:
            for line_no, raw in enumerate(fh, start=1):
                start, pos = pos, pos + len(raw)
                if not raw.strip():
                    continue
                row = len(offsets)
                offsets.append(start)
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    problems.append(
                        data_problem(
                            path,
                            f"line {line_no} is not UTF-8 (byte {start + exc.start}); re-encode the file as UTF-8",
                            row,
                        )
                    )
                    continue
                except json.JSONDecodeError as exc:
                    problems.append(data_problem(path, f"line {line_no} is not JSON ({exc.msg})", row))
                    continue
                if layout is None:
                    if not isinstance(record, dict):
                        problems.append(data_problem(path, f"line {line_no} is not a JSON object", row))
                        continue
                    layout = detect_layout(list(record), mapping, path)
                problems += to_row(record, layout, path, row)[1]
        if not offsets:
            problems.append(
                data_problem(path, "the file has no rows; point data.train / data.held_out at a file with data")
            )
        _raise(problems, path)
        assert layout is not None
        cache_dir.mkdir(parents=True, exist_ok=True)
        index = cache_dir / f"{path.stem}-{file_key(path)}.offsets.npy"
        save_npy(index, np.asarray(offsets, dtype=np.int64))
        return cls(path, index, layout)

    def __len__(self) -> int:
        return len(self._index())

    def _index(self) -> Any:
        if self._offsets is None:
            import numpy as np

            self._offsets = np.load(self.index_path, mmap_mode="r")
        return self._offsets

    def row(self, i: int) -> Row:
        with self.path.open("rb") as fh:
            fh.seek(int(self._index()[i]))
            record = json.loads(fh.readline().decode("utf-8"))
        got, problems = to_row(record, self.layout, self.path, i)
        _raise(problems, self.path)  # the file changed since it was checked
        assert got is not None
        return got

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return JsonlRows, (self.path, self.index_path, self.layout)


class ArrowRows:
    """Rows of memory-mapped Arrow IPC files (`stream`: the stream format of `save_to_disk` shards)."""

    __slots__ = ("_table", "files", "layout", "path", "stream")

    def __init__(self, path: Path, files: tuple[Path, ...], stream: bool, layout: Layout) -> None:
        self.path, self.files, self.stream, self.layout = path, files, stream, layout
        self._table: Any = None

    def table(self) -> Any:
        """The rows as one pyarrow Table over the mapped files (zero-copy)."""
        if self._table is None:
            self._table = read_arrow(self.files, self.stream)
        return self._table

    def __len__(self) -> int:
        return int(self.table().num_rows)

    def row(self, i: int) -> Row:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {self.path} ({len(self)} rows)")
        record = self.table().slice(i, 1).to_pylist()[0]
        got, problems = to_row(record, self.layout, self.path, i)
        _raise(problems, self.path)
        assert got is not None
        return got

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return ArrowRows, (self.path, self.files, self.stream, self.layout)


def read_arrow(files: Sequence[Path], stream: bool) -> Any:
    import pyarrow as pa

    tables = []
    for f in files:
        source = pa.memory_map(str(f), "r")
        reader = pa.ipc.open_stream(source) if stream else pa.ipc.open_file(source)
        tables.append(reader.read_all())
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def save_npy(path: Path, array: Any) -> None:
    import numpy as np

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as fh:
        np.save(fh, array)
    tmp.replace(path)


def open_rows(path_text: str, cache_dir: Path, mapping: ColumnMap) -> RowSource:
    """The checked rows of a data file or `save_to_disk` directory (see the module docstring); raises
    `DataError` for bad data or a file of an unknown kind."""
    path = Path(path_text).expanduser()
    if not path.exists():
        raise DataError([data_problem(path, "no such file or directory; check the path")], str(path))
    if path.is_dir():
        files = _saved_dataset_files(path)
        return _check_arrow(ArrowRows(path, files, True, _arrow_layout(path, files, True, mapping)))
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return JsonlRows.open(path, cache_dir, mapping)
    if suffix in (".parquet", ".csv"):
        arrow = _to_arrow(path, cache_dir)
        return _check_arrow(ArrowRows(path, (arrow,), False, _arrow_layout(path, (arrow,), False, mapping)))
    raise DataError(
        [data_problem(path, f"unknown data file kind {suffix!r}; use .jsonl, .parquet, .csv or a save_to_disk dir")],
        str(path),
    )


def _saved_dataset_files(path: Path) -> tuple[Path, ...]:
    """The Arrow shards of a directory written by `datasets.Dataset.save_to_disk` (its state.json)."""
    state = path / "state.json"
    if not state.is_file():
        found = "a DatasetDict (pick a split: its sub-directory)" if (path / "dataset_dict.json").is_file() else ""
        raise DataError(
            [data_problem(path, f"not a save_to_disk directory (no state.json){'; it is ' + found if found else ''}")],
            str(path),
        )
    try:
        names = [f["filename"] for f in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(
            [data_problem(state, f"unreadable state.json ({exc}); save the dataset again")], str(path)
        ) from None
    if not names:
        raise DataError([data_problem(path, "the dataset has no data files (no rows)")], str(path))
    return tuple(path / n for n in names)


def _to_arrow(path: Path, cache_dir: Path) -> Path:
    """An Arrow IPC copy of a parquet or csv file under `cache_dir` (written once per file version)."""
    import pyarrow as pa

    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"{path.stem}-{file_key(path)}.arrow"
    if out.is_file():
        return out
    if path.stat().st_size == 0:
        raise DataError(
            [data_problem(path, "the file is empty; point data.train / data.held_out at a file with data")], str(path)
        )
    try:
        if path.suffix.lower() == ".csv":
            _check_utf8_lines(path)
            import pyarrow.csv as pcsv

            table = pcsv.read_csv(str(path))
        else:
            import pyarrow.parquet as pq

            table = pq.read_table(str(path))
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError([data_problem(path, f"cannot read the file: {exc}")], str(path)) from None
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    tmp.replace(out)
    return out


def _check_utf8_lines(path: Path) -> None:
    problems = []
    with path.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                problems.append(
                    data_problem(
                        path,
                        f"line {line_no} is not UTF-8 (byte {exc.start} of the line); re-encode the file as UTF-8",
                        max(line_no - 2, 0),
                    )
                )
    _raise(problems, path)


def _arrow_layout(path: Path, files: tuple[Path, ...], stream: bool, mapping: ColumnMap) -> Layout:
    return detect_layout(read_arrow(files, stream).schema.names, mapping, path)


def _check_arrow(rows: ArrowRows) -> ArrowRows:
    """Column checks of a whole table at once: no rows, a wrong column type, the first null in a column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table, layout, path = rows.table(), rows.layout, rows.path
    if table.num_rows == 0:
        raise DataError(
            [data_problem(path, "the file has no rows; point data.train / data.held_out at a file with data")],
            str(path),
        )
    problems: list[Problem] = []
    prompt = table.column(layout.prompt)
    ptype = prompt.type
    if not (
        pa.types.is_string(ptype)
        or pa.types.is_large_string(ptype)
        or pa.types.is_list(ptype)
        or pa.types.is_large_list(ptype)
        or pa.types.is_null(ptype)
    ):
        problems.append(
            data_problem(
                path,
                f"the prompt column has type {ptype}; expected a string or a list of {{role, content}} messages",
                0,
                layout.prompt,
            )
        )
    answer = table.column(layout.answer[0])
    for part in layout.answer[1:]:
        if not pa.types.is_struct(answer.type) or answer.type.get_field_index(part) < 0:
            problems.append(
                data_problem(
                    path,
                    f"column {layout.answer[0]!r} has no field {part!r} (type {answer.type}); fix data.columns.answer",
                    0,
                    layout.answer_name,
                )
            )
            break
        answer = pc.struct_field(answer, part)
    else:
        if pa.types.is_boolean(answer.type):
            problems.append(
                data_problem(
                    path, "the ground truth column is boolean; expected a string or a number", 0, layout.answer_name
                )
            )
    for name, column in ((layout.prompt, prompt), (layout.answer_name, answer)):
        if problems or column.null_count == 0:
            continue
        first = pc.index(pc.is_null(column), True).as_py()
        what = "prompt" if name == layout.prompt else "ground truth"
        problems.append(
            data_problem(
                path,
                f"the {what} is null ({column.null_count} null rows in all); fill them in or drop the rows",
                first,
                name,
            )
        )
    _raise(problems, path)
    return rows


__all__ = [
    "ANSWER_COLUMNS",
    "ArrowRows",
    "DataError",
    "JsonlRows",
    "Layout",
    "Row",
    "RowSource",
    "detect_layout",
    "file_key",
    "open_rows",
    "to_row",
]
