"""Verifiers: one score per sample, None where not applicable, never an exception on malformed model output."""

from __future__ import annotations

import doctest
import threading
from typing import Any

import pytest

import plexrl.verifiers as verifiers
from plexrl.tools import Sandbox
from plexrl.tools.sandbox import SandboxLimits
from plexrl.verifiers import (
    code_unit_tests,
    exact_numeric,
    extract_code,
    final_number,
    math_answer,
    parse_number,
    unit_tests,
)

MALFORMED: list[Any] = [None, 42, b"\xff\xfe", "", "\\boxed{", "}}}{{{", "\x00" * 10, "9" * 5000, "\\frac{1}{0}"]


def test_doctests() -> None:
    public = [parse_number, final_number, exact_numeric, math_answer, extract_code, code_unit_tests, unit_tests]
    assert all(">>> " in (fn.__doc__ or "") for fn in public)
    result = doctest.testmod(verifiers)
    assert result.attempted >= len(public) and result.failed == 0


@pytest.mark.parametrize(
    ("text", "value"),
    [("42", 42.0), ("-3", -3.0), ("1,234,567", 1234567.0), ("0.25", 0.25), (".5", 0.5), ("3/4", 0.75),
     ("1e-3", 0.001), ("−2", -2.0), ("$12$", 12.0), ("7.", 7.0), ("1,23", None), ("abc", None), ("1/0", None),
     ("", None)],
)  # fmt: skip
def test_parse_number(text: str, value: float | None) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize(
    ("completion", "value"),
    [
        ("Adding 3 and 4 gives 7. The answer is \\boxed{7}. Check: 8", 7.0),
        ("First 10, then 20.\n#### 1,500", 1500.0),
        ("So the answer is: 12 apples.", 12.0),
        ("2 + 2 = 4", 4.0),
        ("no numbers at all", None),
        ("values 1, 2 and finally 3.5", 3.5),
    ],
)
def test_final_number(completion: str, value: float | None) -> None:
    assert final_number(completion) == value


def test_exact_numeric_scores_one_per_sample() -> None:
    completions = ["\\boxed{1,000}", "#### 0.3333333", "It is 5", "It is 5", "garbage", "The answer is 2.0"]
    answers: list[Any] = ["1000", "1/3", 6, None, "7", 2]
    assert exact_numeric(completions, answers) == [1.0, 1.0, 0.0, None, 0.0, 1.0]
    assert exact_numeric(["0.3334"], ["1/3"], rel_tol=1e-3) == [1.0]


def test_exact_numeric_never_raises_on_malformed_output(caplog: pytest.LogCaptureFixture) -> None:
    assert exact_numeric(MALFORMED, ["1"] * len(MALFORMED)) == [0.0] * len(MALFORMED)
    assert exact_numeric(["5"], ["five"]) == [0.0]
    assert "not a number" in caplog.text


@pytest.mark.parametrize("fn", [exact_numeric, math_answer, code_unit_tests])
def test_batches_of_different_lengths_are_a_caller_error(fn: Any) -> None:
    with pytest.raises(ValueError, match="2 completions but 1 references"):
        fn(["a", "b"], ["1"])
    assert fn([], []) == []


def test_math_answer_accepts_equivalent_forms() -> None:
    completions = [
        "so the result is $\\boxed{\\frac{3}{4}}$",
        "therefore $\\boxed{0.75}$",
        "we get $\\boxed{(x+1)^2}$",
        "$\\boxed{2\\sqrt{2}}$",
        "The answer is $\\boxed{5}$",
        "final: $\\boxed{\\{1, 2\\}}$",
        "something else",
    ]
    answers: list[str | None] = ["0.75", "\\frac{3}{4}", "x^2 + 2x + 1", "\\sqrt{8}", "6", "\\{2, 1\\}", None]
    assert math_answer(completions, answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, None]


def test_math_answer_never_raises_on_malformed_output() -> None:
    assert math_answer(MALFORMED, ["1"] * len(MALFORMED)) == [0.0] * len(MALFORMED)
    assert math_answer(["\\boxed{1}"], ["\\frac{"]) == [0.0]  # unparsable reference: 0.0 and a warning


