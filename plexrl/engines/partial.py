"""Partial rollouts on vLLM: a generation run as slices of at most K new tokens per row, for decode-step
preemption (`slices: {rollout: K}`, `plexrl/engines/slicing.py`), as APRIL's and verl's partial rollouts do.

`begin(engine, prompts, ...)` records the request; `advance(engine, p, K)` submits every unfinished row as ONE
vLLM request (its prompt followed by the tokens it has generated so far) for at most K more tokens, appends
what comes back (tokens, log-probs) and marks rows that stopped (eos, a stop token or string) or reached
`max_new_tokens`; the rest wait for the next slice. Between two slices the service may run anything else:
another job's generation on the same `SharedLLM` (this job's weights are loaded again before the next slice,
`VLLMEngine.sync`), or a training step. Prefix caching makes a resubmitted row's prefill cheap as long as the
engine still holds this job's weights (a weight load resets the cache). `p.output()` is the
`GenerationOutput` once `p.finished`.

Seeds: slice s of row r samples with `row_seed(seed, r)` moved by s, so a partial rollout depends only on the
job's seed and weights (never on co-tenants or on when it paused). Slice 0 samples with the seed an unsliced
row uses; later slices restart vLLM's stream, so a sampled partial rollout draws from the same distribution
as an unsliced one but not the same tokens (greedy ones are the same). A stop string that spans two slices
is found on the joined text and the row cut where it completes, as one vLLM call would.

The weight version of each token is recorded by the caller per slice (`SliceSlot.versions`): every slice adds
exactly min(K, tokens left) tokens to each row still running, so token t of any row came from slice t // K.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from plexrl.engines.base import GenerationOutput

_SLICE_SEED_STRIDE = 7919  # moves a row's vLLM seed from one slice to the next


@dataclass(slots=True)
class PartialGeneration:
    """A vLLM generation between two slices: N = P*n rows (`rows`: each row's prompt ids), what each has
    generated (`tokens`, `logprobs`) and how it ended (`finish`: "stop", "length", or None while running)."""

    rows: list[list[int]]
    temperature: float
    max_new_tokens: int
    seed: int
    greedy: bool
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]
    top_p: float
    pad_id: int
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    slices: int = 0

    @property
    def finished(self) -> bool:
        return all(f is not None for f in self.finish)

    def output(self) -> GenerationOutput:
        """The generation's result, laid out as `SharedLLM.generate`'s; only once `finished`."""
        import torch

        if not self.finished:
            raise RuntimeError(f"the partial rollout is paused after {self.slices} slices; advance it to the end")
        pad = self.pad_id
        N, longest = len(self.rows), max(len(r) for r in self.rows)
        T = max(1, *(len(t) for t in self.tokens))
        ids = torch.full((N, longest), pad, dtype=torch.long)
        pmask = torch.zeros((N, longest), dtype=torch.long)
        resp = torch.full((N, T), pad, dtype=torch.long)
        rmask = torch.zeros((N, T), dtype=torch.long)
        lps = torch.zeros((N, T), dtype=torch.float32)
        for i, (p, toks) in enumerate(zip(self.rows, self.tokens, strict=True)):
            ids[i, longest - len(p) :] = torch.tensor(p)
            pmask[i, longest - len(p) :] = 1
            if toks:
                resp[i, : len(toks)] = torch.tensor(toks)
                rmask[i, : len(toks)] = 1
                lps[i, : len(toks)] = torch.tensor(self.logprobs[i])
        return GenerationOutput(ids, pmask, resp, rmask, lps, rmask.sum(1), [f or "length" for f in self.finish])


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
) -> PartialGeneration:
    """A partial rollout of `n` samples per prompt on `engine` (a `VLLMEngine`), before its first slice
    (arguments as `Engine.generate`)."""
    llm = engine.llm
    rows = [list(p) for p in prompts for _ in range(n)]
    longest = max(len(r) for r in rows)
    if longest + max_new_tokens > llm.max_model_len:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"{llm.max_model_len} positions; raise model.max_position or shorten the generation"
        )
    return PartialGeneration(
        rows, temperature, max_new_tokens, seed, greedy, tuple(stop_token_ids), tuple(stop), top_p, llm.pad_id,
        tokens=[[] for _ in rows], logprobs=[[] for _ in rows], finish=[None] * len(rows),
    )  # fmt: skip


def advance(engine: Any, p: PartialGeneration, max_steps: int | None = None) -> PartialGeneration:
    """One slice: every unfinished row of `p` gets at most `max_steps` more tokens (None: to the end), in one
    vLLM call with this job's weights loaded. Returns `p`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from plexrl.engines.steps import row_seed

    live = [i for i, f in enumerate(p.finish) if f is None]
    if not live:
        return p
    llm = engine.llm
    engine.sync()  # another job's weights may have been loaded since the last slice
    params = [
        SamplingParams(
            n=1,
            temperature=0.0 if p.greedy else p.temperature,
            top_p=1.0 if p.greedy else p.top_p,
            max_tokens=min(max_steps or p.max_new_tokens, p.max_new_tokens - len(p.tokens[i])),
            logprobs=0,
            seed=(row_seed(p.seed, i) + _SLICE_SEED_STRIDE * p.slices) % (2**31 - 1),
            stop_token_ids=[*llm.eos_ids, *p.stop_token_ids],
            stop=list(p.stop) or None,
            include_stop_str_in_output=True,
            detokenize=bool(p.stop),
        )
        for i in live
    ]
    requests = [TokensPrompt(prompt_token_ids=p.rows[i] + p.tokens[i]) for i in live]
    try:
        with llm._lock:  # (the SharedLLM's: one call at a time)
            # a LoRA job's rows under its own adapter (`VLLMLoRAEngine.lora_request`; None: the engine's weights)
            outs = llm.llm.generate(
                requests, params, use_tqdm=False, lora_request=getattr(engine, "lora_request", None)
            )
    except Exception as exc:
        llm.broken = True  # the service rebuilds it for the other jobs
        raise RuntimeError(f"vLLM engine failed: {type(exc).__name__}: {exc}") from exc
    p.slices += 1
    for i, out in zip(live, outs, strict=True):
        c = out.outputs[0]
        toks = list(c.token_ids)
        p.tokens[i] += toks
        p.logprobs[i] += [d[t].logprob for t, d in zip(toks, c.logprobs, strict=True)]
        if c.finish_reason != "length":
            p.finish[i] = "stop"
        elif len(p.tokens[i]) >= p.max_new_tokens:
            p.finish[i] = "length"
    if p.stop:
        _cut_at_stop_strings(llm.llm.get_tokenizer(), p, live)
    return p


def _cut_at_stop_strings(tokenizer: Any, p: PartialGeneration, rows: list[int]) -> None:
    """A stop string can span the end of an earlier slice and this one's tokens, where vLLM (which sees only
    the new text) misses it: cut such a row after the token that completes it and mark it stopped."""

    def hit(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in p.stop)

    for i in rows:
        if p.finish[i] == "stop" or not hit(p.tokens[i]):
            continue
        for k in range(1, len(p.tokens[i]) + 1):
            if hit(p.tokens[i][:k]):
                del p.tokens[i][k:], p.logprobs[i][k:]
                p.finish[i] = "stop"
                break


__all__ = ["PartialGeneration", "advance", "begin"]
