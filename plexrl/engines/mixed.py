"""Several LoRA jobs' generations over ONE shared base in one decode loop (`generate_mixed`): every forward
pass of the loop carries the rows of every call, each row under its own job's adapter (in a fixed number of ops
per LoRA layer, `stacked_lora.stacked`; else peft's mixed-adapter forward, `adapter_names`), the base's matmuls
once for all of them. What the torch engine does for several sessions' samples queued together on one service
(`plexrl/sessions/sampling.py`); `vllm_lora.generate_together` is the same on a shared vLLM engine.

Each call keeps what it has alone (`TorchEngine.generate`, plexrl/engines/decoding.py): its own seeded
`torch.Generator`, drawing once per step for ALL its rows (a finished row samples from a one-hot at pad), its
own temperature, top_k, top_p, stop tokens and strings and `max_new_tokens`, and it finishes at the step where it
would finish alone (its draws stop there). So a call's tokens are the ones it samples alone; its log-probs equal
them up to the float noise of another batch composition and left padding (the same forward, other shapes).

The joint batch drops finished rows (of any call) as a single generation does, once they are a quarter of it.
What it does NOT do: pause between decode steps (no slices), or mix several full fine-tuned models (one base, or
one full model's own calls).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from plexrl.engines.base import GenerationOutput
from plexrl.engines.stacked_lora import stacked
from plexrl.engines.steps import cache_kw, nucleus, positions, top_k_only


@dataclass(slots=True)
class _Call:
    """One call's rows [start, stop) of the joint batch and its sampling state (as `decoding.Decoding`)."""

    engine: Any
    start: int
    stop: int
    width: int  # its own longest prompt (its output's prompt columns)
    generator: torch.Generator
    stops: Tensor
    temperature: float
    greedy: bool
    top_p: float
    top_k: int
    strings: tuple[str, ...]
    max_new_tokens: int
    done: Tensor
    tokens: list[Tensor] = field(default_factory=list)
    logprobs: list[Tensor] = field(default_factory=list)
    alive: list[Tensor] = field(default_factory=list)
    steps: int = 0
    finished: bool = False


def _start(engine: Any, start: int, prompts: list[list[int]], kw: dict[str, Any]) -> _Call:
    n = int(kw["n"])
    if n < 1 or not prompts:
        raise ValueError("each call of a mixed generation needs at least one prompt and n >= 1")
    device = engine.device
    stops = [engine.eos_id, *engine.extra_eos, *kw.get("stop_token_ids", ())]
    return _Call(
        engine, start, start + n * len(prompts), max(len(p) for p in prompts),
        torch.Generator(device=device).manual_seed(int(kw["seed"])), torch.tensor(stops, device=device),
        float(kw["temperature"]), bool(kw.get("greedy", False)), float(kw.get("top_p", 1.0)),
        int(kw.get("top_k", 0)), tuple(kw.get("stop", ())), int(kw["max_new_tokens"]),
        torch.zeros(n * len(prompts), dtype=torch.bool, device=device),
    )  # fmt: skip