def test_math_answer_off_the_main_thread_refuses_huge_powers_without_hanging() -> None:
    completions = ["$\\boxed{10^{10^{10}}}$", "$\\boxed{100000!}$", "$\\boxed{2^{200000}}$", "$\\boxed{\\frac{6}{4}}$"]
    scores: list[Any] = []
    worker = threading.Thread(target=lambda: scores.extend(math_answer(completions, ["1", "2", "3", "3/2"])))
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert scores == [0.0, 0.0, 0.0, 1.0]


def test_extract_code() -> None:
    two_blocks = "```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```"
    assert extract_code(two_blocks) == "print(2)\n"
    assert extract_code("def f(): pass") == "def f(): pass"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"


@pytest.fixture(scope="module")
def small_sandbox() -> Sandbox:
    return Sandbox(SandboxLimits(timeout_s=1.5, cpu_s=1, memory_mb=256))


SQUARE = unit_tests("square", [((3,), 9), ((-2,), 4)])


def test_code_unit_tests_scores_passing_and_failing_code(small_sandbox: Sandbox) -> None:
    good = "```python\ndef square(x):\n    return x * x\n```"
    completions = [good, "def square(x): return x + x", "def square(x) return", good, "import sys; sys.exit(0)"]
    scores = code_unit_tests(completions, [SQUARE, SQUARE, SQUARE, None, SQUARE], sandbox=small_sandbox)
    assert scores == [1.0, 0.0, 0.0, None, 0.0]
    noisy = "def square(x):\n    print('debugging', x)\n    return x ** 2\nprint('loaded')"
    floats = unit_tests("half", [((3,), 1.5), (([1, 2],), [0.5, 1.0])])
    half = "def half(x):\n    return [v / 2 for v in x] if isinstance(x, list) else x / 2"
    assert code_unit_tests([noisy, half], [SQUARE, floats], sandbox=small_sandbox) == [1.0, 1.0]


def test_code_unit_tests_contain_hostile_code(small_sandbox: Sandbox) -> None:
    hostile = [
        "while True: pass",
        "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
        "x = bytearray(10**10)",
        "import os; os.kill(os.getppid(), 9)",
        None,
    ]
    tests = [unit_tests("f", [((1,), 1)])] * len(hostile)
    assert code_unit_tests(hostile, tests, sandbox=small_sandbox, max_workers=2) == [0.0] * len(hostile)


# Wrong code that scored 1.0 before the verdict moved out of the sandbox, each in its own way.
REWARD_HACKS = {
    "pass token from the harness's code objects": (
        "import os, re, sys\ndef square(x):\n    return 0\n"
        "for c in sys._getframe().f_code.co_consts:\n"
        "    if isinstance(c, str) and re.fullmatch('[0-9a-f]{32}', c):\n"
        "        print(c, flush=True)\n        os._exit(0)\n"
    ),
    "pass token from the harness file": (
        "import os, re\ndef square(x):\n    return 0\n"
        "for token in re.findall(r\"print\\('([0-9a-f]{32})'\\)\", open('main.py').read()):\n"
        "    print(token, flush=True)\n    os._exit(0)\n"
    ),
    "excepthook that prints the token and exits 0": (
        "import os, re, sys\ndef square(x):\n    return 0\n"
        "def hook(*exc):\n    for t in re.findall(r\"print\\('([0-9a-f]{32})'\\)\", open('main.py').read()):\n"
        "        print(t, flush=True)\n    os._exit(0)\nsys.excepthook = hook\n"
    ),
    "an object equal to everything": (
        "class Anything:\n    def __eq__(self, other):\n        return True\ndef square(x):\n    return Anything()\n"
    ),
    "an int subclass equal to everything": (
        "class Int(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def square(x):\n    return Int(0)\n"
    ),
    "outputs forged on the harness's own channel": (
        "import os, sys\ndef square(x):\n    return 0\ntry:\n    frame = sys._getframe(1)\n"
        "    mark = [c for c in frame.f_code.co_consts if isinstance(c, str) and c.endswith('outputs:')][0]\n"
        "    os.write(frame.f_globals['_stdout'], (mark + '[[\"ok\", true], [\"ok\", true]]\\n').encode())\n"
        "    os._exit(0)\nexcept Exception:\n    pass\n"
    ),
}


