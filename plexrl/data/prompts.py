"""Prompts through the model's own tokenizer and chat template, and the model's eos / pad ids.

`render_prompt` turns a row's prompt (a string or chat messages), with an optional system prompt and format
instruction, into the text the model sees: `tokenizer.apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)` when the tokenizer has a chat template, else plain text (the messages' contents
joined by blank lines). `prompt_ids` tokenizes that text: with `add_special_tokens=False` after a template
(the template writes its own bos, if the model wants one; transformers 5's `apply_chat_template(...,
tokenize=True)` returns a dict, which is never handed on), with the tokenizer's usual special tokens for
plain text. Engines take the ids (vLLM: `{"prompt_token_ids": ids}`), never the text.

`special_ids(model_dir, tokenizer)` reads eos (one id or several) and pad from the model's
`generation_config.json` when present, else from the tokenizer. `engine_special_ids(model_dir, eos_id,
pad_id)` is what the engines stop at and pad with: the eos id they were given first, then every other eos id
of the generation config (Llama 3 and Qwen name several: `<|eot_id|>` and `<|end_of_text|>`, `<|im_end|>`
and `<|endoftext|>`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plexrl.batch import Prompts

Messages = list[dict[str, str]]


def build_messages(
    prompt: str | Messages, system_prompt: str | None = None, format_instruction: str | None = None
) -> Messages:
    """The chat messages of a prompt: `system_prompt` first unless the prompt has a system message of its own,
    `format_instruction` appended to the last user message (after a blank line).

    >>> build_messages("2+2?", "Be brief.", "End with 'Answer: N'.")
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': "2+2?\\n\\nEnd with 'Answer: N'."}]
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if format_instruction:
        last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last is None:
            messages.append({"role": "user", "content": format_instruction})
        else:
            messages[last]["content"] = f"{messages[last]['content']}\n\n{format_instruction}"
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def has_chat_template(tokenizer: Any) -> bool:
    """Whether `tokenizer` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    tokenizer: Any,
    prompt: str | Messages,
    system_prompt: str | None = None,
    format_instruction: str | None = None,
) -> str:
    """The text the model is given for `prompt` (see the module docstring). Without a chat template:

    >>> render_prompt(None, "2+2?", "Be brief.", "Say 'Answer: N'.")
    "Be brief.\\n\\n2+2?\\n\\nSay 'Answer: N'."
    """
    messages = build_messages(prompt, system_prompt, format_instruction)
    if tokenizer is not None and has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
        return text
    return "\n\n".join(m["content"] for m in messages)


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered prompt: no special tokens added after a chat template (it wrote them), the
    tokenizer's usual ones (e.g. bos) for plain text."""
    ids = tokenizer(text, add_special_tokens=not has_chat_template(tokenizer))["input_ids"]
    return list(ids)


@dataclass(frozen=True, slots=True)
class SpecialIds:
    """eos: every id that ends a response (first: the one to append); pad: the padding id."""

    eos: tuple[int, ...]
    pad: int


def special_ids(model_dir: Path | str | None, tokenizer: Any) -> SpecialIds:
    """eos and pad ids: `generation_config.json` of `model_dir` first (its eos may be a list), then the
    tokenizer; pad falls back to the first eos. Raises ValueError when neither names an eos."""
    gen: dict[str, Any] = {}
    if model_dir is not None and (Path(model_dir) / "generation_config.json").is_file():
        gen = json.loads((Path(model_dir) / "generation_config.json").read_text(encoding="utf-8"))
    eos_value = gen.get("eos_token_id", getattr(tokenizer, "eos_token_id", None))
    eos = tuple(eos_value) if isinstance(eos_value, list) else () if eos_value is None else (int(eos_value),)
    if not eos:
        raise ValueError(
            f"no eos token id in {model_dir}/generation_config.json nor the tokenizer; set eos_token_id in one of them"
        )
    pad = gen.get("pad_token_id", getattr(tokenizer, "pad_token_id", None))
    return SpecialIds(eos, eos[0] if pad is None else int(pad))


def engine_special_ids(model_dir: Path | str | None, eos_id: int | None, pad_id: int | None) -> SpecialIds:
    """What an engine of the model in `model_dir` stops at and pads with. eos: `eos_id` (the tokenizer's)
    first, then the other eos ids of its `generation_config.json` (none there: `eos_id` alone); pad: `pad_id`,
    else the generation config's, else the first eos (Llama 3's tokenizer has no pad token). Raises ValueError
    when neither names an eos.

    >>> engine_special_ids(None, 2, 0)
    SpecialIds(eos=(2,), pad=0)
    """
    gen: dict[str, Any] = {}
    if model_dir is not None and (Path(model_dir) / "generation_config.json").is_file():
        gen = json.loads((Path(model_dir) / "generation_config.json").read_text(encoding="utf-8"))
    value = gen.get("eos_token_id")
    listed = [int(v) for v in value] if isinstance(value, list) else [] if value is None else [int(value)]
    eos = tuple(dict.fromkeys(([] if eos_id is None else [int(eos_id)]) + listed))
    if not eos:
        raise ValueError(
            f"no eos token id in {model_dir}/generation_config.json nor the tokenizer; set eos_token_id in one of them"
        )
    if pad_id is None:
        pad_id = gen.get("pad_token_id")
    return SpecialIds(eos, eos[0] if pad_id is None else int(pad_id))


def prompt_token_ids(problem: Any, tokenizer: Any) -> list[int]:
    """A task problem's prompt as token ids: those its task rendered (`prompt_ids`: a chat template already
    wrote the special tokens), else the tokenizer's ids of its text (bos included: the generated tasks)."""
    ids = getattr(problem, "prompt_ids", None)
    return list(ids) if ids is not None else tokenizer(problem.prompt)["input_ids"]


def prompts_of(problems: Sequence[Any], tokenizer: Any) -> Prompts:
    """The `Prompts` of task problems: texts, token ids (`prompt_token_ids`), answers, and their train-split
    positions where every problem knows its `row` (a task on data files), else none."""
    from plexrl.batch import Prompts

    rows = [getattr(p, "row", None) for p in problems]
    return Prompts(
        texts=[p.prompt for p in problems],
        token_ids=[prompt_token_ids(p, tokenizer) for p in problems],
        answers=[p.answer for p in problems],
        positions=[int(r) for r in rows if r is not None] if all(r is not None for r in rows) else [],
    )


__all__ = [
    "Messages",
    "SpecialIds",
    "build_messages",
    "engine_special_ids",
    "has_chat_template",
    "prompt_ids",
    "prompt_token_ids",
    "prompts_of",
    "render_prompt",
    "special_ids",
]
