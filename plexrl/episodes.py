"""Multi-turn tool-calling episodes: the tag format, and the steps that the episode operators
(`operators/tools.py`) and the agentic evaluation run.

Tag format (four special tokens of the tokenizer):

    <bos>PROMPT<call>BODY</call><out>OUTPUT</out> ... ANSWER<eos>

- A model turn ends at eos (the episode is answered), at `</call>` (a tool call), or after the turn's
  `max_new_tokens`. The model writes `<call>BODY</call>`; BODY is passed as the tool's single (first
  required) argument: the expression for `calculator`, the source for `python`. With no `<call>` in the
  turn, everything before `</call>` is the body.
- The tool node runs the call and appends `<out>OUTPUT</out>`: the tool's output, or `?` and the error
  message when the call failed, encoded as plain text (a special token's string in it is split into ordinary
  tokens, so output cannot close the block, open a call or end the episode: `plain_text_ids`); characters
  the tokenizer does not know are dropped, and the output is cut to `max_output_tokens`. These tokens are
  not written by the policy: they are attended to but masked out of the policy loss (`Episodes.model_mask`,
  `EpisodeRollouts.response_mask`).
- The episode continues with the next model turn until an answer, the turn limit (the number of turn
  nodes in the pipeline), or the `token_budget` of tokens after the prompt.
- The final answer, which the verifier checks, is the text after the last tool output.
- A tokenizer without the tags (a task without a tool, such as `arithmetic`) gives single-turn episodes:
  no call can be written, so the tool is never needed.

Steps are functions of an `Episodes` batch that return a new one (inputs are never mutated: a node's output
stays as it was when the iteration's metrics are read). Only `Engine.generate` is used, so any engine works.
Not done here: scheduling the steps (the pipeline unrolls them into nodes), tool implementations
(`plexrl.tools`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from plexrl.batch import EpisodeRollouts, Episodes, Prompts, episode_metrics

if TYPE_CHECKING:
    from plexrl.tools import Tool, ToolResult

CALL, CALL_END, OUT, OUT_END = "<call>", "</call>", "<out>", "</out>"
TAGS = (CALL, CALL_END, OUT, OUT_END)


def start_episodes(
    prompts: Prompts, *, n: int, temperature: float, token_budget: int, prefix: str, weight_version: int = 0
) -> Episodes:
    """N = P*n empty episodes, rows grouped by prompt; `episode_ids` are `prefix/row`."""
    rows = [i for i in range(len(prompts)) for _ in range(n)]
    N = len(rows)
    return Episodes(
        prompt_ids=[list(prompts.token_ids[i]) for i in rows],
        tokens=[[] for _ in rows],
        model_mask=[[] for _ in rows],
        logprobs=[[] for _ in rows],
        pending=[None] * N,
        status=["running"] * N,
        turns=[0] * N,
        tool_calls=[0] * N,
        tool_errors=[0] * N,
        tool_latency_s=[0.0] * N,
        answers=[prompts.answers[i] for i in rows],
        episode_ids=[f"{prefix}/{k}" for k in range(N)],
        group_size=n,
        temperature=temperature,
        token_budget=token_budget,
        weight_version=weight_version,
    )


def has_tags(tokenizer: Any) -> bool:
    """Whether the tokenizer has the four tags as special tokens."""
    return set(TAGS) <= set(tokenizer.all_special_tokens)


def tag_ids(tokenizer: Any) -> dict[str, int]:
    """Ids of the four tags; raises ValueError naming the fix when the tokenizer lacks them."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in TAGS}
    missing = [t for t in TAGS if t not in tokenizer.all_special_tokens]
    if missing:
        raise ValueError(
            f"the tokenizer has no special tokens {missing}; tool-calling episodes need a task whose tokenizer "
            "defines them (task.name: tool_arithmetic)"
        )
    return ids