@pytest.mark.parametrize("attack", sorted(REWARD_HACKS))
def test_wrong_code_cannot_forge_a_pass(attack: str, small_sandbox: Sandbox) -> None:
    assert code_unit_tests([REWARD_HACKS[attack]], [SQUARE], sandbox=small_sandbox) == [0.0]


def test_the_expected_outputs_never_enter_the_sandbox(small_sandbox: Sandbox) -> None:
    programs: list[str] = []

    class Spy(Sandbox):
        def run(self, code: str) -> Any:
            programs.append(code)
            return super().run(code)

    spy = Spy(small_sandbox.limits)
    tests = unit_tests("f", [((1,), 987654321), ((2,), "s3cret-expected")])
    assert code_unit_tests(
        ["def f(x): return 987654320 + x if x == 1 else 's3cret' + '-expected'"], [tests], sandbox=spy
    ) == [1.0]
    assert len(programs) == 1 and "987654321" not in programs[0] and "s3cret-expected" not in programs[0]


FORGE = "import os, sys\nfd = sys._getframe(1).f_globals['_stdout']  # the harness's stdout\n"


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("[" * 50_000, "nested past the parser's recursion limit"),
        ('[["ok", ' + "9" * 5000 + '], ["ok", 4]]', "an integer past int-to-str limits"),
        ('[["ok", NaN], ["ok", Infinity]]', "non-finite constants"),
        ('[["ok", true], ["ok", 4]]', "a bool where an int is expected"),
        ('[["ok", 9.0000001], ["ok", 4]]', "outside float tolerance"),
        ('{"0": ["ok", 9]}', "not a list"),
        ('[["ok", 9]]', "too few outputs"),
        ('[["ok", 1e400], ["ok", 4]]', "overflowing float"),
    ],
)
def test_forged_outputs_are_parsed_as_plain_data_and_never_crash_the_trainer(line: str, why: str) -> None:
    code = f"{FORGE}os.write(fd, b'plexrl-outputs:' + {line.encode()!r} + b'\\n')\nos._exit(0)"
    sandbox = Sandbox(SandboxLimits(timeout_s=5, max_output_bytes=60_000))
    assert code_unit_tests([code], [SQUARE], sandbox=sandbox) == [0.0], why


def test_outputs_are_all_that_counts_however_they_are_printed(small_sandbox: Sandbox) -> None:
    """Forging the channel gains nothing: a program that writes the right outputs has computed them."""
    code = FORGE + 'os.write(fd, b\'plexrl-outputs:[["ok", 9], ["ok", 4.0]]\\n\')\nos._exit(0)'
    assert code_unit_tests([code], [SQUARE], sandbox=small_sandbox) == [1.0]


def test_code_unit_tests_refuses_to_score_in_a_degraded_strict_sandbox(caplog: pytest.LogCaptureFixture) -> None:
    assert verifiers._sandbox().strict  # the verifier's default sandbox
    degraded = Sandbox(SandboxLimits(timeout_s=5), syscall_filter=False, strict=True)
    with pytest.raises(RuntimeError, match="strict sandbox refuses to run code"):
        code_unit_tests(["def square(x): return x * x"], [SQUARE], sandbox=degraded)
    assert code_unit_tests(["x"], ['{"function": "1bad", "cases": []}'], sandbox=degraded) == [0.0]
    too_long = "def square(x): return x * x\n#" + "x" * (1 << 20)  # refused for its size, not for isolation
    assert code_unit_tests([too_long], [SQUARE], sandbox=Sandbox(strict=True)) == [0.0]
    assert "malformed reference" in caplog.text
