"""Generation-side service operators: `rollout` samples responses, `logprob` scores them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from plexrl.batch import LogProbs, Prompts, Rollouts
from plexrl.operator import OpContext, operator


@operator(runs_on="service", chunk_input="prompts", sliceable=True)
def rollout(
    prompts: Prompts,
    ctx: OpContext,
    *,
    n: Annotated[int, Field(ge=1, le=1024)] = 8,
    temperature: Annotated[float, Field(gt=0, le=10)] = 1.0,
    max_new_tokens: Annotated[int, Field(ge=1, le=32768)] = 8,
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0,
    stop: list[str] = [],  # noqa: B006 (validated by pydantic, which copies defaults)
) -> Rollouts:
    """Sample `n` responses per prompt with the job's current policy (nucleus `top_p`; a response also ends
    once it contains one of the `stop` strings); records token ids, masks, behaviour log-probs (temperature and
    top-p applied), lengths, finish reasons and the weight version that sampled. Rows: [P*n], grouped by
    prompt. Runs on the job's generation engine (vLLM or torch, `engine:` in the job config). No prompts: an
    empty rollout (0 rows), without calling the engine. Chunkable (`chunks: {rollout: C}` in the job config):
    chunk k samples the groups of prompts `chunk_rows(P, k, C)` with its own seed; the node's output is the
    concatenation of the C chunks (`Rollouts.concat`). Sliceable (`slices: {rollout: K}`: decode-step
    preemption, `plexrl/engines/slicing.py`): the generation runs K decode steps per slice and pauses on the
    service in between; the last slice returns the rollout, with `token_versions` (the weight version of each
    token's slice)."""
    engine = ctx.engine
    version = engine.weight_version
    if len(prompts) == 0:  # e.g. a refill attempt whose pool is full (operators/sampling.py): no engine call
        return _empty(n, temperature, version)
    kwargs = _generate_kwargs(ctx, n, temperature, max_new_tokens, top_p, stop)
    versions = None
    if ctx.slice is None:
        gen = engine.generate(prompts.token_ids, **kwargs)
    else:  # one slice of decode steps; raises SlicePaused until the last one (the service keeps the generation)
        import torch

        from plexrl.engines.slicing import generate_slice, token_versions

        gen = generate_slice(engine, ctx.slice, prompts.token_ids, **kwargs)
        version = min(ctx.slice.versions)  # the oldest weights that sampled a token (on-policy: all the same)
        off_response = torch.full_like(gen.prompt_ids.cpu(), -1)
        versions = torch.cat([off_response, token_versions(ctx.slice, gen.response_mask)], 1)
    return _rollouts(gen, prompts, ctx, n, temperature, version, versions)


def _generate_kwargs(
    ctx: OpContext, n: int, temperature: float, max_new_tokens: int, top_p: float, stop: list[str]
) -> dict[str, Any]:
    return dict(n=n, temperature=temperature, max_new_tokens=max_new_tokens, seed=ctx.seed("rollout"), top_p=top_p,
                stop=stop)  # fmt: skip


def _empty(n: int, temperature: float, version: int) -> Rollouts:
    import torch

    empty = torch.zeros(0, 0, dtype=torch.long)
    return Rollouts(
        input_ids=empty, attention_mask=empty, response_mask=empty.float(), behaviour_logprobs=empty.float(),
        prompt_len=0, response_lengths=torch.zeros(0, dtype=torch.long), finish_reasons=[], completions=[],
        answers=[], group_size=n, temperature=temperature, weight_version=version,
    )  # fmt: skip


def _rollouts(
    gen: Any, prompts: Prompts, ctx: OpContext, n: int, temperature: float, version: int, versions: Any = None
) -> Rollouts:
    import torch

    lp = gen.prompt_ids.shape[1]
    input_ids = torch.cat([gen.prompt_ids, gen.response_ids], 1).cpu()
    attention = torch.cat([gen.prompt_mask, gen.response_mask], 1).cpu()
    response_mask = torch.cat([torch.zeros_like(gen.prompt_mask), gen.response_mask], 1).float().cpu()
    behaviour = torch.cat([torch.zeros_like(gen.prompt_mask, dtype=torch.float32), gen.logprobs.float()], 1).cpu()
    return Rollouts(
        input_ids=input_ids,
        attention_mask=attention,
        response_mask=response_mask,
        behaviour_logprobs=behaviour,
        prompt_len=lp,
        response_lengths=gen.lengths.cpu(),
        finish_reasons=gen.finish_reasons,
        completions=ctx.tokenizer.batch_decode(gen.response_ids, skip_special_tokens=True),
        answers=[a for a in prompts.answers for _ in range(n)],
        group_size=n,
        temperature=temperature,
        weight_version=version,
        positions=[r for r in prompts.positions for _ in range(n)],
        token_versions=versions,
    )


def rollout_together(
    ctxs: Sequence[OpContext], inputs: Sequence[dict[str, Any]], params: Sequence[BaseModel]
) -> list[Rollouts]:
    """The batched form of `rollout` (co-scheduled rollouts, `plexrl/planner/batches.py`): several jobs'
    rollouts, each with its own prompts, parameters and seed, in ONE call of their shared engine
    (`vllm_lora.generate_together`: a LoRA request per job). Each job's rollout is what `rollout` alone would
    sample (on CPU tokens equal, log-probs equal up to the engine's batch-composition noise; on CUDA the same
    distribution, since vLLM's kernels reduce in a batch-dependent order unless `deterministic: true`). Runs
    whole: never chunked or sliced. Jobs with no prompts get an empty rollout and no share of the call."""
    from plexrl.engines.vllm_lora import generate_together

    engines, calls, versions, called = [], [], [], []
    out: list[Rollouts | None] = []
    for ctx, ins, p in zip(ctxs, inputs, params, strict=True):
        kw = p.model_dump()
        version = ctx.engine.weight_version
        if len(ins["prompts"]) == 0:
            out.append(_empty(kw["n"], kw["temperature"], version))
            continue
        out.append(None)
        engines.append(ctx.engine)
        calls.append((ins["prompts"].token_ids, _generate_kwargs(ctx, **kw)))
        versions.append(version)
        called.append(len(out) - 1)
    gens = generate_together(engines, calls) if engines else []
    for i, gen, version in zip(called, gens, versions, strict=True):
        kw = params[i].model_dump()
        out[i] = _rollouts(gen, inputs[i]["prompts"], ctxs[i], kw["n"], kw["temperature"], version)
    return [r for r in out if r is not None]


rollout.batched = rollout_together  # type: ignore[attr-defined]  # (`Operator.batched`: services/batched.py)


@operator(runs_on="service")
def logprob(rollouts: Rollouts, ctx: OpContext, *, which: Literal["reference", "policy"] = "reference") -> LogProbs:
    """Per-token log-probs [N, L] of the rollout under the reference or the current policy (the
    rollout's temperature applied, as in the behaviour log-probs)."""
    values = ctx.engine.logprobs(
        rollouts.input_ids, rollouts.attention_mask, temperature=rollouts.temperature, which=which
    )
    return LogProbs(values=values * rollouts.response_mask, which=which)
