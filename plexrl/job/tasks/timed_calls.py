"""`TimedPythonExpression`: `PythonExpression` (plexrl/job/tasks/python_calls.py) whose every call runs code that
takes 0.5-3 s in the sandbox, the latency of a real agent's tool (a test suite, a build, a query), for the
agentic mix (`configs/multiplex_agentic.yaml`, benchmarks/multiplex_agentic.py).

The program waits, then prints the expression's value: `import time; time.sleep(D); print(EXPR)`. The wait D is
drawn from [`min_s`, `max_s`] by a hash of the expression, so the same call waits as long in every run and
every arm of a benchmark (a job's rollouts are seeded, so its calls and their latencies repeat). The code
waits rather than computes: a tool of that length that burned CPU would need cores this 2-core machine lacks
(8 calls at once per tool round, `plexrl.episodes.run_tools`), and on a real cluster it runs on the CPU pool,
not on the accelerator, either way. Use it from YAML by dotted path:
`pipeline: {name: grpo_tools, params: {tool: "plexrl.job.tasks.timed_calls:TimedPythonExpression"}}`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from plexrl.job.tasks.python_calls import PythonExpression
from plexrl.tools.base import ToolSpec


def wait_seconds(expression: str, min_s: float, max_s: float) -> float:
    """The wait of a call of `expression`: uniform in [min_s, max_s] by its hash (the same in every run)."""
    digest = hashlib.blake2b(expression.encode(), digest_size=8).digest()
    return min_s + (max_s - min_s) * int.from_bytes(digest, "big") / 2**64


class TimedPythonExpression(PythonExpression):
    """Tool "timed python expression": one Python expression's value, computed in a fresh sandbox by code that
    first waits `min_s`-`max_s` seconds (see the module docstring). `limits` go to the sandbox; its wall-clock
    limit defaults to `max_s` + 5 s."""

    spec = ToolSpec(
        name="timed_python_expression",
        description="Evaluate one Python expression in an isolated sandbox (0.5-3 s a call) and return its value.",
        arguments=PythonExpression.spec.arguments,
    )

    def __init__(self, *, min_s: float = 0.5, max_s: float = 3.0, max_chars: int = 200, **limits: Any) -> None:
        if not 0 <= min_s <= max_s:
            raise ValueError(f"timed tool: need 0 <= min_s <= max_s, not min_s={min_s}, max_s={max_s}")
        limits.setdefault("timeout_s", max_s + 5.0)
        super().__init__(max_chars=max_chars, **limits)
        self.min_s, self.max_s = min_s, max_s

    def program(self, expression: str) -> str:
        """Wait, then print the expression's value."""
        return f"import time\ntime.sleep({wait_seconds(expression, self.min_s, self.max_s):.3f})\nprint({expression})"


__all__ = ["TimedPythonExpression", "wait_seconds"]
