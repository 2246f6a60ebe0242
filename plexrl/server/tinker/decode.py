"""From what a Tinker client sends to the calls a session's service runs (`plexrl.sessions.calls`), checked
before anything is queued: tensor encodings (dense or CSR, dtype, shape against the bytes), token ids against
the model's vocabulary, lengths against its context, every size against the server's limits, and the loss's
inputs and config. A problem raises `Refused` with the HTTP status and a sentence naming the field and the
fix; nothing is queued then, so nothing changes."""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plexrl.server.tinker.config import TinkerConfig
from plexrl.server.tinker.proto import WireForwardBackward, WireTensor
from plexrl.sessions import losses
from plexrl.sessions.calls import Datum, ForwardBackward, OptimStep, Sample

MAX_DIMS = 2
VALUES_PER_TOKEN = 16  # loss-input values of one call, all inputs together, per max_tokens_per_call token
MIN_TEMPERATURE = 1e-6  # a sample's temperature below this is served as 0 (greedy)


class Refused(Exception):
    """A request the server will not take: `status` (4xx) and the reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    @property
    def retried(self) -> bool:
        """Whether the tinker SDK sends the same request again on this status (408, 409, 429, 5xx)."""
        return self.status in (408, 409, 429) or self.status >= 500


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the model allows: its vocabulary and context length (positions)."""

    vocab: int
    context: int


