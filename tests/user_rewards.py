"""A user's own rewards, outside the project, named by the reward tests as `user_rewards:<name>`.

They run in reward worker processes, which import this module: it imports only what a user's reward module
would (not pytest, not the tests), so a worker starts as fast as it does for a user. A "hang" is a real one
(the worker is killed at the term's timeout_s).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from typing import Any

from plexrl.rewards import batched_reward
from plexrl.roles import declare

# What a reward worker must not import: a worker starts in a fraction of a second only without them.
HEAVY = (
    "pytest", "numpy", "torch", "transformers", "networkx", "dask", "distributed", "mlflow", "fastapi",
    "plexrl.graph", "plexrl.planner", "plexrl.runtime", "plexrl.engines", "plexrl.services", "plexrl.server",
)  # fmt: skip


@declare("reward")
def heavy_modules(prompt: str, response: str, ground_truth: str, extra: dict[str, Any]) -> dict[str, float]:
    """1.0 for each of HEAVY that the worker running this call has imported."""
    return {name: float(name in sys.modules) for name in HEAVY}


@declare("reward")
def length_bonus(
    prompt: str, response: str, ground_truth: str, extra: dict[str, Any], *, per_char: float = 0.1
) -> float:
    return per_char * len(response) + (1.0 if extra.get("bonus") else 0.0) + (100.0 if prompt == "p1" else 0.0)


@declare("reward")
def pid(prompt: str, response: str, ground_truth: str, extra: dict[str, Any]) -> float:
    return float(os.getpid())


@declare("reward")
def parts(prompt: str, response: str, ground_truth: str, extra: dict[str, Any]) -> dict[str, float]:
    return {"correct": float(response.strip() == ground_truth), "short": -0.5 * (len(response) > 3)}


@declare("reward")
def raises_on_x(prompt: str, response: str, ground_truth: str, extra: dict[str, Any]) -> float:
    if "x" in response:
        raise RuntimeError("cannot score x")
    return 1.0


@declare("reward")
def hangs_on_h(prompt: str, response: str, ground_truth: str, extra: dict[str, Any]) -> float:
    if "h" in response:
        threading.Event().wait()  # for ever: only a kill ends it
    return 1.0


@declare("reward")
def backtracks_on_h(prompt: str, response: str, ground_truth: str, extra: dict[str, Any]) -> float:
    if "h" in response:  # Python's `re` backtracks for minutes here and holds the GIL all along
        re.match(r"(a|aa)*b", "a" * 45)
    return 0.5


@declare("reward")
def equal(prompt: str, response: str, ground_truth: str, extra: dict[str, Any]) -> float:
    return float(response == ground_truth)


@declare("reward")
def not_a_number(prompt: str, response: str, ground_truth: str, extra: dict[str, Any]) -> Any:
    return {"nan": float("nan")} if response == "nan" else "one"


@batched_reward
def batch_equal(
    prompts: list[str], responses: list[str], truths: list[str], extras: list[dict[str, Any]]
) -> list[float]:
    return [float(r == t) for r, t in zip(responses, truths, strict=True)]


@batched_reward
def batch_wrong_length(prompts: list[str], responses: list[str], truths: list[str], extras: list[Any]) -> list[float]:
    return [1.0]


def undeclared(prompt: str, response: str, ground_truth: str, extra: dict[str, Any]) -> float:
    return 1.0


@declare("tool")
def a_tool() -> None:
    return None


@batched_reward
def batch_hangs(prompts: list[str], responses: list[str], truths: list[str], extras: list[Any]) -> list[float]:
    threading.Event().wait()
    return [1.0] * len(responses)
