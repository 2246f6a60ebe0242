"""Rows of memory-mapped Arrow IPC files: parquet and csv files copied once into the cache directory, and the
shards of a `datasets.Dataset.save_to_disk` directory read as they are (pyarrow alone). Whole-table checks
(column types, the first null) run once when a file is opened. See plexrl/data/files.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from plexrl.cache_files import key_lock, write_atomic
from plexrl.data.config import ColumnMap
from plexrl.data.rows import DataError, Layout, Row, data_problem, detect_layout, file_key, raise_problems, to_row
from plexrl.errors import Problem
from plexrl.paths import LineTooLong, check_path, current_policy, open_file, read_lines


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
        raise_problems(problems, self.path)
        assert got is not None
        return got

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return ArrowRows, (self.path, self.files, self.stream, self.layout)


def read_arrow(files: Sequence[Path], stream: bool) -> Any:
    """The files as one table, each memory-mapped from the descriptor `plexrl.paths.open_file` opened (a
    regular file, allowed by the policy in force): never a FIFO, never the target of a link swapped in."""
    import pyarrow as pa

    tables = []
    for f in files:
        with open_file(f, "data") as fh:
            source = pa.memory_map(f"/proc/self/fd/{fh.fileno()}", "r")
            reader = pa.ipc.open_stream(source) if stream else pa.ipc.open_file(source)
            tables.append(reader.read_all())
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def _saved_dataset_files(path: Path, where: str) -> tuple[Path, ...]:
    """The Arrow shards of a directory written by `datasets.Dataset.save_to_disk` (its state.json), each allowed
    by the policy in force (a name in state.json cannot lead out of the directory's roots)."""
    state = path / "state.json"
    if not state.is_file():
        found = "a DatasetDict (pick a split: its sub-directory)" if (path / "dataset_dict.json").is_file() else ""
        raise DataError(
            [data_problem(path, f"not a save_to_disk directory (no state.json){'; it is ' + found if found else ''}")],
            str(path),
        )
    try:
        with open_file(state, where) as fh:
            names = [f["filename"] for f in json.loads(fh.read(1 << 20).decode("utf-8"))["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(
            [data_problem(state, f"unreadable state.json ({exc}); save the dataset again")], str(path)
        ) from None
    if not names:
        raise DataError([data_problem(path, "the dataset has no data files (no rows)")], str(path))
    files = tuple(check_path(path / str(n), where) for n in names)
    for f in files:
        open_file(f, where).close()  # a regular file, within the size bound
    return files


def _to_arrow(path: Path, cache_dir: Path, where: str) -> Path:
    """An Arrow IPC copy of a parquet or csv file under `cache_dir`, written once per file version (under the
    key's lock, into a unique temporary file: plexrl/cache_files.py)."""
    out = cache_dir / f"{path.stem}-{file_key(path)}.arrow"
    if out.is_file():
        return out
    with key_lock(out):
        if not out.is_file():
            _write_arrow(path, out, where)
    return out


def _write_arrow(path: Path, out: Path, where: str) -> None:
    import pyarrow as pa

    with open_file(path, where) as fh:  # the policy, a regular file, the size bound: on this descriptor
        if os.fstat(fh.fileno()).st_size == 0:
            raise DataError(
                [data_problem(path, "the file is empty; point data.train / data.held_out at a file with data")],
                str(path),
            )
        table = _read_table(fh, path)

    def write(tmp: Path) -> None:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)

    write_atomic(out, write)


def _read_table(fh: BinaryIO, path: Path) -> Any:
    """The table of an open csv or parquet file. A csv's lines are checked first (UTF-8, each within the line
    bound); a parquet file's rows, once decompressed, must stay within the policy's size bound too (its footer
    says how large they are: a small file that expands to gigabytes is refused before it is read)."""
    import pyarrow as pa

    try:
        if path.suffix.lower() == ".csv":
            _check_utf8_lines(fh, path)
            fh.seek(0)
            import pyarrow.csv as pcsv

            return pcsv.read_csv(fh)
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(fh).metadata
        policy = current_policy()
        expanded = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        if policy is not None and policy.max_bytes is not None and expanded > policy.max_bytes:
            why = f"its rows take {expanded} bytes once decompressed; this server reads at most {policy.max_bytes}"
            raise DataError([data_problem(path, why + " (limits.max_data_bytes)")], str(path))
        fh.seek(0)
        return pq.read_table(fh)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError([data_problem(path, f"cannot read the file: {exc}")], str(path)) from None


def _check_utf8_lines(fh: BinaryIO, path: Path) -> None:
    problems = []
    try:
        for line_no, raw in enumerate(read_lines(fh), start=1):
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
    except LineTooLong as exc:
        raise DataError([data_problem(path, str(exc))], str(path)) from None
    raise_problems(problems, path)


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
    raise_problems(problems, path)
    return rows


def open_arrow(path: Path, cache_dir: Path, mapping: ColumnMap, where: str = "data") -> ArrowRows:
    """The checked rows of a parquet or csv file (copied to Arrow under `cache_dir`) or a save_to_disk dir
    (`where`: the config field that names it, for refusals)."""
    if path.is_dir():
        files = _saved_dataset_files(path, where)
        return _check_arrow(ArrowRows(path, files, True, _arrow_layout(path, files, True, mapping)))
    arrow = (_to_arrow(path, cache_dir, where),)
    return _check_arrow(ArrowRows(path, arrow, False, _arrow_layout(path, arrow, False, mapping)))


__all__ = ["ArrowRows", "open_arrow", "read_arrow"]
