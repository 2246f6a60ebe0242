"""A task over a dataset from files, with prompts rendered by the model's own tokenizer and chat template.

`make_dataset_task(cfg, tokenizer, tokenizer_dir=..., cache_dir=...)` opens the files of a `DataConfig`
(plexrl/data/dataset.py: checked, split, long prompts dropped) and builds its `Reward` (plexrl/rewards.py).
It fits what the operators expect of a task:

- `task.train` / `task.held_out`: sized, indexable (ints and slices) sequences of `DatasetProblem`, each
  read from its file and rendered when it is indexed: `prompt` (the text after the chat template),
  `prompt_ids` (its token ids: no special tokens added after a template), `answer` (the ground truth);
- `task.verify(completions, answers)`: the FIRST reward term's verdict (1.0 where it scored 1, else 0.0; a
  user reward there gets an empty prompt and `{}`), so `verify` (its correct / wrong rewards) and `evaluate`
  (held-out accuracy) work as for the generated tasks;
- `task.score(completions, answers, rows=..., split=...)`: the whole weighted reward with its components
  and failure counts (`RewardResult`); with `rows` (the prompts' positions in the split) a user reward also
  gets each row's rendered prompt and extra fields (the `verify` operator passes the rollout's `positions`),
  without them an empty prompt and `{}`.

Pickles small: the splits as file paths and index files, the tokenizer as its directory (loaded again, once
per process, where the task is unpickled), the reward as its terms.

What it does NOT do: warm starts (no demonstrations: a job on files starts from `model.path`), tool calls,
or tokenize for the operators (`sample_prompts` tokenizes `prompt` itself today; see docs/data-and-rewards.md
for the wiring that makes it use `prompt_ids`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, overload

from plexrl.data.config import DataConfig
from plexrl.data.dataset import FileDataset, Split, longest_prompt, open_dataset
from plexrl.data.prompts import has_chat_template, prompt_ids, render_prompt
from plexrl.data.rows import Row
from plexrl.paths import resolve
from plexrl.rewards import Reward, RewardResult, build_reward

log = logging.getLogger(__name__)

_TOKENIZERS: dict[str, Any] = {}  # tokenizer directory -> loaded tokenizer (one per process)
_TOKENIZERS_LOCK = threading.Lock()


def load_tokenizer(directory: str) -> Any:
    """The tokenizer saved in `directory`, loaded once per process."""
    with _TOKENIZERS_LOCK:
        if directory not in _TOKENIZERS:
            from transformers import PreTrainedTokenizerFast

            _TOKENIZERS[directory] = PreTrainedTokenizerFast.from_pretrained(directory)
        return _TOKENIZERS[directory]


@dataclass(frozen=True, slots=True)
class DatasetProblem:
    """One row as the model sees it: `prompt` rendered, `prompt_ids` its tokens, `answer` the ground truth;
    `row`: the position in its split; `extra`: the row's extra fields (for user rewards)."""

    prompt: str
    answer: str
    prompt_ids: list[int]
    row: int
    extra: dict[str, Any] = field(default_factory=dict)


class PromptRenderer:
    """Renders rows with a tokenizer (`tokenizer_dir`, or an object when there is no directory), a system
    prompt and a format instruction. Pickles as the directory when it has one."""

    __slots__ = ("_tokenizer", "format_instruction", "system_prompt", "tokenizer_dir")

    def __init__(
        self,
        tokenizer: Any = None,
        tokenizer_dir: str | None = None,
        system_prompt: str | None = None,
        format_instruction: str | None = None,
    ) -> None:
        if tokenizer is None and tokenizer_dir is None:
            raise ValueError("a PromptRenderer needs a tokenizer or the directory it is saved in")
        self._tokenizer, self.tokenizer_dir = tokenizer, tokenizer_dir
        self.system_prompt, self.format_instruction = system_prompt, format_instruction

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            assert self.tokenizer_dir is not None
            self._tokenizer = load_tokenizer(self.tokenizer_dir)
        return self._tokenizer

    def render(self, row: Row) -> tuple[str, list[int]]:
        text = render_prompt(self.tokenizer, row.prompt, self.system_prompt, self.format_instruction)
        return text, prompt_ids(self.tokenizer, text)

    def fingerprint(self) -> str:
        """What the rendered length of a prompt depends on (the cache key of the length filter)."""
        tok = self.tokenizer
        parts = [
            str(getattr(tok, "name_or_path", "")),
            str(len(tok)),
            str(getattr(tok, "chat_template", "") or ""),
            str(has_chat_template(tok)),
            self.system_prompt or "",
            self.format_instruction or "",
        ]
        return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        tok = None if self.tokenizer_dir is not None else self._tokenizer
        return PromptRenderer, (tok, self.tokenizer_dir, self.system_prompt, self.format_instruction)


