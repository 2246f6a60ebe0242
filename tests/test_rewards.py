"""Rewards (plexrl/rewards.py): built-ins, the weighted sum, user rewards by dotted path, every call in a
worker process with a time limit (plexrl/reward_workers.py)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from pydantic import ValidationError

from plexrl.data.config import DataConfig, RewardTerm
from plexrl.errors import ConfigError
from plexrl.reward_workers import POOL
from plexrl.rewards import (
    BUILTINS,
    MAX_TIMEOUTS_IN_A_ROW,
    ChoiceParams,
    ExactParams,
    FormatParams,
    MathParams,
    NumericParams,
    RegexParams,
    RewardHung,
    build_reward,
)
from plexrl.roles import allowed_modules


def terms(*items: dict[str, Any]) -> list[RewardTerm]:
    return [RewardTerm.model_validate(t) for t in items]


# ---- built-ins ---------------------------------------------------------------------------------------------


def test_math_and_numeric_on_gsm8k_and_boxed_answers() -> None:
    responses = ["The total is \\boxed{18}.", "so we get #### 18", "18 or 19, then 20", "\\boxed{\\frac{3}{4}}", ""]
    truths = ["18", "Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18", "18", "0.75", "1"]
    assert BUILTINS["math"][1](responses, truths, MathParams()) == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert BUILTINS["numeric"][1](responses, truths, NumericParams()) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert BUILTINS["math"][1](["1"], [None], MathParams()) == [None]


def test_exact_regex_choice_format() -> None:
    assert BUILTINS["exact"][1](["a ", "A"], ["a", "a"], ExactParams()) == [1.0, 0.0]
    p = RegexParams(pattern=r"<answer>(.*?)</answer>")
    assert BUILTINS["regex"][1](["<answer> 7 </answer>", "<answer>8</answer>", "7"], ["7", "7", "7"], p) == [
        1.0,
        0.0,
        0.0,
    ]
    assert BUILTINS["regex"][1](["ANSWER: 7"], ["7"], RegexParams(pattern="answer: (7)", ignore_case=True)) == [1.0]
    got = BUILTINS["choice"][1](["Answer: B", "(c)", "I think E", "\\boxed{F}"], ["B", "C", "E", "F"], ChoiceParams())
    assert got == [1.0, 1.0, 0.0, 0.0]  # "I think E" names no choice; F is not a letter of A-E
    assert BUILTINS["choice"][1](["\\boxed{F}"], ["F"], ChoiceParams(letters="ABCDEF")) == [1.0]
    assert BUILTINS["format"][1](["x\n**Answer:** 3", "Answer:"], ["", ""], FormatParams()) == [1.0, 0.0]
    fmt = FormatParams(require="regex", pattern=r"^<think>.*</think>")
    assert BUILTINS["format"][1](["<think>a</think>4", "4"], ["", ""], fmt) == [1.0, 0.0]


def test_builtin_params_are_checked_with_the_field_named() -> None:
    with pytest.raises(ValidationError, match=r"params\.pattern.*not a valid regex"):
        RewardTerm(name="regex", params={"pattern": "(unclosed"})
    with pytest.raises(ValidationError, match=r"params\.patern.*its parameters: pattern, ignore_case"):
        RewardTerm(name="regex", params={"patern": "x"})
    with pytest.raises(ValidationError, match=r"params\.pattern exactly when"):
        RewardTerm(name="format", params={"require": "regex"})
    with pytest.raises(ValidationError, match="not both"):
        RewardTerm(name="math", ref="user_rewards:length_bonus")
    with pytest.raises(ValidationError, match="dotted path"):
        RewardTerm(ref="os.system")
    with pytest.raises(ValidationError, match="repeat"):
        DataConfig(train="t.jsonl", rewards=terms({"name": "math"}, {"name": "math", "weight": 0.5}))
    assert DataConfig(train="t.jsonl").rewards[0].name == "math"


# ---- the weighted sum ----------------------------------------------------------------------------------------


def test_weighted_sum_with_components_by_name() -> None:
    reward = build_reward(
        terms(
            {"name": "math"},
            {"name": "format", "weight": 0.1},
            {"name": "regex", "label": "tagged", "weight": -1, "params": {"pattern": "<bad>"}},
        )
    )
    out = reward(["", "", ""], ["work\nAnswer: 3", "Answer: 4 <bad>", "3"], ["3", "3", "3"])
    assert out.components == {"math": [1.0, 0.0, 1.0], "format": [1.0, 1.0, 0.0], "tagged": [0.0, 1.0, 0.0]}
    assert out.total == pytest.approx([1.1, -0.9, 1.0])
    assert out.correct == [True, False, True]  # the first term
    assert out.metrics() == pytest.approx(
        {"reward/math": 2 / 3, "reward/format": 2 / 3, "reward/tagged": 1 / 3, "reward_errors": 0, "reward_timeouts": 0}
    )
    assert reward.labels == ["math", "format", "tagged"]
    with pytest.raises(ValueError, match="one of each per row"):
        reward([""], ["a", "b"], ["a", "b"])


# ---- user rewards ---------------------------------------------------------------------------------------


def test_user_reward_per_row_gets_prompt_extra_and_params() -> None:
    reward = build_reward(terms({"ref": "user_rewards:length_bonus", "params": {"per_char": 0.5}}))
    out = reward(["p0", "p1"], ["ab", "abcd"], ["x", "y"], [{}, {"bonus": True}])
    assert out.total == [1.0, 103.0] and out.components == {"length_bonus": [1.0, 103.0]}


def test_every_term_runs_in_a_worker_process_that_is_reused() -> None:
    reward = build_reward(terms({"ref": "user_rewards:pid"}))
    first = reward(["", ""], ["a", "b"], ["", ""]).components["pid"]
    assert first[0] == first[1] != float(os.getpid())
    assert reward([""], ["c"], [""]).components["pid"] == [first[0]]  # the idle worker served the next batch


def test_user_reward_dict_components_and_batched() -> None:
    reward = build_reward(terms({"ref": "user_rewards:parts", "weight": 2}, {"ref": "user_rewards:batch_equal"}))
    out = reward(["", ""], ["7", "seven"], ["7", "7"])
    assert out.components["parts"] == [1.0, -0.5]
    assert out.components["parts/correct"] == [1.0, 0.0] and out.components["parts/short"] == [0.0, -0.5]
    assert out.components["batch_equal"] == [1.0, 0.0]
    assert out.total == [3.0, -1.0]
    assert "reward/parts/correct" in out.metrics()


def test_a_raising_reward_scores_zero_and_is_counted() -> None:
    reward = build_reward(terms({"ref": "user_rewards:raises_on_x"}, {"ref": "user_rewards:batch_wrong_length"}))
    out = reward(["", "", ""], ["a", "x", "b"], ["", "", ""])
    assert out.components["raises_on_x"] == [1.0, 0.0, 1.0]
    assert out.components["batch_wrong_length"] == [0.0, 0.0, 0.0]
    assert out.errors == 1 + 3 and out.timeouts == 0
    assert out.metrics()["reward_errors"] == 4.0
    out = build_reward(terms({"ref": "user_rewards:not_a_number"}))(["", ""], ["nan", "1"], ["", ""])
    assert out.total == [0.0, 0.0] and out.errors == 2


def test_a_hanging_reward_times_out_scores_zero_and_is_counted() -> None:
    reward = build_reward(terms({"ref": "user_rewards:hangs_on_h", "timeout_s": 0.5}))
    out = reward(["", "", "", ""], ["a", "h", "b", "c"], ["", "", "", ""])
    assert out.components["hangs_on_h"] == [1.0, 0.0, 1.0, 1.0]  # the rows after the hung one still scored
    assert out.timeouts == 1 and out.errors == 0
    assert out.metrics()["reward_timeouts"] == 1.0


def test_a_call_holding_the_gil_is_killed_and_this_process_runs_on() -> None:
    """A call that never gives up the GIL (Python's `re` backtracking) runs in the worker:
    this process's threads keep running while it waits, and the call is killed at its limit (in a thread of
    this process, the ticker would stand still for the minutes the match takes)."""
    reward = build_reward(terms({"ref": "user_rewards:backtracks_on_h", "timeout_s": 1.0}))
    ticks = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            stop.wait(0.05)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        out = reward(["", ""], ["h", "a"], ["", ""])
    finally:
        stop.set()
        ticker.join()
    assert out.components["backtracks_on_h"] == [0.0, 0.5] and out.timeouts == 1
    assert len(ticks) >= 3  # about 20 in the second the call was given


def test_a_hanging_second_term_leaves_the_first_its_scores() -> None:
    """A second term (weight 0.5) that hangs on some rows must not zero the first, a user reward
    (the accuracy signal), batch after batch: the old threads gave up on every user reward after 8 hangs."""
    reward = build_reward(
        terms({"ref": "user_rewards:equal"}, {"ref": "user_rewards:hangs_on_h", "weight": 0.5, "timeout_s": 0.3})
    )
    responses, truths = ["7", "h", "8", "h", "7", "h", "9", "h"], ["7", "h", "7", "h"] * 2
    for _ in range(3):  # 12 hung calls in all
        out = reward([""] * 8, responses, truths)
        assert out.components["equal"] == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
        assert out.components["hangs_on_h"] == [1.0, 0.0] * 4
        assert out.timeouts == 4 and out.errors == 0
        assert out.correct == [s == 1.0 for s in out.components["equal"]]


def test_a_term_that_keeps_timing_out_fails_loudly_with_its_name() -> None:
    reward = build_reward(
        terms({"name": "exact"}, {"ref": "user_rewards:hangs_on_h", "label": "slow", "timeout_s": 0.2})
    )
    with pytest.raises(
        RewardHung, match=rf"'slow' \(user_rewards:hangs_on_h\) timed out on {MAX_TIMEOUTS_IN_A_ROW} calls"
    ):
        reward([""] * MAX_TIMEOUTS_IN_A_ROW, ["h"] * MAX_TIMEOUTS_IN_A_ROW, [""] * MAX_TIMEOUTS_IN_A_ROW)


def test_a_backtracking_regex_pattern_runs_in_linear_time() -> None:
    """`(?s)(.|.|.|.|.)*X` on a completion without an X takes exponential time in Python's `re`;
    on RE2 it is one pass. The term's limit is 5 s; a backtracking engine would not finish in years."""
    reward = build_reward(terms({"name": "regex", "params": {"pattern": "(?s)(.|.|.|.|.)*X"}}))
    completion = "The answer is 12 because 5 + 7 = 12 and nothing else matters here at all. " * 3
    out = reward(["", ""], [completion, completion + "X"], ["", ""])
    assert out.components["regex"] == [0.0, 1.0] and out.timeouts == 0
    fmt = build_reward(terms({"name": "format", "params": {"require": "regex", "pattern": "(a|aa)*$b"}}))
    assert fmt([""], ["a" * 5000], [""]).components["format"] == [0.0]


