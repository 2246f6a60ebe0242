"""A job's data from files: train and held-out splits of checked rows, read by index where they are used.

`open_dataset(cfg, cache_dir, count_tokens)` opens `cfg.train` (and `cfg.held_out`, or holds out a seeded
`cfg.held_out_fraction` of train), then, with `cfg.max_prompt_tokens`, drops the rows whose rendered prompt
is longer (`count_tokens(row)` tokens; counted in `FileDataset.dropped` and logged). A split is a row source
plus an optional index of kept rows in a memory-mapped `.npy` file under `cache_dir`, so it pickles as a few
paths whatever the number of rows; the filter's result is cached there under a key of the file version and
`filter_key` (the caller's fingerprint of the tokenizer and the prompt framing).

What this module does NOT do: tokenize or render (the caller's `count_tokens`; plexrl/data/prompts.py), or
score (plexrl/rewards.py).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plexrl.cache_files import key_lock, write_atomic
from plexrl.data.config import DataConfig
from plexrl.data.files import open_rows
from plexrl.data.rows import DataError, Row, RowSource, data_problem, file_key, save_npy
from plexrl.paths import check_path

log = logging.getLogger(__name__)


class Split:
    """The rows of `source` at the positions of the index file (all rows when it is None), in file order.
    Indexable and sized like a list; pickles as (source, index path)."""

    __slots__ = ("_index", "index_path", "source")

    def __init__(self, source: RowSource, index_path: Path | None = None) -> None:
        self.source, self.index_path = source, index_path
        self._index: Any = None

    def _positions(self) -> Any:
        if self._index is None and self.index_path is not None:
            import numpy as np

            self._index = np.load(self.index_path, mmap_mode="r")
        return self._index

    def __len__(self) -> int:
        index = self._positions()
        return len(self.source) if index is None else len(index)

    def position(self, i: int) -> int:
        """The row number in the file of this split's `i`-th row (negative `i` counts from the end)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of a split of {n} rows of {self.source.path}")
        i %= n
        index = self._positions()
        return i if index is None else int(index[i])

    def __getitem__(self, i: int) -> Row:
        return self.source.row(self.position(i))

    def __iter__(self) -> Iterator[Row]:
        return (self[i] for i in range(len(self)))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return Split, (self.source, self.index_path)


@dataclass(slots=True)
class FileDataset:
    """Train and held-out splits; `dropped`: rows dropped per split by `max_prompt_tokens`."""

    train: Split
    held_out: Split
    dropped: dict[str, int] = field(default_factory=dict)


