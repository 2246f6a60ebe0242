"""A small Llama-architecture model and a character tokenizer, built locally (nothing is downloaded),
saved in standard Hugging Face format (safetensors + tokenizer files) so any engine (torch, vLLM) loads it,
plus a supervised warm start. Both are cached under `<run_dir>/cache/<key>/` keyed by their configs.

Concurrency contract (a server prepares jobs on a pool of threads while its runner thread loads jobs onto
in-process services):
- `model_construction()` (`plexrl.job.construction`) is THE process-wide lock around building or loading a
  torch model: `build_model` and the warm start's engine take it, for the construction only, never for a warm
  start's training steps. This module's first imports of transformers take it too (two threads resolving
  transformers' lazy attributes at once can fail with "cannot import name").
- One preparation at a time per cache directory (`_cache_lock`, `plexrl.cache_files.key_lock`: threads of
  this process and other processes alike): two jobs with the same model, task, warm start and seed wait for
  each other, and the second finds the first's model in the cache.
- A preparation can be cancelled: `prepare_model` and `warm_start` take `cancel` (an event, set by a user's
  cancel or the server's stop) and raise `PreparationCancelled` at the next check (between two warm-start
  steps; while waiting for another preparation of the same cache directory). A cancelled warm start leaves
  no cache entry (its `plexrl_warm_start.json` is written last), so the next preparation builds it again.

What it does NOT do: interrupt a single warm-start step or evaluation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plexrl.cache_files import key_lock, write_atomic
from plexrl.job.config import TaskConfig, WarmStartConfig
from plexrl.job.construction import model_construction
from plexrl.job.model_config import ModelConfig
from plexrl.job.tasks import SPECIALS, Task
from plexrl.job.tasks.arithmetic import ALPHABET, verify_answers

log = logging.getLogger(__name__)


RUNTIME_FIELDS = ("dtype", "gradient_checkpointing")  # how an engine runs the model, not what is built


def engine_options(cfg: ModelConfig) -> dict[str, Any]:
    """The `TorchEngine` keyword arguments a job's model config sets (`dtype`, `gradient_checkpointing`)."""
    return {name: getattr(cfg, name) for name in RUNTIME_FIELDS}


class PreparationCancelled(Exception):
    """A job's preparation (warm start, model build) stopped because its `cancel` event was set: the job was
    cancelled, or the server is stopping. Not a failure: the server records the cancel (or keeps the job
    queued for its next start)."""


def check_cancelled(cancel: threading.Event | None, what: str) -> None:
    """Raise `PreparationCancelled` (naming `what` was under way) if `cancel` is set."""
    if cancel is not None and cancel.is_set():
        raise PreparationCancelled(f"cancelled during {what}")


@contextmanager
def _cache_lock(root: Path, cancel: threading.Event | None) -> Iterator[None]:
    """One preparation of the cache directory `root` at a time, across threads and processes; waiting checks
    `cancel` (plexrl/cache_files.py)."""
    with key_lock(root, poll=lambda: check_cancelled(cancel, f"the wait for another preparation of {root}")):
        yield


def build_tokenizer(out_dir: Path, alphabet: str = ALPHABET, extra_specials: tuple[str, ...] = ()) -> Any:
    """Train a character-level tokenizer on `alphabet` with the `tokenizers` library and save it.

    `extra_specials` (e.g. the tool-call tags) become special tokens with ids right after pad, bos, eos:
    one token each, dropped by `decode(..., skip_special_tokens=True)`. Characters outside the alphabet are
    dropped when encoding."""
    with model_construction():  # (see `prepare_model`)
        from tokenizers import Tokenizer, decoders, models, processors, trainers
        from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIALS) + len(extra_specials) + len(alphabet),
        special_tokens=SPECIALS + list(extra_specials),
        initial_alphabet=list(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator([alphabet], trainer=trainer)
    tok.decoder = decoders.Fuse()
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    extra: dict[str, Any] = {"additional_special_tokens": list(extra_specials)} if extra_specials else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", **extra
    )
    fast.padding_side = "left"
    fast.save_pretrained(str(out_dir))
    return fast


