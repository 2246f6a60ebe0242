"""What `plexrl validate` checks of a job's data and rewards before anything runs, with the errors `run` gives.

`check_data(cfg, cache_dir, tokenizer_dir)` opens the job's files exactly as preparing the job does
(`plexrl.data.dataset.open_dataset`: the schema and the columns the job needs, every row's prompt and ground
truth, the held-out split; with `max_prompt_tokens`, the prompt-length filter through the model's tokenizer),
renders the first train row as the model will see it, and resolves the reward's terms (a user reward's ref
through `plexrl.roles`, so the allow-list in force applies). Bad data raises the same `DataError` as `run`,
naming the file, the row, the column and the fix; a ref that does not resolve raises the same `ConfigError`.
It returns lines that say what was checked.

The files' Arrow copies and row indexes are written to the job's cache directory, where `run` finds them
(a checked file is not read again). What it does NOT do: call a reward (it only resolves it), or load the
model's weights.
"""

from __future__ import annotations

from pathlib import Path

from plexrl.data.config import DataConfig
from plexrl.data.rows import Row
from plexrl.job.tasks.dataset import PromptRenderer
from plexrl.paths import resolve


def data_cache_dir(cfg: DataConfig, run_dir: str | Path) -> Path:
    """Where a job keeps its data caches: `data.cache_dir`, else `<run_dir>/cache/data` (absolute)."""
    return resolve(cfg.cache_dir) if cfg.cache_dir else resolve(run_dir) / "cache" / "data"


def check_data(cfg: DataConfig, cache_dir: Path, tokenizer_dir: Path | None) -> list[str]:
    """Open, check and split the data of `cfg` and resolve its rewards (see the module docstring). Raises
    `DataError` / `ConfigError` as `run` does. `tokenizer_dir`: the model's directory (None: not available
    yet, e.g. a pretrained model not converted; then prompts are not rendered and, with `max_prompt_tokens`,
    not measured)."""
    from plexrl.data.dataset import open_dataset
    from plexrl.rewards import build_reward

    reward = build_reward(cfg.rewards)
    renderer = None
    if tokenizer_dir is not None:
        renderer = PromptRenderer(None, str(tokenizer_dir), cfg.system_prompt, cfg.format_instruction)
    count = None if renderer is None else (lambda row: len(renderer.render(row)[1]))
    if cfg.max_prompt_tokens is not None and renderer is None:
        data = open_dataset(cfg.model_copy(update={"max_prompt_tokens": None}), cache_dir)
    else:
        data = open_dataset(cfg, cache_dir, count, "" if renderer is None else renderer.fingerprint())
    layout = data.train.source.layout
    lines = [
        f"data: {cfg.train}: {len(data.train)} train rows, every row checked ({layout.kind} layout: prompt "
        f"{layout.prompt!r}, ground truth {layout.answer_name!r})",
        f"data: held out: {len(data.held_out)} rows"
        + (f" from {cfg.held_out}" if cfg.held_out else f" (held_out_fraction {cfg.held_out_fraction:g})"),
    ]
    if data.dropped:
        lines.append(
            f"data: max_prompt_tokens {cfg.max_prompt_tokens} drops {data.dropped.get('train', 0)} train and "
            f"{data.dropped.get('held_out', 0)} held-out rows"
        )
    if renderer is not None:
        first: Row = data.train[0]
        text, ids = renderer.render(first)
        lines.append(f"data: the first train prompt renders to {len(ids)} tokens: {text[-120:]!r}")
    else:
        lines.append("data: prompts not rendered (the model's tokenizer is not available yet)")
    terms = []
    for term, batched in zip(reward.terms, reward.batched, strict=True):
        kind = "built-in" if term.name else "user reward, batched" if batched else "user reward, per row"
        terms.append(f"{term.key} ({term.name or term.ref}: {kind}, weight {term.weight:g})")
    lines.append(f"rewards: resolved {', '.join(terms)}")
    lines.append(f"data: caches in {cache_dir}")
    return lines


__all__ = ["check_data", "data_cache_dir"]