def take_turn(
    engine: Any, tokenizer: Any, eps: Episodes, *, max_new_tokens: int, seed: int, greedy: bool = False
) -> Episodes:
    """One model turn for every running episode without a pending call: generate from prompt + episode so
    far until eos, `</call>` or `max_new_tokens` (cut further to what is left of the token budget)."""
    out = copy.deepcopy(eps)
    tags = tag_ids(tokenizer) if has_tags(tokenizer) else {}
    active = [i for i, s in enumerate(out.status) if s == "running" and out.pending[i] is None]
    if not active:
        return out
    left = {i: out.token_budget - len(out.tokens[i]) for i in active}
    limit = min(max_new_tokens, max(left.values()))
    gen = engine.generate(
        [out.prompt_ids[i] + out.tokens[i] for i in active],
        n=1,
        temperature=out.temperature,
        max_new_tokens=limit,
        seed=seed,
        greedy=greedy,
        stop_token_ids=[tags[CALL_END]] if tags else [],
    )
    lengths, response, logprobs = gen.lengths.tolist(), gen.response_ids.tolist(), gen.logprobs.tolist()
    generated = 0
    for k, i in enumerate(active):
        toks, lps = response[k][: lengths[k]], logprobs[k][: lengths[k]]
        cut = len(toks) > left[i]
        toks, lps = toks[: left[i]], lps[: left[i]]
        out.tokens[i] += toks
        out.model_mask[i] += [1] * len(toks)
        out.logprobs[i] += lps
        out.turns[i] += 1
        generated += len(toks)
        last = toks[-1] if toks and not cut else None
        if last == tokenizer.eos_token_id:
            out.status[i] = "answer"
        elif tags and last == tags[CALL_END] and len(out.tokens[i]) < out.token_budget:
            out.pending[i] = call_body(toks, tokenizer, tags)
        else:
            out.status[i] = "budget" if len(out.tokens[i]) >= out.token_budget else "length"
    out.new_tokens = generated
    out.weight_version = engine.weight_version
    return out


def call_body(turn: Sequence[int], tokenizer: Any, tags: dict[str, int]) -> str:
    """The text between the turn's last `<call>` and its closing `</call>` (the whole turn before
    `</call>` when it has no `<call>`), special tokens dropped."""
    ids = list(turn[:-1]) if turn and turn[-1] == tags[CALL_END] else list(turn)
    if tags[CALL] in ids:
        ids = ids[len(ids) - ids[::-1].index(tags[CALL]) :]
    text: str = tokenizer.decode(ids, skip_special_tokens=True)
    return text


def tool_argument(tool: Tool) -> str:
    """The argument a call body is passed as: the first required field of the tool's arguments model."""
    fields = tool.spec.arguments.model_fields
    required = [name for name, f in fields.items() if f.is_required()]
    if not (required or fields):
        raise ValueError(f"tool {tool.spec.name!r} takes no arguments; a call body needs one string argument")
    return (required or list(fields))[0]


def run_tools(
    eps: Episodes, tool: Tool | None, tokenizer: Any, *, max_output_tokens: int, concurrency: int = 8
) -> Episodes:
    """Execute every pending call (create, execute, release per call; up to `concurrency` at once) and
    append `<out>OUTPUT</out>` to its episode, masked out of the loss. A failed call (the tool never
    raises) shows `?` and its error and counts in `tool_errors`. Output beyond the token budget is cut
    and ends the episode ("budget")."""
    out = copy.deepcopy(eps)
    rows = [i for i, p in enumerate(out.pending) if p is not None and out.status[i] == "running"]
    if not rows:
        return out
    if tool is None:
        raise ValueError("episodes have pending tool calls but no tool is configured; set the `tool` parameter")
    tags, arg = tag_ids(tokenizer), tool_argument(tool)

    def call(i: int) -> ToolResult:
        eid = out.episode_ids[i]
        tool.create(eid)
        try:
            return tool.execute(eid, {arg: out.pending[i]})
        finally:
            tool.release(eid)

    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(rows)))) as pool:
        results = list(pool.map(call, rows))
    for i, res in zip(rows, results, strict=True):
        text = res.output if res.ok else f"?{res.error or ''}"
        body = plain_text_ids(tokenizer, text.strip())[:max_output_tokens]
        ids = [tags[OUT], *body, tags[OUT_END]]
        room = out.token_budget - len(out.tokens[i])
        if len(ids) >= room:
            ids = ids[:room]
            out.status[i] = "budget"
        out.tokens[i] += ids
        out.model_mask[i] += [0] * len(ids)
        out.logprobs[i] += [0.0] * len(ids)
        out.pending[i] = None
        out.tool_calls[i] += 1
        out.tool_errors[i] += 0 if res.ok else 1
        out.tool_latency_s[i] += res.latency_s
    out.new_tokens = 0
    return out