def build_model(cfg: ModelConfig, tokenizer: Any, out_dir: Path, seed: int) -> None:
    """Build a randomly initialised `LlamaForCausalLM` of the configured size and save it (under
    `model_construction()`; the seed is applied to a forked global RNG, so neither another thread's use of
    it nor this build changes what the other sees)."""
    import torch

    with model_construction():  # (see `prepare_model`)
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.max_position,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        dtype="float32",
    )
    with model_construction(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(str(out_dir))


@dataclass(slots=True)
class PreparedModel:
    """Where the job's starting model lives, and what the warm start reached."""

    path: Path
    tokenizer: Any
    warm_start_accuracy: float | None
    warm_start_steps: int
    warm_start_seconds: float
    cached: bool


def cache_key(*parts: Any) -> str:
    blob = json.dumps([p.model_dump() if hasattr(p, "model_dump") else p for p in parts], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def prepare_model(
    model_cfg: ModelConfig,
    task_cfg: TaskConfig,
    warm: WarmStartConfig,
    task: Task | None,
    seed: int,
    run_dir: Path,
    cancel: threading.Event | None = None,
    device: str = "cpu",
) -> PreparedModel:
    """Build (or load from cache) tokenizer, base model and warm-started model; return the model to train.
    An existing model (`model.path`, or `model.pretrained`: converted into the cache on first use,
    plexrl/job/pretrained.py) is used as it is, with its own tokenizer; `task` may then be None.
    `cancel`: see the module docstring (raises `PreparationCancelled`). `device`: where the warm start trains
    (the job's device; its cached result serves every device)."""
    with model_construction():  # transformers' lazy first imports are not thread-safe either
        from transformers import PreTrainedTokenizerFast

    if model_cfg.pretrained is not None:
        from plexrl.job.pretrained import pretrained_path

        path = pretrained_path(model_cfg.pretrained)
        return PreparedModel(path, PreTrainedTokenizerFast.from_pretrained(str(path)), None, 0, 0.0, True)
    if model_cfg.path is not None:
        path = Path(model_cfg.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path {path} has no config.json; point it at a saved HF model directory")
        return PreparedModel(path, PreTrainedTokenizerFast.from_pretrained(str(path)), None, 0, 0.0, True)
    if task is None:
        raise ValueError("building a model needs its task's alphabet; give model.path or model.pretrained")
    built = model_cfg.model_dump(exclude=set(RUNTIME_FIELDS))  # what the built weights depend on
    root = run_dir / "cache" / cache_key(built, task_cfg, warm, seed)
    final = root / ("warm" if warm.enabled else "base")
    info_file = final / "plexrl_warm_start.json"
    with _cache_lock(root.resolve(), cancel):
        if info_file.is_file():
            info = json.loads(info_file.read_text())
            tok = PreTrainedTokenizerFast.from_pretrained(str(final))
            return PreparedModel(final, tok, info["accuracy"], info["steps"], info["seconds"], True)
        check_cancelled(cancel, "the model build")
        start = time.perf_counter()
        base = root / "base"
        base.mkdir(parents=True, exist_ok=True)
        tok = build_tokenizer(base, task.alphabet, task.special_tokens)
        build_model(model_cfg, tok, base, seed)
        acc, steps = None, 0
        if warm.enabled:
            final.mkdir(parents=True, exist_ok=True)
            acc, steps = warm_start(base, final, tok, task, warm, seed, model_cfg, cancel, device)
            if device.startswith("cuda"):  # its blocks go back before the services measure the GPU
                import torch

                torch.cuda.empty_cache()
            tok.save_pretrained(str(final))
        seconds = time.perf_counter() - start
        info = json.dumps({"accuracy": acc, "steps": steps, "seconds": seconds})
        write_atomic(info_file, lambda tmp: tmp.write_text(info))  # last, whole: the entry is complete
    return PreparedModel(final, tok, acc, steps, seconds, False)


def greedy_accuracy(
    engine: Any,
    tokenizer: Any,
    problems: list[Any],
    max_new_tokens: int,
    verify: Callable[[list[str], list[str]], list[float | None]] = verify_answers,
) -> tuple[float, float]:
    """Held-out greedy accuracy and mean response length of `engine`'s policy on `problems`, scored by
    `verify` (the task's verifier; exact match by default)."""
    from plexrl.data.prompts import prompt_token_ids

    prompts = [prompt_token_ids(p, tokenizer) for p in problems]
    out = engine.generate(prompts, n=1, temperature=1.0, max_new_tokens=max_new_tokens, seed=0, greedy=True)
    texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    scores = verify(texts, [p.answer for p in problems])
    return sum(s or 0.0 for s in scores) / len(scores), float(out.lengths.float().mean())


def held_out_accuracy(engine: Any, tokenizer: Any, task: Task, problems: list[Any]) -> float:
    """Greedy accuracy on `problems`: direct answers, or (a task with a tool) tool-calling episodes of up to
    two turns with the task's tool."""
    if task.tool is None:
        acc, _ = greedy_accuracy(engine, tokenizer, problems, task.max_answer_chars + 1, task.verify)
        return acc
    from plexrl.episodes import greedy_episodes
    from plexrl.tools import get_tool

    turn = getattr(task, "max_turn_tokens", task.max_answer_chars + 1)
    acc, _, _ = greedy_episodes(
        engine,
        tokenizer,
        get_tool(task.tool),
        problems,
        max_turns=2,
        max_new_tokens=turn,
        token_budget=3 * turn,
        max_output_tokens=turn,
        verify=task.verify,
        prefix="warm-start",
    )
    return acc


def demonstration_ids(task: Task, tokenizer: Any, problem: Any, use_tool: bool) -> tuple[list[int], list[bool]]:
    """Token ids of the task's demonstration after the prompt, eos appended, and for each token whether the
    model wrote it (trained on) or a tool did (not trained on)."""
    ids: list[int] = []
    trained: list[bool] = []
    for text, by_model in task.demonstration(problem, use_tool):
        part = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += part
        trained += [by_model] * len(part)
    return [*ids, tokenizer.eos_token_id], [*trained, True]


def warm_start_lr(cfg: WarmStartConfig, step: int, decay_from: int | None = None) -> float:
    """The warm start's learning rate at optimizer step `step` (1-based): linear warm-up over
    `cfg.warmup_steps`, then cosine decay over `cfg.decay_steps` to `cfg.lr * cfg.min_lr_ratio`, held after.
    With `cfg.decay_from_accuracy`, the peak holds until `decay_from` (the step whose check reached it; None:
    not yet) and the decay starts there.

    >>> from plexrl.job.config import WarmStartConfig
    >>> c = WarmStartConfig(lr=1e-3, warmup_steps=10, decay_steps=100, min_lr_ratio=0.1)
    >>> [round(warm_start_lr(c, s) * 1e4, 3) for s in (1, 10, 60, 110, 500)]
    [1.0, 10.0, 5.5, 1.0, 1.0]
    """
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.decay_steps == 0:
        return cfg.lr
    start = cfg.warmup_steps
    if cfg.decay_from_accuracy is not None:
        if decay_from is None:
            return cfg.lr
        start = max(start, decay_from)
    done = min(1.0, (step - start) / cfg.decay_steps)
    low = cfg.lr * cfg.min_lr_ratio
    return low + 0.5 * (cfg.lr - low) * (1.0 + math.cos(math.pi * done))


def warm_start(
    base: Path,
    out: Path,
    tokenizer: Any,
    task: Task,
    cfg: WarmStartConfig,
    seed: int,
    model_cfg: ModelConfig,
    cancel: threading.Event | None = None,
    device: str = "cpu",
) -> tuple[float, int]:
    """Supervised fine-tuning on the train split until held-out greedy accuracy reaches
    `cfg.stop_at_accuracy` or `cfg.max_steps`; saves the model to `out`. The targets are the task's
    demonstrations (a `task.tool_demo_frac` share of them tool calls), cross-entropy on model-written tokens
    only: tool output is context, never a label. `cancel` is checked before every step: once set, raises
    `PreparationCancelled` and saves nothing. It trains in fp32 on `device`."""
    import torch

    from plexrl.engines.torch_engine import OPTIMIZER_FILE, TorchEngine, positions

    with model_construction():
        engine = TorchEngine(
            base, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, attention=model_cfg.attention,
            device=device,
        )  # fmt: skip
    model = engine.policy
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, cfg.adam_beta2), weight_decay=0.0)
    rng = random.Random(seed)
    tool_rng = random.Random(f"{seed}/tool-demos")  # apart from `rng`: the problems drawn do not depend on it
    checks = task.held_out[: cfg.eval_size]
    acc, step = 0.0, 0
    decay_from: int | None = None  # the step whose check reached cfg.decay_from_accuracy
    for step in range(1, cfg.max_steps + 1):
        check_cancelled(cancel, f"the warm start (step {step} of at most {cfg.max_steps})")
        for group in opt.param_groups:
            group["lr"] = warm_start_lr(cfg, step, decay_from)
        batch: list[Any] = rng.sample(task.train, cfg.batch_size)
        p_ids = [tokenizer(p.prompt)["input_ids"] for p in batch]
        demos = [
            demonstration_ids(task, tokenizer, p, task.tool_demo_frac > 0 and tool_rng.random() < task.tool_demo_frac)
            for p in batch
        ]
        L = max(len(p) + len(a) for p, (a, _) in zip(p_ids, demos, strict=True))
        ids = torch.full((len(batch), L), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), L), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (p, (a, trained)) in enumerate(zip(p_ids, demos, strict=True)):
            off = L - len(p) - len(a)
            ids[i, off:] = torch.tensor(p + a)
            labels[i, off + len(p) :] = torch.tensor([t if keep else -100 for t, keep in zip(a, trained, strict=True)])
            mask[i, off:] = 1
        model.train()
        ids, labels, mask = ids.to(engine.device), labels.to(engine.device), mask.to(engine.device)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        model.eval()
        if step % cfg.eval_every == 0:
            acc = held_out_accuracy(engine, tokenizer, task, checks)
            log.info("warm start step %d loss %.3f held-out accuracy %.3f", step, loss.item(), acc)
            if acc >= cfg.stop_at_accuracy:
                break
            if decay_from is None and cfg.decay_from_accuracy is not None and acc >= cfg.decay_from_accuracy:
                decay_from = step
    model.save_pretrained(str(out))
    if cfg.keep_optimizer:
        torch.save(opt.state_dict(), out / OPTIMIZER_FILE)  # loaded back onto whatever device trains it
    return acc, step
