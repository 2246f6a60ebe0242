"""Verifiers: pure, batched reward functions over model completions.

Each takes a batch of completions and a batch of references of the same length and returns one score per
sample: 1.0 (correct), 0.0 (wrong, or unreadable model output) or None (not applicable: no reference). They
never raise on malformed model output and keep no state; a length mismatch between the batches is a caller
bug and raises ValueError. `code_unit_tests` runs model code, always in the `Sandbox`, and decides outside it.

Not done here: partial credit, format rewards, or anything that needs the trainer (see operators/verify.py).
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from plexrl.tools.sandbox import Sandbox, SandboxLimits

log = logging.getLogger(__name__)

Scores = list[float | None]
MAX_COMPLETION_CHARS = 20_000  # math parsing looks at the last this many characters
MAX_EXPONENT = 100_000  # math_answer refuses (scores 0.0) powers and factorials beyond this off the main thread

_NUMBER = r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+−]?\.\d+(?:[eE][-+]?\d+)?"
_NUMBER_RE = re.compile(rf"(?<![\w.])(?:{_NUMBER})(?:\s*/\s*(?:\d+))?")
_BOXED_RE = re.compile(r"\\boxed\s*\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")
_MARKED_RE = re.compile(r"(?:####|answer\s*(?:is|:)|=)\s*\$?\s*([^\n$]*)", re.IGNORECASE)
_CODE_RE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def _check_lengths(completions: Sequence[Any], references: Sequence[Any]) -> None:
    if len(completions) != len(references):
        raise ValueError(
            f"{len(completions)} completions but {len(references)} references: pass one reference per completion"
        )


def parse_number(text: str) -> float | None:
    """A number written as an int, a float, with thousands commas, or as a fraction a/b; None if not one.

    >>> parse_number("1,234.5"), parse_number("-3/4"), parse_number("seven")
    (1234.5, -0.75, None)
    """
    match = _NUMBER_RE.fullmatch(text.strip().rstrip(".").replace("−", "-").replace("$", "").strip())
    if match is None:
        return None
    num, _, den = match.group(0).partition("/")
    try:
        value = float(num.replace(",", ""))
        if den:
            value /= float(den)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def final_number(completion: str) -> float | None:
    """The completion's answer as a number: the last \\boxed{...}, else the last 'answer is' / '####' / '=' mark,
    else the last number in the text. None when there is none.

    >>> final_number("3 + 4 = 7, so the answer is \\\\boxed{7}.")
    7.0
    >>> final_number("We get 12 apples and 1,000 pears")
    1000.0
    """
    if not isinstance(completion, str):
        return None
    for pattern in (_BOXED_RE, _MARKED_RE):
        for candidate in reversed(pattern.findall(completion)):
            numbers = _NUMBER_RE.findall(candidate)
            value = parse_number(candidate)
            if value is None and len(numbers) == 1:
                value = parse_number(numbers[0])
            if value is not None:
                return value
    numbers = _NUMBER_RE.findall(completion)
    return parse_number(numbers[-1]) if numbers else None


def exact_numeric(
    completions: Sequence[str],
    answers: Sequence[str | float | int | None],
    *,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
) -> Scores:
    """1.0 where the completion's final number equals the answer within tolerance, 0.0 otherwise, None where
    the answer is None. Answers may be numbers or text such as "1,234" or "3/4".

    >>> exact_numeric(["so it is \\\\boxed{1,234}", "#### 0.5", "no idea", "42"], ["1234", "1/2", "3", None])
    [1.0, 1.0, 0.0, None]
    """
    _check_lengths(completions, answers)
    scores: Scores = []
    for completion, answer in zip(completions, answers, strict=True):
        if answer is None:
            scores.append(None)
            continue
        expected = float(answer) if isinstance(answer, int | float) else parse_number(str(answer))
        got = final_number(completion)
        if expected is None:
            log.warning("exact_numeric: reference answer %r is not a number; scored 0.0", answer)
        ok = expected is not None and got is not None and math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol)
        scores.append(1.0 if ok else 0.0)
    return scores


class _QuietTimeoutNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def _bounded(expressions: Sequence[Any]) -> bool:
    """False when a parsed answer holds a power or factorial too large to compare without a timeout."""
    import sympy

    for expr in expressions:
        if not isinstance(expr, sympy.Basic):
            continue
        for node in sympy.preorder_traversal(expr):
            if isinstance(node, sympy.Pow):
                exp = node.exp
                if exp.has(sympy.Pow, sympy.factorial) and exp.is_number:
                    return False
                if exp.is_Number and abs(exp) > MAX_EXPONENT:
                    return False
            if isinstance(node, sympy.factorial) and node.args[0].is_Number and node.args[0] > MAX_EXPONENT:
                return False
    return True


def math_answer(completions: Sequence[str], answers: Sequence[str | None], *, timeout_s: int = 5) -> Scores:
    """1.0 where the completion's final answer is mathematically equal to the reference (math-verify: \\boxed{},
    LaTeX, fractions, equivalent expressions, sets, intervals), 0.0 otherwise, None where the answer is None.

    Timeouts: on the main thread each parse and comparison is cut at `timeout_s` (SIGALRM); on other threads
    signals are unavailable, so answers with huge powers or factorials are scored 0.0 without being compared.

    >>> math_answer(["The answer is $\\\\boxed{\\\\frac{1}{2}}$", "so $x = \\\\boxed{2\\\\sqrt{2}}$", "5"],
    ...             ["0.5", "\\\\sqrt{8}", None])
    [1.0, 1.0, None]
    """
    _check_lengths(completions, answers)
    import math_verify

    main = threading.current_thread() is threading.main_thread()
    timeout = timeout_s if main else None
    scores: Scores = []
    for completion, answer in zip(completions, answers, strict=True):
        if answer is None:
            scores.append(None)
            continue
        if not isinstance(completion, str) or not completion.strip():
            scores.append(0.0)
            continue
        gold_text = str(answer) if "$" in str(answer) or "\\boxed" in str(answer) else f"${answer}$"
        try:
            gold = math_verify.parse(gold_text, parsing_timeout=timeout)
            pred = math_verify.parse(completion[-MAX_COMPLETION_CHARS:], parsing_timeout=timeout)
            if not gold:
                log.warning("math_answer: cannot parse reference answer %r; scored 0.0", answer)
            ok = bool(gold and pred and (main or (_bounded(gold) and _bounded(pred))))
            ok = ok and math_verify.verify(gold, pred, timeout_seconds=timeout)
        except Exception as exc:  # math-verify and sympy raise many types on odd input; never fail the batch
            log.debug("math_answer: %s on %r", exc, completion[:200])
            ok = False
        scores.append(1.0 if ok else 0.0)
    return scores


for _name in ("math_verify.parser", "math_verify.grader"):  # we do bound the work off the main thread: _bounded
    logging.getLogger(_name).addFilter(_QuietTimeoutNotice())


def extract_code(completion: str) -> str:
    """The program in a completion: the last ```python fenced block, else the whole text.

    >>> extract_code("Here:\\n```python\\nprint(1)\\n```\\nDone.")
    'print(1)\\n'
    """
    blocks = _CODE_RE.findall(completion)
    return blocks[-1] if blocks else completion


_default_sandbox: Sandbox | None = None
_sandbox_lock = threading.Lock()
_OUTPUTS_MARK = "plexrl-outputs:"
_IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]*$"


def _sandbox() -> Sandbox:
    global _default_sandbox
    with _sandbox_lock:
        if _default_sandbox is None:
            _default_sandbox = Sandbox(SandboxLimits(timeout_s=10, cpu_s=10), strict=True)
        return _default_sandbox


class UnitCase(BaseModel):
    """One input/output example: `function(*args)` must return `expected`."""

    model_config = ConfigDict(extra="forbid")

    args: list[Any] = Field(description="positional arguments: plain JSON data (numbers, strings, lists, ...)")
    expected: Any = Field(description="the return value the function must give: plain JSON data")


class UnitTests(BaseModel):
    """The reference of `code_unit_tests`: a function name and its cases. Only `args` enter the sandbox; the
    expected values stay with the caller."""

    model_config = ConfigDict(extra="forbid")

    function: str = Field(pattern=_IDENTIFIER, description="name of the function the completion must define")
    cases: list[UnitCase] = Field(min_length=1, description="input/output examples, all of which must pass")


def unit_tests(function: str, cases: Sequence[tuple[Sequence[Any], Any]]) -> str:
    """The reference string for `code_unit_tests` (JSON of `UnitTests`) from `(args, expected)` pairs.

    >>> unit_tests("add", [((2, 3), 5)])
    '{"function":"add","cases":[{"args":[2,3],"expected":5}]}'
    """
    parsed = UnitTests(function=function, cases=[UnitCase(args=list(a), expected=e) for a, e in cases])
    return parsed.model_dump_json()


_HARNESS = """\
import json, math, os, sys
_SOURCE, _FUNCTION, _INPUTS = {source!r}, {function!r}, json.loads({inputs!r})
def _plain(value, depth=0):
    kind = type(value)
    if depth > 100:
        raise ValueError("nested too deep")
    if value is None or kind in (bool, int, str) or (kind is float and math.isfinite(value)):
        return value
    if kind in (list, tuple):
        return [_plain(v, depth + 1) for v in value]
    if kind is dict and all(type(k) is str for k in value):
        return {{k: _plain(v, depth + 1) for k, v in value.items()}}
    raise TypeError(f"returned {{kind.__name__}}, which is not plain data")
_stdout = os.dup(1)
os.dup2(2, 1)  # what the candidate prints goes to stderr; stdout carries the outputs only
_namespace = {{"__name__": "solution"}}
exec(compile(_SOURCE, "solution.py", "exec"), _namespace)
_results = []
for _args in _INPUTS:
    try:
        _results.append('["ok", ' + json.dumps(_plain(_namespace[_FUNCTION](*_args))) + "]")
    except Exception as _exc:
        _results.append(json.dumps(["error", type(_exc).__name__]))
sys.stdout.flush()
os.dup2(_stdout, 1)
os.write(1, ({mark!r} + "[" + ", ".join(_results) + "]\\n").encode())
"""


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not plain data")


def _same(got: Any, want: Any) -> bool:
    """Structural equality of plain JSON data: bools only equal bools, numbers compare by value (floats within
    1e-9 relative), strings, None, lists and string-keyed dicts element by element; nothing else is equal."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, int | float) and isinstance(got, int | float):
        if isinstance(want, int) and isinstance(got, int):
            return got == want
        try:
            return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)
        except OverflowError:
            return False
    if want is None or isinstance(want, str):
        return type(got) is type(want) and got == want
    if isinstance(want, list):
        return type(got) is list and len(got) == len(want) and all(map(_same, got, want))
    if isinstance(want, dict):
        return type(got) is dict and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return False


def _outputs(stdout: str) -> list[Any] | None:
    """The harness's outputs line parsed as plain JSON data, or None when there is none or it is not valid."""
    lines = stdout.rstrip("\n").rsplit("\n", 1)
    if not lines[-1].startswith(_OUTPUTS_MARK):
        return None
    try:
        outputs = json.loads(lines[-1][len(_OUTPUTS_MARK) :], parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    return outputs if isinstance(outputs, list) else None


def code_unit_tests(
    completions: Sequence[str],
    tests: Sequence[str | UnitTests | None],
    *,
    sandbox: Sandbox | None = None,
    max_workers: int = 4,
) -> Scores:
    """1.0 where the function the completion's code defines returns the expected value on every case of its
    `UnitTests` (a JSON string from `unit_tests`, or the model), 0.0 where any case differs, raises, returns
    something that is not plain data, or the run fails or exceeds a limit; None where the tests are None.

    The verdict is computed here, outside the sandbox: the sandbox runs the candidate on the cases' inputs and
    prints its return values as JSON; they are parsed as plain data and compared with the expected values,
    which never enter the sandbox. Nothing the code does inside (reading the harness, patching `__eq__`,
    exit hooks, printing fake results) can raise its score above that of a program that computes those
    outputs. Runs up to `max_workers` sandboxes at once; the default sandbox is strict, and a strict sandbox
    that refuses to run (degraded isolation) raises RuntimeError instead of scoring every sample 0.0. A
    malformed reference scores 0.0 with a warning.

    >>> tests = unit_tests("add", [((2, 3), 5), ((0, -1), -1)])
    >>> code_unit_tests(["```python\\ndef add(a, b):\\n    return a + b\\n```", "def add(a, b): return a - b", "x"],
    ...                 [tests, tests, None])
    [1.0, 0.0, None]
    """
    _check_lengths(completions, tests)
    box = sandbox or _sandbox()

    def score(item: tuple[Any, str | UnitTests | None]) -> float | None:
        completion, reference = item
        if reference is None:
            return None
        try:
            spec = reference if isinstance(reference, UnitTests) else UnitTests.model_validate_json(reference)
        except ValueError as exc:
            log.warning("code_unit_tests: malformed reference %r (%s); scored 0.0", str(reference)[:200], exc)
            return 0.0
        if not isinstance(completion, str):
            return 0.0
        inputs = json.dumps([case.args for case in spec.cases])
        program = _HARNESS.format(
            source=extract_code(completion), function=spec.function, inputs=inputs, mark=_OUTPUTS_MARK
        )
        result = box.run(program)
        if result.refused:
            raise RuntimeError(f"code_unit_tests: the strict sandbox refuses to run code here: {result.error}")
        outputs = _outputs(result.stdout) if result.ok else None
        if outputs is None or len(outputs) != len(spec.cases):
            return 0.0
        passed = all(
            isinstance(out, list) and len(out) == 2 and out[0] == "ok" and _same(out[1], case.expected)
            for out, case in zip(outputs, spec.cases, strict=True)
        )
        return 1.0 if passed else 0.0

    items = list(zip(completions, tests, strict=True))
    if len(items) <= 1 or max_workers <= 1:
        return [score(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items)), thread_name_prefix="unit-tests") as pool:
        return list(pool.map(score, items))