def plain_text_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` as plain text: a special token's string in it (`</out>`, `<call>`, `<eos>`, ...) is
    split into ordinary tokens, and any special id a tokenizer still emits is dropped. Tool output (which may
    come from model-written code) therefore can never close its `<out>` block, open a call or end the episode.

    >>> class Chars:  # a stand-in tokenizer that would read "<eos>" as the special id 0
    ...     all_special_ids = [0]
    ...     def __call__(self, text, add_special_tokens, split_special_tokens):
    ...         return {"input_ids": [ord(c) for c in text] if split_special_tokens else [0]}
    >>> plain_text_ids(Chars(), "<eos>")
    [60, 101, 111, 115, 62]
    """
    ids: list[int] = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    special = set(tokenizer.all_special_ids)
    return [i for i in ids if i not in special]


def final_answer(tokens: Sequence[int], tokenizer: Any) -> str:
    """The text after the last `</out>`, special tokens dropped (eos included)."""
    end = tokenizer.convert_tokens_to_ids(OUT_END) if has_tags(tokenizer) else None
    ids = list(tokens)
    if end is not None and end in ids:
        ids = ids[len(ids) - ids[::-1].index(end) :]
    text: str = tokenizer.decode(ids, skip_special_tokens=True)
    return text


def finish_episodes(eps: Episodes, tokenizer: Any) -> EpisodeRollouts:
    """Pad the episodes into a `Rollouts`-compatible batch, shapes [N, L] with L = L_p + T: the prompt
    left-padded to L_p columns, then every token after it (model and tool) right-padded to T. Episodes
    still running (a call left after the last turn) end as "turns"."""
    import torch

    N = len(eps)
    ends = ["turns" if s == "running" else s for s in eps.status]
    lp = max(len(p) for p in eps.prompt_ids)
    T = max(1, max(len(t) for t in eps.tokens))
    pad = tokenizer.pad_token_id
    answers = [final_answer(t, tokenizer) if e == "answer" else "" for t, e in zip(eps.tokens, ends, strict=True)]
    ids = torch.full((N, lp + T), pad, dtype=torch.long)
    attention = torch.zeros((N, lp + T), dtype=torch.long)
    model = torch.zeros((N, lp + T))
    tool = torch.zeros((N, lp + T))
    behaviour = torch.zeros((N, lp + T))
    for i in range(N):
        p, t = eps.prompt_ids[i], eps.tokens[i]
        ids[i, lp - len(p) : lp + len(t)] = torch.tensor(p + t, dtype=torch.long)
        attention[i, lp - len(p) : lp + len(t)] = 1
        mask = torch.tensor(eps.model_mask[i], dtype=torch.float32)
        model[i, lp : lp + len(t)] = mask
        tool[i, lp : lp + len(t)] = 1 - mask
        behaviour[i, lp : lp + len(t)] = torch.tensor(eps.logprobs[i], dtype=torch.float32)
    return EpisodeRollouts(
        input_ids=ids,
        attention_mask=attention,
        response_mask=model,
        behaviour_logprobs=behaviour,
        prompt_len=lp,
        response_lengths=model.sum(1).long(),
        finish_reasons=["stop" if e == "answer" else "length" for e in ends],
        completions=answers,
        answers=list(eps.answers),
        group_size=eps.group_size,
        temperature=eps.temperature,
        weight_version=eps.weight_version,
        tool_mask=tool,
        transcripts=[tokenizer.decode(t, skip_special_tokens=False) for t in eps.tokens],
        episode_end=ends,
        turns=list(eps.turns),
        tool_calls=list(eps.tool_calls),
        tool_errors=list(eps.tool_errors),
        tool_latency_s=list(eps.tool_latency_s),
    )


def greedy_episodes(
    engine: Any,
    tokenizer: Any,
    tool: Tool | None,
    problems: Sequence[Any],
    *,
    max_turns: int,
    max_new_tokens: int,
    token_budget: int,
    max_output_tokens: int,
    verify: Callable[[list[str], list[str]], list[float | None]],
    prefix: str = "eval",
) -> tuple[float, float, dict[str, float]]:
    """Greedy episodes on `problems` (each with `prompt` and `answer`), turns and tool calls alternating in
    one process (held-out evaluation), scored by the task's `verify`. Returns accuracy, mean model tokens
    per episode, and the means of `episode_metrics` (tool_use_rate, turns, tool_calls, tool_errors,
    tool_latency_s)."""
    prompts = Prompts(
        texts=[p.prompt for p in problems],
        token_ids=[tokenizer(p.prompt)["input_ids"] for p in problems],
        answers=[p.answer for p in problems],
    )
    eps = start_episodes(prompts, n=1, temperature=1.0, token_budget=token_budget, prefix=prefix)
    for turn in range(max_turns):
        eps = take_turn(engine, tokenizer, eps, max_new_tokens=max_new_tokens, seed=turn, greedy=True)
        if turn < max_turns - 1:
            eps = run_tools(eps, tool, tokenizer, max_output_tokens=max_output_tokens)
    done = finish_episodes(eps, tokenizer)
    scores = verify(done.completions, done.answers)
    accuracy = sum(s or 0.0 for s in scores) / max(len(scores), 1)
    length = float(done.response_lengths.float().mean())
    return accuracy, length, episode_metrics(done.turns, done.tool_calls, done.tool_errors, done.tool_latency_s)