def test_patterns_re2_cannot_run_are_refused_at_validation() -> None:
    with pytest.raises(ValidationError, match=r"params\.pattern.*RE2.*backreferences or lookarounds"):
        RewardTerm(name="regex", params={"pattern": r"(a)\1"})
    with pytest.raises(ValidationError, match=r"params\.pattern.*RE2"):
        RewardTerm(name="format", params={"require": "regex", "pattern": r"x(?=y)"})


def test_idle_workers_are_kept_and_closed() -> None:
    build_reward(terms({"ref": "user_rewards:pid"}))([""], ["a"], [""])
    assert POOL.idle() >= 1
    POOL.close()
    assert POOL.idle() == 0


def test_undeclared_or_disallowed_refs_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"data\.rewards\[0\]\.ref.*not a declared reward.*declare\(\"reward\"\)"):
        build_reward(terms({"ref": "user_rewards:undeclared"}))
    with pytest.raises(ConfigError, match="not a declared reward"):
        build_reward(terms({"ref": "user_rewards:a_tool"}))  # declared, for another role
    with pytest.raises(ConfigError, match=r"data\.rewards\[1\]\.ref.*cannot import"):
        build_reward(terms({"name": "math"}, {"ref": "no_such_module_xyz:fn"}))
    with allowed_modules(["mypkg"]), pytest.raises(ConfigError, match="outside the allowed modules"):
        build_reward(terms({"ref": "user_rewards:length_bonus"}))
    with allowed_modules(["user_rewards"]):
        assert build_reward(terms({"ref": "user_rewards:length_bonus"})).labels == ["length_bonus"]


