"""Multi-turn tool-calling episodes as operators (tag format: `plexrl.episodes`).

A pipeline unrolls an episode into nodes the planner schedules one by one, so that another job's work can
fill the gaps (`pipelines/grpo_tools.py`):

    prompts -> start_episodes[cpu] -> agent_turn[service] -> call_tools[cpu] -> agent_turn[service] -> ...
            -> finish_episodes[cpu] -> verify -> advantage -> train

`agent_turn` uses only `Engine.generate` (any engine); `call_tools` runs on the CPU pool and never in the
driver process (`inline=False`): the job's service is free while its tools run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator, Field

from plexrl.batch import AgentEvalStats, EpisodeRollouts, Episodes, Prompts
from plexrl.operator import OpContext, operator

if TYPE_CHECKING:
    from plexrl.tools import Tool


def check_tool(name: str | None) -> str | None:
    """Validate a tool name when the pipeline is built: a built-in or `pkg.module:Factory` that loads."""
    if name is not None:
        from plexrl.tools import get_tool

        get_tool(name)  # ValueError with the fix in words
    return name


ToolName = Annotated[
    str | None,
    AfterValidator(check_tool),
    Field(description="built-in tool (calculator, python) or 'pkg.module:Factory'; None: the task's tool"),
]


def task_tool(name: str | None, ctx: OpContext) -> Tool | None:
    """The tool `name`, else the task's tool; None when neither names one (a task without tool tags)."""
    from plexrl.tools import get_tool

    chosen = name or getattr(ctx.task, "tool", None)
    return get_tool(chosen) if chosen else None


@operator(runs_on="cpu")
def start_episodes(
    prompts: Prompts,
    ctx: OpContext,
    *,
    n: Annotated[int, Field(ge=1, le=1024, description="episodes per prompt")] = 8,
    temperature: Annotated[float, Field(gt=0, le=10)] = 1.0,
    token_budget: Annotated[int, Field(ge=1, description="tokens after the prompt, model and tool")] = 64,
) -> Episodes:
    """`n` empty episodes per prompt, rows [P*n] grouped by prompt; every turn samples at `temperature`."""
    from plexrl.episodes import start_episodes as start

    prefix = f"{ctx.job_id}/{ctx.iteration}"
    return start(prompts, n=n, temperature=temperature, token_budget=token_budget, prefix=prefix)


@operator(runs_on="service")
def agent_turn(
    episodes: Episodes, ctx: OpContext, *, max_new_tokens: Annotated[int, Field(ge=1, le=32768)] = 16
) -> Episodes:
    """One model turn of every running episode: sample until eos (answer), `</call>` (a pending tool
    call) or `max_new_tokens`, within the episode's token budget. Records behaviour log-probs."""
    from plexrl.episodes import take_turn

    return take_turn(ctx.engine, ctx.tokenizer, episodes, max_new_tokens=max_new_tokens, seed=ctx.seed("turn"))


@operator(runs_on="cpu", inline=False)
def call_tools(
    episodes: Episodes,
    ctx: OpContext,
    *,
    tool: ToolName = None,
    max_output_tokens: Annotated[int, Field(ge=1, le=32768)] = 32,
    concurrency: Annotated[int, Field(ge=1, le=1024, description="calls run at once (threads)")] = 8,
) -> Episodes:
    """Execute the pending calls and append each output as `<out>...</out>` (masked out of the loss);
    counts calls, errors and latency per episode. `tool` None: the task's tool."""
    from plexrl.episodes import run_tools

    impl = task_tool(tool, ctx) if any(p is not None for p in episodes.pending) else None
    return run_tools(episodes, impl, ctx.tokenizer, max_output_tokens=max_output_tokens, concurrency=concurrency)


@operator(runs_on="cpu")
def finish_episodes(episodes: Episodes, ctx: OpContext) -> EpisodeRollouts:
    """Close the episodes (still running after the last turn: "turns") and pad them into a Rollouts batch
    for verify / advantage / train, tool output masked out. Logs per-sample means: turns, tool_calls,
    tool_errors, tool_latency_s, tool_use_rate."""
    from plexrl.episodes import finish_episodes as finish

    return finish(episodes, ctx.tokenizer)


@operator(runs_on="service")
def evaluate_agent(
    ctx: OpContext,
    *,
    size: Annotated[int, Field(ge=1)] = 400,
    max_turns: Annotated[int, Field(ge=1, le=64)] = 2,
    max_new_tokens: Annotated[int, Field(ge=1)] = 16,
    token_budget: Annotated[int, Field(ge=1)] = 64,
    max_output_tokens: Annotated[int, Field(ge=1)] = 32,
    tool: ToolName = None,
) -> AgentEvalStats:
    """Greedy held-out accuracy of tool-calling episodes on the first `size` held-out problems, with the
    tool-use rate and per-episode tool statistics.

    Unlike the rollout, turns and tool calls alternate inside this one service node (so that it runs in the
    baseline pass, step 0, like `evaluate`): meant for cheap tools such as the calculator; the python
    tool runs its code in a sandbox subprocess either way."""
    from plexrl.episodes import greedy_episodes

    problems = ctx.task.held_out[:size]
    acc, length, tools = greedy_episodes(
        ctx.engine,
        ctx.tokenizer,
        task_tool(tool, ctx),
        problems,
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        token_budget=token_budget,
        max_output_tokens=max_output_tokens,
        verify=ctx.task.verify,
        prefix=f"{ctx.job_id}/eval{ctx.iteration}",
    )
    return AgentEvalStats(accuracy=acc, size=len(problems), response_length=length, tools=tools)