def generate_mixed(
    engines: Sequence[Any], calls: Sequence[tuple[list[list[int]], dict[str, Any]]]
) -> list[GenerationOutput]:
    """`calls[i]` = (prompts, `generate` keywords) of `engines[i]`, LoRA engines (`LoRAEngine`) of ONE shared
    base, or one full model's engine (`TorchEngine`) for every call (a full fine-tuning session's calls sent at
    once), generated in one decode loop; one `GenerationOutput` per call, what `engines[i].generate` gives
    alone (see the module docstring)."""
    if not engines or len(engines) != len(calls):
        raise ValueError("generate_mixed takes one call per engine")
    first = engines[0]
    shared = getattr(first, "shared", None)
    if shared is None and any(e is not first for e in engines):
        raise ValueError("engines generate in one call only over one shared base, or as one full model's calls")
    if shared is not None and any(getattr(e, "shared", None) is not shared for e in engines):
        raise ValueError("engines generate in one call only over one shared base")
    model = shared.model if shared is not None else first.policy
    device, pad = first.device, first.pad_id
    rows: list[list[int]] = []
    names: list[str] = []  # the adapter of each row
    states: list[_Call] = []
    for e, (prompts, kw) in zip(engines, calls, strict=True):
        states.append(_start(e, len(rows), prompts, kw))
        for p in prompts:
            for _ in range(int(kw["n"])):
                rows.append(p)
                names.append(getattr(e, "adapter", ""))
    N, Lp = len(rows), max(len(p) for p in rows)
    ids = torch.full((N, Lp), pad, dtype=torch.long)
    pmask = torch.zeros((N, Lp), dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, Lp - len(p) :] = torch.tensor(p)
        pmask[i, Lp - len(p) :] = 1
    ids, pmask = ids.to(device), pmask.to(device)
    kw_cache = cache_kw(model)
    model.eval()
    adapters = list(dict.fromkeys(names))
    full = shared is None  # one full model's calls: no adapters
    with torch.no_grad(), contextlib.nullcontext() if full else stacked(model, adapters) as select:

        def forward(live: list[int], **kw: Any) -> Any:
            """The model on the rows `live`, each under its own adapter (`stacked_lora`, else peft's)."""
            if full:
                return model(**kw)
            if select is None:
                return model(**kw, adapter_names=[names[r] for r in live])
            select([adapters.index(names[r]) for r in live])
            return model(**kw)

        pos = positions(pmask)
        out = forward(list(range(N)), input_ids=ids, attention_mask=pmask, position_ids=pos, use_cache=True,
                      logits_to_keep=1)  # fmt: skip
        past, logits = getattr(out, kw_cache), out.logits[:, -1]
        live_rows = list(range(N))  # the rows still in the batch, ascending
        mask, next_pos = pmask, pos[:, -1:] + 1
        while True:
            tok = torch.full((N,), pad, dtype=torch.long, device=device)
            done = torch.ones(N, dtype=torch.bool, device=device)
            for c in states:
                if not c.finished:
                    tok[c.start : c.stop] = _step(c, logits, live_rows, pad)
                    done[c.start : c.stop] = c.done if not c.finished else True
            if all(c.finished for c in states):
                break
            batch = torch.tensor(live_rows, device=device)
            finished = done[batch]
            n_finished = int(finished.sum())
            if n_finished >= max(1, len(live_rows) // 4):  # drop finished rows from the batch
                keep = (~finished).nonzero().squeeze(-1)
                past.batch_select_indices(keep)
                live_rows = [live_rows[i] for i in keep.tolist()]
                mask, next_pos = mask[keep], next_pos[keep]
                batch = torch.tensor(live_rows, device=device)
            step_tok = tok[batch]
            mask = torch.cat([mask, torch.ones_like(step_tok[:, None])], 1)
            out = forward(live_rows, input_ids=step_tok[:, None], attention_mask=mask, position_ids=next_pos,
                          use_cache=True, **{kw_cache: past})  # fmt: skip
            past, logits = getattr(out, kw_cache), out.logits[:, -1]
            next_pos = next_pos + 1
    return [_output(c, ids, pmask) for c in states]


def _step(c: _Call, logits: Tensor, live_rows: list[int], pad: int) -> Tensor:
    """One decode step of call `c` (as `decoding.advance`): its rows' next tokens [n]; `logits` [M, V] of the
    batch's rows `live_rows`. Marks it finished at the step it would finish alone."""
    n = c.stop - c.start
    mine = [i for i, r in enumerate(live_rows) if c.start <= r < c.stop]
    logp = F.log_softmax(logits[mine].float() / (1.0 if c.greedy else c.temperature), dim=-1)
    if 0 < c.top_k < logp.shape[-1] and not c.greedy:
        logp = top_k_only(logp, c.top_k)
    if c.top_p < 1.0 and not c.greedy:
        logp = nucleus(logp, c.top_p)
    if len(mine) < n:  # rows dropped: they sample from a one-hot at pad, so the draws stay per row
        full = torch.full((n, logp.shape[-1]), float("-inf"), device=logp.device)
        full[:, pad] = 0.0
        full[torch.tensor([live_rows[i] - c.start for i in mine], dtype=torch.long, device=logp.device)] = logp
        logp = full
    tok = logp.argmax(-1) if c.greedy else torch.multinomial(logp.exp(), 1, generator=c.generator).squeeze(-1)
    lp = logp.gather(-1, tok[:, None]).squeeze(-1)
    live = ~c.done
    tok = torch.where(live, tok, torch.full_like(tok, pad))
    c.tokens.append(tok)
    c.logprobs.append(torch.where(live, lp, torch.zeros_like(lp)))
    c.alive.append(live)
    c.done = c.done | torch.isin(tok, c.stops)
    if c.strings:
        c.done = c.done | c.engine._stopped(torch.stack(c.tokens, 1), c.done, c.strings)
    c.steps += 1
    c.finished = c.steps >= c.max_new_tokens or bool(c.done.all())
    return tok


def _output(c: _Call, ids: Tensor, pmask: Tensor) -> GenerationOutput:
    resp = torch.stack(c.tokens, 1)
    rmask = torch.stack(c.alive, 1).long()
    finish = ["stop" if bool(d) else "length" for d in c.done.tolist()]
    width = ids.shape[1]
    return GenerationOutput(
        ids[c.start : c.stop, width - c.width :], pmask[c.start : c.stop, width - c.width :], resp, rmask,
        torch.stack(c.logprobs, 1), rmask.sum(1), finish,
    )  # fmt: skip


__all__ = ["generate_mixed"]