def open_dataset(
    cfg: DataConfig,
    cache_dir: Path,
    count_tokens: Callable[[Row], int] | None = None,
    filter_key: str = "",
) -> FileDataset:
    """Open and check the files of `cfg` (raises `DataError`), split and filter them as the module
    docstring says. `count_tokens` is required when `cfg.max_prompt_tokens` is set."""
    import numpy as np

    # the caches are written: under the policy in force, only where the job may write (plexrl/paths.py)
    cache_dir = (
        check_path(cfg.cache_dir, "data.cache_dir", write=True)
        if cfg.cache_dir
        else check_path(cache_dir, "run_dir", write=True)
    )
    train_src = open_rows(cfg.train, cache_dir, cfg.columns, "data.train")
    if cfg.held_out is not None:
        held_src = open_rows(cfg.held_out, cache_dir, cfg.columns, "data.held_out")
        train, held = Split(train_src), Split(held_src)
    elif cfg.held_out_fraction > 0:
        n = len(train_src)
        k = round(n * cfg.held_out_fraction)
        if k == 0 or k == n:
            raise DataError(
                [
                    data_problem(
                        train_src.path,
                        f"held_out_fraction {cfg.held_out_fraction} of {n} rows holds out {k}; "
                        "choose a fraction that leaves rows on both sides, or give data.held_out",
                    )
                ],
                str(train_src.path),
            )
        perm = np.random.default_rng(cfg.split_seed).permutation(n)
        stem = f"{train_src.path.stem}-{file_key(train_src.path)}-split{cfg.split_seed}-{cfg.held_out_fraction!r}"
        held_idx, train_idx = cache_dir / f"{stem}.held_out.npy", cache_dir / f"{stem}.train.npy"
        for out, part in ((held_idx, perm[:k]), (train_idx, perm[k:])):
            if not out.is_file():  # (the same rows for every writer: a rename over another's is harmless)
                save_npy(out, np.sort(part).astype(np.int64))
        train, held = Split(train_src, train_idx), Split(train_src, held_idx)
    else:
        train, held = Split(train_src), Split(train_src, _empty_index(cache_dir))
    dropped: dict[str, int] = {}
    if cfg.max_prompt_tokens is not None:
        if count_tokens is None:
            raise ValueError("data.max_prompt_tokens is set: pass count_tokens (the prompt's length in tokens)")
        train, dropped["train"] = _filter(train, cache_dir, cfg.max_prompt_tokens, count_tokens, filter_key)
        held, dropped["held_out"] = _filter(held, cache_dir, cfg.max_prompt_tokens, count_tokens, filter_key)
        if dropped["train"] or dropped["held_out"]:
            log.warning(
                "data: dropped %d train and %d held-out rows with prompts over max_prompt_tokens=%d",
                dropped["train"],
                dropped["held_out"],
                cfg.max_prompt_tokens,
            )
        if len(train) == 0:
            raise DataError(
                [
                    data_problem(
                        train_src.path,
                        f"every train prompt is longer than max_prompt_tokens={cfg.max_prompt_tokens}; raise it",
                    )
                ],
                str(train_src.path),
            )
    return FileDataset(train, held, dropped)


def longest_prompt(splits: list[Split], cache_dir: Path, count: Callable[[Row], int], key: str) -> int:
    """The most tokens any row of `splits` renders to (`count`), measured once per file version and `key`
    (the renderer's fingerprint) and kept in a small file under `cache_dir` (written under the key's lock)."""
    import json

    what = (
        "|".join(f"{file_key(s.source.path)}:{s.index_path.name if s.index_path else 'all'}" for s in splits)
        + f"|{key}"
    )
    out = cache_dir / f"longest-{hashlib.sha256(what.encode()).hexdigest()[:16]}.json"
    if not out.is_file():
        with key_lock(out):
            if not out.is_file():
                most = max((count(s[i]) for s in splits for i in range(len(s))), default=0)
                write_atomic(out, lambda tmp: tmp.write_text(json.dumps({"longest_prompt": most})))
    return int(json.loads(out.read_text())["longest_prompt"])


def _empty_index(cache_dir: Path) -> Path:
    import numpy as np

    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / "empty.npy"
    if not path.is_file():
        save_npy(path, np.zeros(0, dtype=np.int64))
    return path


def _filter(split: Split, cache_dir: Path, limit: int, count: Callable[[Row], int], key: str) -> tuple[Split, int]:
    """`split` without the rows over `limit` tokens, and how many were dropped (cached by file, split, key)."""
    import numpy as np

    if len(split) == 0:
        return split, 0
    src = split.source.path
    what = f"{file_key(src)}|{split.index_path.name if split.index_path else 'all'}|{limit}|{key}"
    out = cache_dir / f"{src.stem}-{hashlib.sha256(what.encode()).hexdigest()[:16]}.kept.npy"
    if not out.is_file():
        with key_lock(out):  # one count per key; the others wait and read it (plexrl/cache_files.py)
            if not out.is_file():
                kept = [split.position(i) for i in range(len(split)) if count(split[i]) <= limit]
                save_npy(out, np.asarray(kept, dtype=np.int64))
    kept_split = Split(split.source, out)
    return kept_split, len(split) - len(kept_split)


__all__ = ["FileDataset", "Split", "longest_prompt", "open_dataset"]
