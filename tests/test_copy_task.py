"""The long-tailed copy task (plexrl/job/tasks/copy.py), the sandboxed expression tool of the agentic mix job
(plexrl/job/tasks/python_calls.py), and the paper-idle-sources mix config.

- lengths are heavy-tailed as documented (seeded): most short, a few near the cap, none above it;
- the task is deterministic per seed and its verifier is exact match;
- a tiny copy job runs end to end (the long row holds up the rollout: response widths follow the longest);
- PythonExpression returns an expression's value from a real sandboxed run and refuses statements.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest

from plexrl.errors import ConfigError
from plexrl.job.config import TaskConfig
from plexrl.job.load import load_job
from plexrl.job.tasks import CopyTask, make_task
from plexrl.job.tasks.copy import draw_length

ROOT = Path(__file__).resolve().parent.parent


def test_lengths_are_heavy_tailed_and_capped() -> None:
    rng = random.Random(0)
    lengths = [draw_length(rng, 1.2, 96) for _ in range(20000)]
    assert min(lengths) == 1 and max(lengths) == 96
    share = {k: sum(n >= k for n in lengths) / len(lengths) for k in (2, 10, 30, 96)}
    for k, p in share.items():  # P(L >= k) = k**-1.2 below the cap; the cap holds the rest of the tail
        assert abs(p - k**-1.2) < 0.01, (k, p)
    assert sum(n <= 3 for n in lengths) / len(lengths) > 0.7  # most answers are short


def test_the_task_is_seeded_and_verified_exactly() -> None:
    cfg = TaskConfig(name="copy", train_size=300, eval_size=20, max_length=50)
    task, again = make_task(cfg), make_task(cfg)
    assert isinstance(task, CopyTask) and task.train == again.train and task.held_out == again.held_out
    assert len(task.train) == 300 and len(task.held_out) == 20 and task.max_answer_chars == 50
    other = make_task(cfg.model_copy(update={"seed": 7}))
    assert other.train != task.train
    p = next(q for q in task.train if len(q.answer) > 1)
    assert p.prompt == p.answer + "="
    assert task.verify([p.answer, p.answer[::-1] + "0", f" {p.answer} "], [p.answer] * 3) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="digits_b"):
        TaskConfig(name="copy", digits_b=2)


def test_a_tiny_copy_job_runs_and_its_rollouts_are_as_wide_as_the_longest_row(
    tiny_config: dict[str, Any],
) -> None:
    from conftest import local_runner

    from plexrl.job.spec import prepare_job

    cfg = copy.deepcopy(tiny_config)
    cfg["task"] = {"name": "copy", "max_length": 16, "train_size": 200, "eval_size": 16}
    cfg["model"]["max_position"] = 48
    cfg["pipeline"]["params"].update(max_new_tokens=17, batch_size=8)
    cfg["engine"] = "torch"
    (run,) = local_runner().run([prepare_job(load_job(cfg))])
    assert run.status == "done", run.error
    assert run.iterations_done == 2
    assert all(0 < row["rollout/response_length"] <= 17 for row in run.history if "rollout/response_length" in row)


def test_the_paper_mix_validates_with_every_idle_source() -> None:
    from plexrl.cluster import load_cluster

    cluster = load_cluster(ROOT / "configs" / "multiplex_paper.yaml")
    by_name = {j.config.name: j.config for j in cluster.jobs}
    assert by_name["grpo-copy"].task.name == "copy"  # long-tailed rollouts
    tools = by_name["grpo-tools"]
    assert tools.pipeline.name == "grpo_tools" and tools.pipeline.params["tool"].endswith(":PythonExpression")
    assert by_name["grpo-judge"].pipeline.params["verifier_latency_s"] > 0  # a judged job
    assert by_name["grpo-arithmetic"].task.name == "arithmetic"  # compute-bound GRPO
    with pytest.raises(ConfigError, match="length_alpha"):
        load_job({"task": {"name": "copy", "length_alpha": 0}})


def test_python_expression_runs_in_the_sandbox_and_refuses_statements() -> None:
    from plexrl.job.tasks.python_calls import PythonExpression
    from plexrl.tools import get_tool

    tool = get_tool("plexrl.job.tasks.python_calls:PythonExpression", timeout_s=10)
    assert isinstance(tool, PythonExpression)
    ok = tool.execute("e", {"expression": "347*58"})
    assert ok.ok and ok.output == "20126", (ok.error, ok.output)
    assert ok.latency_s > 0.005  # a process was started, not an in-process evaluation
    bad = tool.execute("e", {"expression": "import os"})
    assert not bad.ok and "single Python expression" in (bad.error or "")
    long = tool.execute("e", {"expression": "1+" * 200 + "1"})
    assert not long.ok and "longer than" in (long.error or "")
    wrong = tool.execute("e", {"code": "1"})
    assert not wrong.ok


def test_an_agentic_episode_calls_the_sandboxed_expression_tool() -> None:
    """The grpo_tools episode steps hand the call body to PythonExpression and append its value."""
    import tempfile

    from test_agentic import ScriptedEngine, prompts

    from plexrl.episodes import TAGS, run_tools, start_episodes, take_turn
    from plexrl.job.models import build_tokenizer
    from plexrl.job.tasks.tool_arithmetic import TOOL_ALPHABET
    from plexrl.tools import get_tool

    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(Path(tmp), TOOL_ALPHABET, TAGS)
    eps = start_episodes(prompts(tok, [("347*58=", "20126")]), n=1, temperature=1.0, token_budget=40, prefix="j/0")
    eps = take_turn(ScriptedEngine(tok, [["<call>347*58</call>"]]), tok, eps, max_new_tokens=16, seed=0)
    tool = get_tool("plexrl.job.tasks.python_calls:PythonExpression", timeout_s=10)
    done = run_tools(eps, tool, tok, max_output_tokens=8)
    assert tok.decode(done.tokens[0][len(eps.tokens[0]) :]) == "<out>20126</out>"
    assert done.tool_calls == [1] and done.tool_errors == [0] and done.tool_latency_s[0] > 0.005
