"""Rows of a data file, read by index where they are used: jsonl, parquet, csv, a `save_to_disk` directory.

Layouts (`detect_layout`; `data.columns` overrides either column):
- verl's RL parquet: `prompt` is a list of chat messages `[{role, content}]`, the ground truth is
  `reward_model.ground_truth` (with `reward_model.style`), plus `data_source` and `extra_info`;
- TRL style: `prompt` (a string or messages) and the first of `answer`, `solution`, `ground_truth`;
- any other: `columns: {prompt: question, answer: final}` (a dot reads a field of a struct column).

Readers pickle small: a job's spec carries `(path, index file)`, never the rows. `JsonlRows` keeps the byte
offset of every line in a `.npy` file (memory-mapped); `ArrowRows` (plexrl/data/arrow.py) memory-maps Arrow
IPC files: a copy of a parquet or csv file written once into the cache directory, or the shards of a
`save_to_disk` directory as they are (read with pyarrow alone: the `datasets` package is not needed).

Every file is checked when opened (every jsonl line is parsed; parquet and csv columns are checked by type
and null count), and bad data raises one `DataError` listing each problem by file, row and column with the
fix: a missing column, a wrong type, a null ground truth, an empty file, bytes that are not UTF-8, a line that
is not JSON. Rows are numbered from 0 as data rows (a jsonl row's line is row + 1, blank lines aside).

Rows, layouts and `DataError` live in plexrl/data/rows.py. What this module does NOT do: render prompts
(plexrl/data/prompts.py), split or filter rows (plexrl/data/dataset.py), or watch files for changes (a
changed file gets a new cache key: size, mtime).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, BinaryIO

from plexrl.cache_files import key_lock
from plexrl.data.arrow import ArrowRows, open_arrow
from plexrl.data.config import ColumnMap
from plexrl.data.rows import (
    ANSWER_COLUMNS,
    DataError,
    Layout,
    Row,
    RowSource,
    data_problem,
    detect_layout,
    file_key,
    raise_problems,
    save_npy,
    to_row,
)
from plexrl.errors import Problem
from plexrl.paths import LineTooLong, check_path, identity_of, open_file, read_lines, same_file


class JsonlRows:
    """A jsonl file read by byte offset: the offsets of its non-blank lines live in a memory-mapped `.npy`.
    `identity`: the file's (device, inode) when it was checked; a row read from another file (the path swapped
    for a link or another file since) is refused."""

    __slots__ = ("_offsets", "identity", "index_path", "layout", "path")

    def __init__(self, path: Path, index_path: Path, layout: Layout, identity: tuple[int, int]) -> None:
        self.path, self.index_path, self.layout, self.identity = path, index_path, layout, identity
        self._offsets: Any = None

    @classmethod
    def open(cls, path: Path, cache_dir: Path, mapping: ColumnMap, where: str = "data") -> JsonlRows:
        """Index and check every line of `path` (raises `DataError`), writing the offsets under `cache_dir`; a
        file already indexed and checked with this column mapping (same size and mtime) is not read again.
        Opened through `plexrl.paths.open_file` (the policy in force, a regular file, a size bound)."""
        import numpy as np

        mapped = hashlib.sha256(mapping.model_dump_json().encode()).hexdigest()[:8]
        with open_file(path, where) as fh:
            index = cache_dir / f"{path.stem}-{file_key(path)}-{mapped}.offsets.npy"
            identity = identity_of(fh)
            if not index.is_file():
                with key_lock(index):  # one indexing per file version; others wait and read it (cache_files.py)
                    if not index.is_file():
                        return cls(path, index, _index_lines(fh, path, index, mapping), identity)
            offsets_done = np.load(index, mmap_mode="r")
            fh.seek(int(offsets_done[0]))
            first = json.loads(next(read_lines(fh), b"{}").decode("utf-8"))
        return cls(path, index, detect_layout(list(first), mapping, path), identity)

    def __len__(self) -> int:
        return len(self._index())

    def _index(self) -> Any:
        if self._offsets is None:
            import numpy as np

            self._offsets = np.load(self.index_path, mmap_mode="r")
        return self._offsets

    def row(self, i: int) -> Row:
        with open_file(self.path, "data") as fh:  # (non-blocking open: a FIFO put in its place is refused)
            if not same_file(fh, self.identity):
                raise DataError([data_problem(self.path, "the file was replaced since it was checked; submit the "
                                                         "job again")], str(self.path))  # fmt: skip
            fh.seek(int(self._index()[i]))
            record = json.loads(next(read_lines(fh), b"").decode("utf-8"))
        got, problems = to_row(record, self.layout, self.path, i)
        raise_problems(problems, self.path)  # the file changed since it was checked
        assert got is not None
        return got

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return JsonlRows, (self.path, self.index_path, self.layout, self.identity)


def _index_lines(fh: BinaryIO, path: Path, index: Path, mapping: ColumnMap) -> Layout:
    """Check every line of `fh` (the open file at `path`; raises `DataError`; a line over the bound of
    `plexrl.paths.read_lines` too) and write the offsets of its rows to `index`."""
    import numpy as np

    offsets: list[int] = []
    problems: list[Problem] = []
    layout: Layout | None = None
    pos = 0
    try:
        for line_no, raw in enumerate(read_lines(fh), start=1):
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
    except LineTooLong as exc:
        raise DataError([data_problem(path, str(exc))], str(path)) from None
    if not offsets:
        problems.append(
            data_problem(path, "the file has no rows; point data.train / data.held_out at a file with data")
        )
    raise_problems(problems, path)
    assert layout is not None
    save_npy(index, np.asarray(offsets, dtype=np.int64))
    return layout


def open_rows(path_text: str, cache_dir: Path, mapping: ColumnMap, where: str = "data") -> RowSource:
    """The checked rows of a data file or `save_to_disk` directory (see the module docstring); raises
    `DataError` for bad data or a file of an unknown kind, `plexrl.paths.PathRefused` for a path the policy in
    force refuses (`where`: the config field, e.g. data.train)."""
    path = check_path(path_text, where)  # absolute: the spec is read where the job's nodes run
    cache_dir = cache_dir.resolve()
    if not path.exists():
        raise DataError([data_problem(path, "no such file or directory; check the path")], str(path))
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson") and not path.is_dir():
        return JsonlRows.open(path, cache_dir, mapping, where)
    if path.is_dir() or suffix in (".parquet", ".csv"):
        return open_arrow(path, cache_dir, mapping, where)
    raise DataError(
        [data_problem(path, f"unknown data file kind {suffix!r}; use .jsonl, .parquet, .csv or a save_to_disk dir")],
        str(path),
    )


__all__ = [
    "ANSWER_COLUMNS",
    "ArrowRows",
    "DataError",
    "JsonlRows",
    "Layout",
    "Row",
    "RowSource",
    "data_problem",
    "detect_layout",
    "file_key",
    "open_rows",
    "to_row",
]