def test_reward_pickles_as_its_terms() -> None:
    reward = build_reward(terms({"name": "math"}, {"ref": "user_rewards:batch_equal", "weight": 0.5}))
    back = pickle.loads(pickle.dumps(reward))
    assert back.terms == reward.terms
    assert back(["", ""], ["\\boxed{2}", "3"], ["2", "2"]).total == [1.0, 0.0]


def test_a_hanging_batched_reward_times_out_on_every_row() -> None:
    reward = build_reward(terms({"name": "exact"}, {"ref": "user_rewards:batch_hangs", "timeout_s": 0.3}))
    out = reward(["", ""], ["a", "b"], ["a", "a"])
    assert out.components["batch_hangs"] == [0.0, 0.0] and out.total == [1.0, 0.0]
    assert out.timeouts == 2 and out.errors == 0


def test_a_reward_worker_imports_only_what_its_term_needs() -> None:
    """A worker starts per term (and again after every timeout): it must not load the planner, the runtime,
    networkx, torch or pytest, which made each start take seconds. Checked in a real worker (a user reward that
    looks at its own `sys.modules`) and for the built-ins' import path."""
    from user_rewards import HEAVY

    out = build_reward(terms({"ref": "user_rewards:heavy_modules"}))([""], ["a"], [""])
    loaded = [name for name in HEAVY if out.components[f"heavy_modules/{name}"] != [0.0]]
    assert loaded == [], f"a reward worker imported {loaded}"
    probe = "import sys, plexrl._reward_worker, plexrl.reward_builtins; print(' '.join(sys.modules))"
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert [name for name in HEAVY if name in got.stdout.split()] == []
