"""A session's `sample` call, alone (`SessionEngine.sample`) or together with other sessions' (`sample_many`).

Sample calls of several LoRA sessions over one base that wait on one service together run as ONE engine call
(the planner's cohorts, `plexrl/planner/batches.py`, with the session's plan marking `sample` batchable,
`plexrl/sessions/spec.py`): on the torch engine one decode loop whose forward passes mix the sessions' adapters
per row (`plexrl/engines/mixed.py`), on a shared vLLM engine one `generate` with a `LoRARequest` per prompt
(`vllm_lora.generate_together`). Each call keeps its own seed and sampling parameters and gets back what it
gets alone: the same tokens, the same log-probs up to the float noise of another batch composition. A call
refused (a user error) or whose snapshot is gone gets its error; the others still run. `call_sessions` in a
reply's metrics is the number of sessions whose samples that engine call served (1: alone).

Prompt log-probs and top-k prompt log-probs are per call (a forward each), as alone.

One session's own sample calls that its client sent at once (of the same weights) run together too: the board
hands them to one node (`plexrl/runtime/calls.py`, `calls.Samples`), whose reply holds one reply per call
(`bundled`); in a cohort they are rows of the same engine call as the other sessions' calls.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from plexrl.sessions.calls import Reply, Sample
from plexrl.sessions.refused import CallRefused, failed_text

if TYPE_CHECKING:
    from plexrl.engines.base import GenerationOutput

SessionEngine = Any  # (`plexrl.sessions.engine.SessionEngine`, which imports this module)

log = logging.getLogger(__name__)

MIXED_SESSIONS = 8  # LoRA sessions whose samples one torch decode loop mixes (`plexrl/engines/mixed.py`)


def batch_limit(lora: bool, generation: str, vllm_limit: int) -> int:
    """How many sessions' sample calls one engine call serves (`JobPlan.batch`): a LoRA session on vLLM, the
    adapters one vLLM step mixes (`vllm_limit`, the job rule's); on torch `MIXED_SESSIONS`; a full fine-tuning
    session none (0: its samples run alone)."""
    if not lora:
        return 0
    return vllm_limit if generation == "vllm" else MIXED_SESSIONS


def check(se: SessionEngine, call: Sample) -> None:
    """Raise `CallRefused` for a prompt or stop tokens outside the vocabulary."""
    vocab = int(se.inner.policy.get_input_embeddings().weight.shape[0])
    if not call.prompt or min(call.prompt) < 0 or max(call.prompt) >= vocab:
        raise CallRefused(f"the prompt must be a non-empty list of token ids in [0, {vocab})")
    if any(t < 0 or t >= vocab for t in call.stop_tokens):
        raise CallRefused(f"stop tokens must be token ids in [0, {vocab})")


def generate_kwargs(call: Sample) -> dict[str, Any]:
    """The `generate` keywords of a call (its one prompt apart)."""
    greedy = call.temperature == 0
    return dict(
        n=call.num_samples, temperature=1.0 if greedy else call.temperature, max_new_tokens=call.max_tokens,
        seed=call.seed, greedy=greedy, stop_token_ids=call.stop_tokens, stop=call.stop_strings, top_p=call.top_p,
        **({"top_k": call.top_k} if call.top_k > 0 else {}),
    )  # fmt: skip


def prompt_scores(se: SessionEngine, call: Sample) -> tuple[np.ndarray | None, dict[str, np.ndarray] | None]:
    """The call's prompt log-probs (NaN where not scored) and top-k prompt log-probs, if it asked for them,
    under the weights in place."""
    import torch

    prompt_lp: np.ndarray | None = None
    if call.prompt_logprobs:
        se._activate()
        ids = torch.tensor([list(call.prompt)])
        lp = se.inner.logprobs(ids, torch.ones_like(ids))[0].float().numpy()
        lp[0] = np.nan
        if call.prompt_logprobs_last_n is not None:
            lp[: len(lp) - call.prompt_logprobs_last_n] = np.nan
        prompt_lp = lp
    topk = se._prompt_topk(call) if call.topk_prompt_logprobs > 0 else None
    return prompt_lp, topk


def reply(out: GenerationOutput, prompt_lp: Any, topk: Any, sessions: int) -> Reply:
    """A sample call's reply from its generation: per sequence its tokens (the stop token included), their
    log-probs and why it ended."""
    sequences = []
    for i in range(out.response_ids.shape[0]):
        n = int(out.response_mask[i].sum())
        sequences.append({
            "tokens": out.response_ids[i, :n].cpu().numpy().astype(np.int64),
            "logprobs": out.logprobs[i, :n].float().cpu().numpy(),
            "stop_reason": "stop" if out.finish_reasons[i] == "stop" else "length",
        })  # fmt: skip
    made = sum(len(s["tokens"]) for s in sequences)
    metrics = {"samples": float(len(sequences)), "sampled_tokens": float(made), "call_sessions": float(sessions)}
    return Reply({"sequences": sequences, "prompt_logprobs": prompt_lp, "topk_prompt_logprobs": topk}, metrics=metrics)


def generate_many(generators: Sequence[Any], calls: Sequence[Sample]) -> list[GenerationOutput]:
    """The calls' generations in ONE engine call where their engines allow it (one session's calls on vLLM, vLLM
    LoRA engines of one shared engine, LoRA sessions of one torch base, or one full fine-tuning session's calls
    on torch), else one after another."""
    from plexrl.engines.vllm_lora import VLLMLoRAEngine, generate_together

    asks = [([list(c.prompt)], generate_kwargs(c)) for c in calls]
    if len(generators) > 1 and all(g is generators[0] for g in generators) and hasattr(generators[0], "generate_calls"):
        return list(generators[0].generate_calls(asks))  # one session's calls on vLLM (full or LoRA): one call
    one_vllm = all(isinstance(g, VLLMLoRAEngine) for g in generators) and len({id(g.llm) for g in generators}) == 1
    if len(generators) > 1 and one_vllm:
        return generate_together(generators, asks, repeats=True)  # (a session's calls sent at once: each its own)
    inner: list[Any] = [getattr(g, "inner", None) for g in generators]
    one_base = all(getattr(e, "shared", None) is not None for e in inner) and len({id(e.shared) for e in inner}) == 1
    one_full = inner[0] is not None and hasattr(inner[0], "policy") and all(e is inner[0] for e in inner)
    if len(generators) > 1 and (one_base or one_full):
        from plexrl.engines.mixed import generate_mixed

        return generate_mixed(inner, asks)
    return [g.generate(p, **kw) for g, (p, kw) in zip(generators, asks, strict=True)]


def bundled(replies: Sequence[Reply]) -> Reply:
    """The reply of one session's sample calls run together (`calls.Samples`): one reply per call, in order
    (`value["replies"]`, as plain data), with their summed counts."""
    import dataclasses

    metrics = {k: float(sum(r.metrics.get(k, 0.0) for r in replies)) for k in ("samples", "sampled_tokens")}
    metrics["call_sessions"] = max((r.metrics.get("call_sessions", 0.0) for r in replies), default=0.0)
    metrics["bundled_calls"] = float(len(replies))
    return Reply({"replies": [dataclasses.asdict(r) for r in replies]}, metrics=metrics)


def sample_many(sessions: Sequence[SessionEngine], generators: Sequence[Any], calls: Sequence[Sample]) -> list[Reply]:
    """The replies of several sessions' sample calls (`generators[i]`: the engine that generates for
    `sessions[i]`), the generations in one engine call (see the module docstring). Never raises for a call's
    own error: it comes back in that call's reply."""
    replies: list[Reply | None] = [None] * len(calls)
    with contextlib.ExitStack() as stack:
        run: list[int] = []
        placed: dict[int, tuple[str | None, str | None]] = {}  # session -> the weights put in place for it
        for i, (se, call) in enumerate(zip(sessions, calls, strict=True)):
            try:
                check(se, call)
                key = (call.weights, call.weights_id)
                if id(se) not in placed:
                    stack.enter_context(se.weights(*key))
                    placed[id(se)] = key
                elif placed[id(se)] != key:  # (`Sample.joins` keeps them apart: never here)
                    raise CallRefused("a session's sample calls of other weights cannot share one engine call")
            except CallRefused as exc:
                replies[i] = Reply(error=str(exc))
                continue
            run.append(i)
        served = {id(sessions[i]) for i in run}
        try:
            outs = generate_many([generators[i] for i in run], [calls[i] for i in run]) if run else []
            for i, out in zip(run, outs, strict=True):
                replies[i] = reply(out, *prompt_scores(sessions[i], calls[i]), sessions=len(served))
        except CallRefused as exc:
            for i in run:
                replies[i] = Reply(error=str(exc))
        except Exception as exc:  # (weights are put back by the stack; the sessions go on)
            log.exception("sample calls of %d sessions failed", len(run))
            for i in run:
                replies[i] = Reply(error=failed_text("sample", exc))
    return [r if r is not None else Reply(error="not run") for r in replies]


__all__ = [
    "MIXED_SESSIONS",
    "batch_limit",
    "bundled",
    "check",
    "generate_kwargs",
    "generate_many",
    "prompt_scores",
    "reply",
    "sample_many",
]
