"""Verifiers: pure, batched reward functions over model completions.

Each takes a batch of completions and a batch of references of the same length and returns one score per
sample: 1.0 (correct), 0.0 (wrong, or unreadable model output) or None (not applicable: no reference). They
never raise on malformed model output and keep no state; a length mismatch between the batches is a caller
bug and raises ValueError. `code_unit_tests` runs model code, always in the `Sandbox`.

Not done here: partial credit, format rewards, or anything that needs the trainer (see operators/verify.py).
"""

from __future__ import annotations

import logging
import math
import re
import secrets
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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


def _sandbox() -> Sandbox:
    global _default_sandbox
    with _sandbox_lock:
        if _default_sandbox is None:
            _default_sandbox = Sandbox(SandboxLimits(timeout_s=10, cpu_s=10))
        return _default_sandbox


def code_unit_tests(
    completions: Sequence[str], tests: Sequence[str | None], *, sandbox: Sandbox | None = None, max_workers: int = 4
) -> Scores:
    """1.0 where the completion's code followed by its unit tests (plain asserts, or anything that exits
    non-zero on failure) runs to completion in the sandbox, 0.0 if any fails, crashes, exits early or exceeds
    a limit, None where the tests are None. Runs up to `max_workers` sandboxes at once.

    "Runs to completion" is checked by a random token printed after the tests. Code that reads its own source
    to find the token can still fake a pass: this guards against accidents, not a policy set on cheating.

    >>> code_unit_tests(["```python\\ndef add(a, b):\\n    return a + b\\n```", "def add(a, b): return a - b", "x"],
    ...                 ["assert add(2, 3) == 5", "assert add(2, 3) == 5", None])
    [1.0, 0.0, None]
    """
    _check_lengths(completions, tests)
    box = sandbox or _sandbox()

    def score(item: tuple[Any, str | None]) -> float | None:
        completion, test = item
        if test is None:
            return None
        if not isinstance(completion, str):
            return 0.0
        nonce = secrets.token_hex(16)  # an early sys.exit(0) in the model's code must not pass the tests
        result = box.run(f"{extract_code(completion)}\n\n{test}\n\nprint({nonce!r})\n")
        return 1.0 if result.ok and result.stdout.rstrip("\n").endswith(nonce) else 0.0

    items = list(zip(completions, tests, strict=True))
    if len(items) <= 1 or max_workers <= 1:
        return [score(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items)), thread_name_prefix="unit-tests") as pool:
        return list(pool.map(score, items))