def model_limits(model_dir: Path) -> ModelLimits:
    """The limits of the model in `model_dir` (its config.json)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return ModelLimits(int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings", 2048)))


def tensor(name: str, t: WireTensor, max_elements: int) -> np.ndarray:
    """A wire tensor as a numpy array (float32 or int64), densified when sent as CSR (absent cells 0)."""
    if t.dtype not in ("float32", "int64", "int32"):
        raise Refused(400, f"input {name!r}: dtype {t.dtype} is not served; send float32 or int64")
    if not 1 <= len(t.shape) <= MAX_DIMS or any(d < 0 for d in t.shape):
        raise Refused(400, f"input {name!r}: shape {t.shape} must have 1 or 2 non-negative dimensions")
    count = math.prod(t.shape)
    if count > max_elements:
        raise Refused(413, f"input {name!r}: {count} values exceed this server's {max_elements} per call")
    kind = np.dtype("<f4") if t.dtype == "float32" else np.dtype("<i4") if t.dtype == "int32" else np.dtype("<i8")
    want = np.float32 if t.dtype == "float32" else np.int64
    if t.dense is not None and t.values is None:
        if len(t.dense) != count * kind.itemsize:
            raise Refused(400, f"input {name!r}: {len(t.dense)} bytes do not hold shape {t.shape} of {t.dtype}")
        return np.frombuffer(t.dense, dtype=kind).astype(want).reshape(t.shape)
    return _csr(name, t, kind, want)


def _csr(name: str, t: WireTensor, kind: np.dtype, want: type) -> np.ndarray:
    if len(t.shape) != 2 or t.crow is None or t.col is None or t.values is None:
        raise Refused(400, f"input {name!r}: a sparse (CSR) tensor needs 2 dimensions, row pointers and columns")
    rows, cols = t.shape
    if len(t.crow) != 8 * (rows + 1) or len(t.col) % 8 or len(t.values) != (len(t.col) // 8) * kind.itemsize:
        raise Refused(400, f"input {name!r}: CSR parts of inconsistent lengths for shape {t.shape}")
    crow = np.frombuffer(t.crow, dtype="<i8")
    col = np.frombuffer(t.col, dtype="<i8")
    nnz = len(col)
    if crow[0] != 0 or crow[-1] != nnz or (np.diff(crow) < 0).any() or (nnz and (col.min() < 0 or col.max() >= cols)):
        raise Refused(400, f"input {name!r}: CSR row pointers or column indices out of range for shape {t.shape}")
    out: np.ndarray = np.zeros((rows, cols), dtype=want)
    values: np.ndarray = np.frombuffer(t.values, dtype=kind).astype(want)
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    out[row_of, col] = values
    return out


def tokens_of(chunks: list[tuple[str, bytes]], where: str) -> np.ndarray:
    """The token ids of a model input sent as protobuf chunks (encoded text only)."""
    parts = []
    for kind, data in chunks:
        if kind != "encoded_text":
            raise Refused(400, f"{where}: {kind} chunks are not served by PlexRL; send token ids (encoded_text)")
        if len(data) % 4:
            raise Refused(400, f"{where}: the tokens of a chunk are not whole int32 values")
        parts.append(np.frombuffer(data, dtype="<i4").astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def json_tokens(model_input: Any, where: str) -> list[int]:
    """The token ids of a JSON `ModelInput` ({"chunks": [{"type": "encoded_text", "tokens": [...]}]})."""
    if not isinstance(model_input, dict) or not isinstance(model_input.get("chunks"), list):
        raise Refused(400, f"{where} must be a ModelInput: {{'chunks': [{{'type': 'encoded_text', 'tokens': [...]}}]}}")
    out: list[int] = []
    for chunk in model_input["chunks"]:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise Refused(400, f"{where}: {kind} chunks are not served by PlexRL; send token ids (encoded_text)")
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in tokens):
            raise Refused(400, f"{where}: a chunk's tokens must be a list of integers")
        out.extend(tokens)
    return out


def forward_backward(wire: WireForwardBackward, limits: ModelLimits, cfg: TinkerConfig) -> ForwardBackward:
    """The call of a decoded forward_backward request (`wire.forward_only`: a forward)."""
    if wire.loss_fn not in losses.REQUIRED:
        served = ", ".join(losses.REQUIRED)
        why = "custom losses run client-side in the SDK (forward_backward_custom)" if wire.loss_fn == "custom" else ""
        raise Refused(400, f"loss_fn {wire.loss_fn!r} is not served by PlexRL; it serves {served}" + (
            f"; {why}" if why else ""))  # fmt: skip
    if not wire.data:
        raise Refused(400, "forward_backward needs at least one datum")
    if len(wire.data) > cfg.max_datums:
        raise Refused(413, f"{len(wire.data)} datums exceed this server's max_datums ({cfg.max_datums}) per call")
    config: dict[str, float] = {}
    for key, value in wire.config.items():
        if isinstance(value, str):
            raise Refused(400, f"loss_fn_config {key!r}: PlexRL's losses take numbers only")
        config[key] = float(value)
    problem = losses.check_config(wire.loss_fn, config)
    if problem is not None:
        raise Refused(400, problem)
    data: list[Datum] = []
    total = 0
    budget = VALUES_PER_TOKEN * cfg.max_tokens_per_call  # loss-input values of the whole call, CSR densified
    for i, d in enumerate(wire.data):
        where = f"datum {i}"
        # (provenance spans, which the cookbook's RL trainer attaches to every datum, are taken and not checked:
        # only stable_reinforce, not served, reads them)
        tokens = tokens_of(d.chunks, f"{where} model_input")
        total += len(tokens)
        if total > cfg.max_tokens_per_call:
            raise Refused(413, f"the datums exceed this server's max_tokens_per_call ({cfg.max_tokens_per_call})")
        if not len(tokens):
            raise Refused(400, f"{where}: an empty model input")
        if len(tokens) > limits.context:
            raise Refused(400, f"{where}: {len(tokens)} tokens exceed the model's context of {limits.context}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= limits.vocab:
            raise Refused(400, f"{where}: model input token ids must lie in [0, {limits.vocab})")
        inputs = {}
        for k, t in d.inputs.items():
            if not t.shape or any(x < 0 for x in t.shape):
                raise Refused(400, f"input {where} {k!r}: shape {t.shape} must have 1 or 2 non-negative dimensions")
            budget -= math.prod(t.shape)
            if budget < 0:
                raise Refused(413, f"{where} {k!r}: the loss inputs of this call exceed this server's "
                                   f"{VALUES_PER_TOKEN} values per token of max_tokens_per_call "
                                   f"({VALUES_PER_TOKEN * cfg.max_tokens_per_call}); send fewer or narrower "
                                   "inputs (a [N, K] target's K), or raise tinker.max_tokens_per_call")  # fmt: skip
            inputs[k] = tensor(f"{where} {k}", t, VALUES_PER_TOKEN * cfg.max_tokens_per_call)
        for k in list(inputs):  # integer weights or advantages are numbers too
            if k not in losses.INT_INPUTS and inputs[k].dtype == np.int64:
                inputs[k] = inputs[k].astype(np.float32)
        problem = losses.check(wire.loss_fn, inputs, len(tokens), limits.vocab)
        if problem is not None:
            raise Refused(400, f"{where}: {problem}")
        data.append(Datum(tokens, inputs))
    return ForwardBackward(tuple(data), wire.loss_fn, config, backward=not wire.forward_only)


def optim_step(params: Any) -> OptimStep:
    """The AdamW step of an optim_step request's `adam_params` (Adam only)."""
    if not isinstance(params, dict) or params.get("type") not in (None, "adamw"):
        raise Refused(400, "optim_step: PlexRL serves AdamParams only (no other optimizer family)")
    try:
        step = OptimStep(
            learning_rate=float(params.get("learning_rate", 1e-4)), beta1=float(params.get("beta1", 0.9)),
            beta2=float(params.get("beta2", 0.95)), eps=float(params.get("eps", 1e-12)),
            weight_decay=float(params.get("weight_decay", 0.0)),
            grad_clip_norm=float(params.get("grad_clip_norm", 0.0)),
        )  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise Refused(400, f"optim_step: adam_params must be numbers ({exc})") from None
    numbers = (step.learning_rate, step.beta1, step.beta2, step.eps, step.weight_decay, step.grad_clip_norm)
    if not all(math.isfinite(x) for x in numbers) or step.learning_rate < 0 or step.eps <= 0:
        raise Refused(400, "optim_step: learning_rate >= 0 and eps > 0, all finite")
    if not (0 <= step.beta1 < 1 and 0 <= step.beta2 < 1) or step.weight_decay < 0 or step.grad_clip_norm < 0:
        raise Refused(400, "optim_step: betas in [0, 1), weight_decay >= 0, grad_clip_norm >= 0")
    return step


