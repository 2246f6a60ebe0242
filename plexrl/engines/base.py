"""The `Engine` protocol (docs/architecture.md, "Names": engine). No torch import at module level."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor

# loss_fn(minibatch, logprobs [n, L], entropy [n, L]) -> (scalar loss, scalar stats)
LossFn = Callable[[dict[str, "Tensor"], "Tensor", "Tensor"], tuple["Tensor", dict[str, float]]]


@dataclass(slots=True)
class GenerationOutput:
    """N = P*n generated sequences, rows grouped by prompt.

    - `prompt_ids` [N, Lp] left-padded prompts, `prompt_mask` [N, Lp];
    - `response_ids` [N, T] right-padded with pad, `response_mask` [N, T] 1 up to and including eos;
    - `logprobs` [N, T] log-prob of each sampled token under the sampling distribution (0 on padding);
    - `lengths` [N]; `finish_reasons` "stop" (eos or a stop token sampled) or "length".
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    logprobs: Tensor
    lengths: Tensor
    finish_reasons: list[str]


class Engine(Protocol):
    """Runs model functions of ONE job's state at a time. Implementations: `TorchEngine`, `VLLMEngine`."""

    weight_version: int

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        max_new_tokens: int,
        seed: int,
        greedy: bool = False,
        stop_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> GenerationOutput:
        """Sample `n` responses per prompt from the nucleus `top_p` of the `top_k` likeliest tokens (0: all) at
        `temperature` (`greedy`: argmax). A
        response ends at eos, at any of `stop_token_ids`, or once its decoded text contains one of the `stop`
        strings (the stop token / the token completing the string is part of the response, masked in, finish
        reason "stop"), or after `max_new_tokens`. Same seed, same weights -> same samples."""
        ...

    def logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, *, temperature: float = 1.0, which: str = "policy"
    ) -> Tensor: ...

    def train_step(
        self,
        batch: dict[str, Tensor],
        loss_fn: LossFn,
        *,
        temperature: float,
        lr: float,
        weight_decay: float,
        max_grad_norm: float,
        minibatches: int,
        epochs: int,
        betas: tuple[float, float],
    ) -> dict[str, float]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...

    def export_state(self) -> dict[str, Any]: ...
