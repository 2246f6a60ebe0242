"""The calls of a session as they travel to its service: plain records of numpy arrays and numbers, already
checked by the server (shapes, dtypes, token ids, sizes: `plexrl/server/tinker/decode.py`) and checked again
where they run (`engine.SessionEngine`), and the reply each call sends back.

One call is one node of the session's open plan; the node's name is the call's `kind` (the planner's cost
model learns each kind's time apart). A call that the service refuses (a user error found only there, such
as an optimizer step with no gradient) changes nothing and comes back as a `Reply` with `error`; the node
itself still ends well, so the session goes on. An exception that escapes (an engine failure) fails the node,
and with it the session, like any job's node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

CallKind = Literal["forward_backward", "forward", "optim_step", "sample", "save", "load"]
CALL_KINDS: tuple[CallKind, ...] = ("forward_backward", "forward", "optim_step", "sample", "save", "load")
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")  # the built-in losses (`losses.py`)


@dataclass(frozen=True, slots=True)
class Datum:
    """One training sequence: `tokens` int64 [N] (the model input) and the loss inputs by name, each [N] (a
    `cross_entropy` `target_tokens` / `weights` pair may be [N, K]). Position i predicts `target_tokens[i]`."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class ForwardBackward:
    """`forward_backward` (`backward` True: gradients are added to the session's accumulated ones) or
    `forward` (False: nothing changes) of `loss` over `data`, with the loss's numeric `config`."""

    data: tuple[Datum, ...]
    loss: str
    config: dict[str, float] = field(default_factory=dict)
    backward: bool = True

    @property
    def kind(self) -> CallKind:
        return "forward_backward" if self.backward else "forward"


@dataclass(frozen=True, slots=True)
class OptimStep:
    """One AdamW step on the accumulated gradients (decoupled weight decay; `grad_clip_norm` 0: no clipping)."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    kind: CallKind = "optim_step"


@dataclass(frozen=True, slots=True)
class Sample:
    """`num_samples` completions of `prompt` (at most `max_tokens` each), or with `prompt_logprobs` also the
    prompt's log-probs (the last `prompt_logprobs_last_n` only, when set). `weights`: a sampler snapshot file
    (`Save(what="sampler")`) and `weights_id`, the weights it holds; the live weights serve when they are still
    those (`SessionEngine.weights_id`), else the snapshot is loaded for the call and the live weights put back."""

    prompt: tuple[int, ...]
    num_samples: int
    max_tokens: int
    seed: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_strings: tuple[str, ...] = ()
    stop_tokens: tuple[int, ...] = ()
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None
    top_k: int = 0  # sample among the k likeliest tokens (0: all)
    topk_prompt_logprobs: int = 0  # the k likeliest tokens and their log-probs at each prompt position (0: none)
    weights: str | None = None
    weights_id: str | None = None
    kind: CallKind = "sample"

    def joins(self, other: Any) -> bool:
        """Whether `other`, the same session's next waiting call, may run with this one as ONE engine call
        (`Samples`, `plexrl/runtime/calls.py`'s `take`): a sample call of the same weights."""
        return isinstance(other, Sample) and (other.weights, other.weights_id) == (self.weights, self.weights_id)

    @staticmethod
    def bundle(calls: tuple[Any, ...]) -> Samples:
        return Samples(calls)


@dataclass(frozen=True, slots=True)
class Samples:
    """Several sample calls of ONE session, of the same weights, that waited together (its client sent them at
    once): they run as one engine call, each getting what it gets alone; the reply holds one reply per call
    (`value["replies"]`, in order: the board hands each its own)."""

    calls: tuple[Sample, ...]
    kind: CallKind = "sample"


@dataclass(frozen=True, slots=True)
class Save:
    """Write the session's state (`state`: trained weights, optimizer, accumulated gradients) or its trained
    weights alone (`sampler`: what a sampling client reads) to `path`, atomically."""

    path: str
    what: Literal["state", "sampler"]
    kind: CallKind = "save"


@dataclass(frozen=True, slots=True)
class Load:
    """Replace the session's trained weights (and, `optimizer`, its optimizer state) with a saved state's."""

    path: str
    optimizer: bool
    kind: CallKind = "load"


Call = ForwardBackward | OptimStep | Sample | Samples | Save | Load


@dataclass(slots=True)
class Reply:
    """What a call sends back: `value` (plain numbers, lists and numpy arrays), or `error`, a user error the
    service found (nothing was changed), with `metrics` for the session's run (per call: its MLflow row)."""

    value: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


ARRAY = "__ndarray__"  # the key of an array packed by `pack`


def call_bytes(call: Call) -> int:
    """The bytes of a call's decoded arrays (a forward_backward's datums; 0 for the others, whose inputs are
    small): what the server holds for it until it runs."""
    if not isinstance(call, ForwardBackward):
        return 0
    return sum(d.tokens.nbytes + sum(a.nbytes for a in d.inputs.values()) for d in call.data)


def pack(obj: Any) -> Any:
    """A reply as msgpack-able plain data (what a Dask worker's event may carry): every numpy array becomes
    `{ARRAY: [dtype, shape, bytes]}`; dicts, lists, numbers, strings and None stay. `unpack` reverses it."""
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return {ARRAY: [arr.dtype.str, list(arr.shape), arr.tobytes()]}
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [pack(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def unpack(obj: Any) -> Any:
    """What `pack` packed, with its arrays back."""
    if isinstance(obj, dict):
        if set(obj) == {ARRAY}:
            dtype, shape, data = obj[ARRAY]
            return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):  # (msgpack may give tuples back)
        return [unpack(v) for v in obj]
    return obj


__all__ = [
    "ARRAY",
    "CALL_KINDS",
    "LOSSES",
    "Call",
    "CallKind",
    "Datum",
    "ForwardBackward",
    "Load",
    "OptimStep",
    "Reply",
    "Sample",
    "Samples",
    "Save",
    "call_bytes",
    "pack",
    "unpack",
]