MAX_TOPK_LOGPROBS = 64  # the largest topk_prompt_logprobs served (a [prompt, K] answer)
UNSERVED_SAMPLE_FIELDS = {
    "topk_sample_logprobs": 0,
    "target_prompt_logprobs": None,
    "prompt_alt_tokens_k": 0,
    "record_stability_info": False,
}


def sample(body: dict[str, Any], limits: ModelLimits, cfg: TinkerConfig, seed: int) -> Sample:
    """The call of an asample request (after the server resolved which weights it samples). `seed`: the
    sampling seed when the request names none (the server derives it from the session and the request)."""
    for name, default in UNSERVED_SAMPLE_FIELDS.items():
        if body.get(name, default) not in (default, None):
            raise Refused(400, f"sample: {name} is not served by PlexRL; leave it at its default")
    prompt = json_tokens(body.get("prompt"), "sample prompt")
    if not prompt:
        raise Refused(400, "sample: the prompt is empty")
    if min(prompt) < 0 or max(prompt) >= limits.vocab:
        raise Refused(400, f"sample: prompt token ids must lie in [0, {limits.vocab})")
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise Refused(400, "sample: sampling_params is required")
    n = body.get("num_samples", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= cfg.max_samples:
        raise Refused(400 if isinstance(n, int) and n < 1 else 413,
                      f"sample: num_samples must be 1..{cfg.max_samples} on this server")  # fmt: skip
    max_tokens = params.get("max_tokens")
    if max_tokens is None:
        max_tokens = min(cfg.max_sample_tokens, max(limits.context - len(prompt), 1))
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= cfg.max_sample_tokens:
        raise Refused(413, f"sample: max_tokens must be 1..{cfg.max_sample_tokens} on this server")
    if len(prompt) + max_tokens > limits.context:
        raise Refused(400, f"sample: prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceed the model's "
                           f"context of {limits.context}; lower max_tokens")  # fmt: skip
    top_k = params.get("top_k")
    top_k = 0 if top_k in (None, -1) else top_k
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise Refused(400, "sample: top_k must be -1 (all tokens) or a positive number of tokens")
    temperature, top_p = params.get("temperature", 1.0), params.get("top_p", 1.0)
    if not all(isinstance(x, int | float) and math.isfinite(x) for x in (temperature, top_p)):
        raise Refused(400, "sample: temperature and top_p must be numbers")
    if temperature < 0 or not 0 < top_p <= 1:
        raise Refused(400, "sample: temperature >= 0 and 0 < top_p <= 1")
    if temperature < MIN_TEMPERATURE:  # (logits / 1e-300 overflow: so low a temperature is greedy decoding)
        temperature = 0.0
    stop_strings, stop_tokens = _stops(params.get("stop"), limits.vocab)
    given = params.get("seed")
    if given is not None and (not isinstance(given, int) or isinstance(given, bool)):
        raise Refused(400, "sample: sampling_params.seed must be an integer")
    last_n = body.get("prompt_logprobs_last_n")
    want_prompt = bool(body.get("prompt_logprobs"))
    topk = body.get("topk_prompt_logprobs") or 0
    if not isinstance(topk, int) or isinstance(topk, bool) or not 0 <= topk <= min(MAX_TOPK_LOGPROBS, limits.vocab):
        raise Refused(400, f"sample: topk_prompt_logprobs must be 0..{min(MAX_TOPK_LOGPROBS, limits.vocab)} on this "
                           "server")  # fmt: skip
    scored = want_prompt or topk > 0
    if last_n is not None and (not scored or not isinstance(last_n, int) or not 1 <= last_n <= len(prompt) - 1):
        raise Refused(400, "sample: prompt_logprobs_last_n needs prompt_logprobs (or topk_prompt_logprobs) and "
                           "1..len(prompt)-1")  # fmt: skip
    return Sample(
        tuple(prompt), n, max_tokens, (given & 0x7FFFFFFF) if given is not None else seed, float(temperature),
        float(top_p), stop_strings, stop_tokens, want_prompt, last_n, top_k, topk,
    )  # fmt: skip


def _stops(stop: Any, vocab: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if stop is None:
        return (), ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not stop:
        why = "[] (no stop at all, not even end-of-sequence) is not served: PlexRL's engines always stop there"
        raise Refused(400, f"sample: stop must be a string, a list of strings or of token ids; {why}")
    if all(isinstance(s, str) for s in stop):
        if any(not s or len(s) > 256 for s in stop) or len(stop) > 16:
            raise Refused(400, "sample: at most 16 stop strings of 1-256 characters")
        return tuple(stop), ()
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        if any(not 0 <= s < vocab for s in stop) or len(stop) > 64:
            raise Refused(400, f"sample: at most 64 stop token ids, each in [0, {vocab})")
        return (), tuple(stop)
    raise Refused(400, "sample: stop mixes strings and token ids; send one kind")


def sample_seed(session_seed: int, sampler: str, seq_id: int) -> int:
    """The seed of a sample request that names none: a function of the model's seed, the sampling client's
    number in its session and the request's number in it (never of random ids), so the same program samples
    the same tokens, run after run, alone or beside other jobs."""
    return zlib.crc32(f"{session_seed}/{sampler}/{seq_id}".encode()) & 0x7FFFFFFF


__all__ = [
    "ModelLimits",
    "Refused",
    "forward_backward",
    "json_tokens",
    "model_limits",
    "optim_step",
    "sample",
    "sample_seed",
    "tensor",
]
