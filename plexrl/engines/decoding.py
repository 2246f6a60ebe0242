"""The torch engine's decode loop as a state that can stop between two decode steps and resume later.

`begin(engine, prompts, ...)` runs the prompts' prefill and returns a `Decoding`; `advance(engine, d,
max_steps)` runs at most `max_steps` decode steps (None: to the end) and returns; `d.output()` is the
`GenerationOutput` once `d.finished`. `TorchEngine.generate` is exactly begin + advance(None) + output, so a
generation paused any number of times (and other generations run on the same engine meanwhile) runs the same
computation as one that never paused: on CPU the same tokens with the same log-probs (bit for bit); on CUDA the
same distribution (its kernels are free to reduce in another order from one run to the next unless
`deterministic: true`, docs/gpu.md), because:

- each `Decoding` owns its `torch.Generator`, seeded once, and every step draws from it for ALL N rows
  (rows already finished sample from a one-hot at pad), so the random stream never depends on when rows
  finished or when the generation paused;
- finished rows are dropped from the batch (their KV cache rows, mask and positions) once they are at least
  a quarter of the rows still in it: at the same steps whether or not the generation paused, so the forward
  passes are the same too. Rows still running keep their KV cache across a pause.

What it does NOT do: move a paused generation's KV cache off the device (it stays where the engine is: the
planner keeps a job with a paused generation resident), or decide when to pause (the caller's `max_steps`: a
job's `slices`, through `plexrl/engines/slicing.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from plexrl.engines.base import GenerationOutput


@dataclass(slots=True)
class Decoding:
    """A generation between two decode steps. N rows in all (`done` [N]); the batch holds the M rows of
    `rows` [M] (ascending row numbers), whose KV cache `past`, attention `mask` [M, Lp + t], next positions
    `next_pos` [M, 1] and next-token `logits` [M, V] are kept. `tokens`, `logprobs`, `alive`: one [N] tensor
    per step taken (`steps`)."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    rows: Tensor
    past: Any
    mask: Tensor
    next_pos: Tensor
    logits: Tensor
    done: Tensor
    generator: torch.Generator
    stops: Tensor
    temperature: float
    greedy: bool
    top_p: float
    stop: tuple[str, ...]
    max_new_tokens: int
    top_k: int = 0  # sample among the k likeliest tokens only (0: all)
    tokens: list[Tensor] = field(default_factory=list)
    logprobs: list[Tensor] = field(default_factory=list)
    alive: list[Tensor] = field(default_factory=list)
    steps: int = 0
    finished: bool = False

    def output(self) -> GenerationOutput:
        """The generation's result (see `GenerationOutput`); only once `finished`."""
        if not self.finished:
            raise RuntimeError(f"the generation is paused after {self.steps} steps; advance it to the end first")
        resp = torch.stack(self.tokens, 1)
        rmask = torch.stack(self.alive, 1).long()
        finish = ["stop" if bool(d) else "length" for d in self.done.tolist()]
        return GenerationOutput(
            self.prompt_ids, self.prompt_mask, resp, rmask, torch.stack(self.logprobs, 1), rmask.sum(1), finish
        )


def begin(
    engine: Any,
    prompts: list[list[int]],
    *,
    n: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    greedy: bool = False,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    top_p: float = 1.0,
    top_k: int = 0,
) -> Decoding:
    """Left-pad the `n` copies of each prompt, run the prefill on `engine.policy` and return the generation
    before its first decode step (arguments as `Engine.generate`)."""
    from plexrl.engines.steps import cache_kw as _cache_kw
    from plexrl.engines.steps import positions

    rows = [p for p in prompts for _ in range(n)]
    N, Lp = len(rows), max(len(p) for p in prompts)
    ids = torch.full((N, Lp), engine.pad_id, dtype=torch.long)
    pmask = torch.zeros((N, Lp), dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, Lp - len(p) :] = torch.tensor(p)
        pmask[i, Lp - len(p) :] = 1
    ids, pmask = ids.to(engine.device), pmask.to(engine.device)
    pos = positions(pmask)
    with torch.no_grad():
        out = engine.policy(input_ids=ids, attention_mask=pmask, position_ids=pos, use_cache=True, logits_to_keep=1)
    return Decoding(
        prompt_ids=ids, prompt_mask=pmask, rows=torch.arange(N, device=engine.device),
        past=getattr(out, _cache_kw(engine.policy)), mask=pmask, next_pos=pos[:, -1:] + 1, logits=out.logits[:, -1],
        done=torch.zeros(N, dtype=torch.bool, device=engine.device),
        generator=torch.Generator(device=engine.device).manual_seed(seed),
        stops=torch.tensor([engine.eos_id, *engine.extra_eos, *stop_token_ids], device=engine.device),
        temperature=temperature, greedy=greedy, top_p=top_p, stop=tuple(stop), max_new_tokens=max_new_tokens,
        top_k=top_k,
    )  # fmt: skip