class DatasetView(Sequence[DatasetProblem]):
    """A split whose rows are read and rendered when indexed (ints, negative ints, slices)."""

    __slots__ = ("renderer", "split")

    def __init__(self, split: Split, renderer: PromptRenderer) -> None:
        self.split, self.renderer = split, renderer

    def __len__(self) -> int:
        return len(self.split)

    @overload
    def __getitem__(self, i: int) -> DatasetProblem: ...

    @overload
    def __getitem__(self, i: slice) -> list[DatasetProblem]: ...

    def __getitem__(self, i: int | slice) -> DatasetProblem | list[DatasetProblem]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        row = self.split[i]
        text, ids = self.renderer.render(row)
        return DatasetProblem(text, row.ground_truth, ids, i % len(self), row.extra)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return DatasetView, (self.split, self.renderer)


@dataclass(slots=True)
class DatasetTask:
    """Train and held-out rows of data files, scored by the job's reward (see the module docstring)."""

    train: DatasetView
    held_out: DatasetView
    reward: Reward
    accuracy: Reward  # the reward's first term alone: what `verify` computes
    dropped: dict[str, int] = field(default_factory=dict)
    max_answer_chars: int = 256  # what a check of held-out accuracy lets the model write (no warm start here)
    longest_prompt: int | None = None  # tokens of the longest rendered prompt (or max_prompt_tokens): engine sizing

    alphabet: ClassVar[str] = ""  # a real tokenizer: nothing to build
    special_tokens: ClassVar[tuple[str, ...]] = ()
    tool: ClassVar[str | None] = None
    tool_demo_frac: ClassVar[float] = 0.0

    def verify(
        self, completions: list[str], answers: list[str], problems: Sequence[DatasetProblem] | None = None
    ) -> list[float | None]:
        """The first reward term's verdict per completion: 1.0 when it scored 1, else 0.0. With `problems`
        (completion i answers problems[i], e.g. the held-out rows `evaluate` asked) a user reward gets each
        row's rendered prompt and extra fields, else '' and {}."""
        n = len(completions)
        prompts = [p.prompt for p in problems] if problems is not None else [""] * n
        extras = [p.extra for p in problems] if problems is not None else [{} for _ in range(n)]
        result = self.accuracy(prompts, list(completions), list(answers), extras)
        return [1.0 if ok else 0.0 for ok in result.correct]

    def score(
        self,
        completions: Sequence[str],
        answers: Sequence[str],
        rows: Sequence[int] | None = None,
        split: Literal["train", "held_out"] = "train",
    ) -> RewardResult:
        """The job's whole reward on a batch; `rows[i]`: the position in `split` of completion i's prompt
        (then user rewards get its rendered prompt and extra fields)."""
        extras: list[dict[str, Any]]
        if rows is None:
            prompts, extras = [""] * len(completions), [{} for _ in completions]
        else:
            if len(rows) != len(completions):
                raise ValueError(f"{len(rows)} row positions for {len(completions)} completions: pass one per row")
            view = self.train if split == "train" else self.held_out
            seen = {r: view[r] for r in dict.fromkeys(rows)}  # a group's G rows share one prompt: read it once
            prompts, extras = [seen[r].prompt for r in rows], [seen[r].extra for r in rows]
        return self.reward(prompts, list(completions), list(answers), extras)

    def demonstration(self, problem: DatasetProblem, use_tool: bool) -> list[tuple[str, bool]]:
        raise ValueError(
            "a task on data files has no demonstrations to warm-start on; set warm_start.enabled: false and "
            "model.path to the model to train"
        )


def make_dataset_task(
    cfg: DataConfig,
    tokenizer: Any = None,
    *,
    tokenizer_dir: str | Path | None = None,
    cache_dir: Path,
) -> DatasetTask:
    """Open, check, split and filter the data of `cfg` (raises `plexrl.data.files.DataError`), with prompts
    rendered by `tokenizer` (or the one saved in `tokenizer_dir`: then the task pickles as that path), and
    build its reward (raises `ConfigError` for a ref that does not resolve)."""
    renderer = PromptRenderer(
        tokenizer, None if tokenizer_dir is None else str(tokenizer_dir), cfg.system_prompt, cfg.format_instruction
    )
    reward = build_reward(cfg.rewards)

    def count_tokens(row: Row) -> int:
        return len(renderer.render(row)[1])

    data: FileDataset = open_dataset(cfg, cache_dir, count_tokens, renderer.fingerprint())
    cache = resolve(cfg.cache_dir) if cfg.cache_dir else cache_dir
    longest = cfg.max_prompt_tokens  # the bound of the kept rows; unbounded: measured once (cached)
    if longest is None:
        longest = longest_prompt([data.train, data.held_out], cache, count_tokens, renderer.fingerprint())
    if len(data.held_out) == 0:
        log.warning("data: no held-out rows (set data.held_out or data.held_out_fraction to evaluate)")
    log.info("data: %d train rows, %d held-out rows from %s", len(data.train), len(data.held_out), cfg.train)
    train, held_out = DatasetView(data.train, renderer), DatasetView(data.held_out, renderer)
    return DatasetTask(train, held_out, reward, build_reward(cfg.rewards[:1]), data.dropped, longest_prompt=longest)


__all__ = ["DatasetProblem", "DatasetTask", "DatasetView", "PromptRenderer", "load_tokenizer", "make_dataset_task"]
