"""A job's data from files: the config (`DataConfig`), checked row readers (jsonl, parquet, csv, a
`save_to_disk` directory; `files.py`), train / held-out splits with the prompt-length filter (`dataset.py`),
and prompt rendering through the model's tokenizer and chat template (`prompts.py`). numpy and pyarrow are
imported only when a file is opened. See docs/data-and-rewards.md."""

from __future__ import annotations

from plexrl.data.config import BUILTIN_REWARDS, ColumnMap, DataConfig, RewardTerm
from plexrl.data.dataset import FileDataset, Split, open_dataset
from plexrl.data.files import DataError, Layout, Row, detect_layout, open_rows
from plexrl.data.prompts import SpecialIds, build_messages, prompt_ids, render_prompt, special_ids

__all__ = [
    "BUILTIN_REWARDS",
    "ColumnMap",
    "DataConfig",
    "DataError",
    "FileDataset",
    "Layout",
    "RewardTerm",
    "Row",
    "SpecialIds",
    "Split",
    "build_messages",
    "detect_layout",
    "open_dataset",
    "open_rows",
    "prompt_ids",
    "render_prompt",
    "special_ids",
]