def _counts(done: Tensor, finished: Tensor) -> tuple[int, int]:
    """(1 if every row is done else 0, finished rows still in the batch), read in ONE transfer."""
    both: list[int] = torch.stack([done.all().long(), finished.sum()]).tolist()
    return both[0], both[1]


@torch.no_grad()
def advance(engine: Any, d: Decoding, max_steps: int | None = None) -> Decoding:
    """Run at most `max_steps` decode steps of `d` (None: until it is finished) on `engine`; returns `d`."""
    from plexrl.engines.steps import cache_kw as _cache_kw
    from plexrl.engines.steps import nucleus, top_k_only

    kw = _cache_kw(engine.policy)
    taken = 0
    while not d.finished and (max_steps is None or taken < max_steps):
        logp = F.log_softmax(d.logits.float() / (1.0 if d.greedy else d.temperature), dim=-1)
        if 0 < d.top_k < logp.shape[-1] and not d.greedy:
            logp = top_k_only(logp, d.top_k)
        if d.top_p < 1.0 and not d.greedy:
            logp = nucleus(logp, d.top_p)
        N = d.done.shape[0]
        if len(d.rows) < N:  # rows dropped: they sample from a one-hot at pad, so the draws stay per row
            full = torch.full((N, logp.shape[-1]), float("-inf"), device=logp.device)
            full[:, engine.pad_id] = 0.0
            full[d.rows] = logp
            logp = full
        tok = logp.argmax(-1) if d.greedy else torch.multinomial(logp.exp(), 1, generator=d.generator).squeeze(-1)
        lp = logp.gather(-1, tok[:, None]).squeeze(-1)
        live = ~d.done
        tok = torch.where(live, tok, torch.full_like(tok, engine.pad_id))
        d.tokens.append(tok)
        d.logprobs.append(torch.where(live, lp, torch.zeros_like(lp)))
        d.alive.append(live)
        d.done = d.done | torch.isin(tok, d.stops)
        if d.stop:
            d.done = d.done | engine._stopped(torch.stack(d.tokens, 1), d.done, d.stop)
        d.steps += 1
        taken += 1
        finished = d.done[d.rows]
        # one host sync per step for both questions (on CUDA each `.item()` waits for the step's kernels)
        all_done, n_finished = (0, 0) if d.steps >= d.max_new_tokens else _counts(d.done, finished)
        if all_done or d.steps >= d.max_new_tokens:
            d.finished, d.past = True, None  # the KV cache is freed with the last step
            break
        if n_finished >= max(1, len(d.rows) // 4):  # drop finished rows from the batch
            keep = (~finished).nonzero().squeeze(-1)
            d.past.batch_select_indices(keep)
            d.rows, d.mask, d.next_pos = d.rows[keep], d.mask[keep], d.next_pos[keep]
        step_tok = tok[d.rows]
        d.mask = torch.cat([d.mask, torch.ones_like(step_tok[:, None])], 1)
        out = engine.policy(
            input_ids=step_tok[:, None], attention_mask=d.mask, position_ids=d.next_pos, use_cache=True,
            **{kw: d.past},
        )  # fmt: skip
        d.past, d.logits = getattr(out, kw), out.logits[:, -1]
        d.next_pos = d.next_pos + 1
    return d


__all__ = ["Decoding", "advance", "begin"]
