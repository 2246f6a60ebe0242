"""What a job weighs, from its files and its pipeline: THE estimates the planner admits a job with and a
cluster's budget check compares (weights by dtype, a job's state in copies of its weights, a LoRA adapter's
state). A leaf: it imports nothing of plexrl (a pipeline is read through the `Graph` protocol), so engines,
services and the job's own modules size things the same way. Every estimate is an upper bound, replaced by
the size a service measures (`StateMeasured`); none loads a tensor.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol


class Graph(Protocol):
    """What sizing reads of a pipeline (`plexrl.graph.PipelineGraph` is one): its nodes, each with its operator's
    `name` and its validated `params`."""

    @property
    def nodes(self) -> Iterable[Any]: ...


def uses_reference(graph: Graph) -> bool:
    """Whether the pipeline reads reference-policy log-probs (then the engine keeps a frozen copy)."""
    return any(n.operator.name == "logprob" and getattr(n.params, "which", None) == "reference" for n in graph.nodes)


def uses_critic(graph: Graph) -> bool:
    return any(n.operator.name in ("value_estimate", "train_critic") for n in graph.nodes)


def state_parts(graph: Graph) -> list[str]:
    """What a job's state holds, as the StateManager counts and moves it."""
    parts = ["weights", "2 AdamW moments"]
    if uses_reference(graph):
        parts.append("reference weights")
    if uses_critic(graph):
        parts.append("critic with its moments")
    return parts


def estimate_state_bytes(weight_bytes: int, graph: Graph, dtype: str = "float32") -> int:
    """THE estimate of a job's state size, before it has run: fp32 weight bytes times the copies its
    pipeline keeps. An upper bound (tied weights count twice, headers count); the planner replaces it with
    the size a service measures at the first swap-out (`StateMeasured`). `dtype` bfloat16 (`model.dtype`):
    the policy and reference at half size plus the policy's fp32 masters: half a copy more, half a copy
    less for a reference."""
    copies = state_copies(graph)
    if dtype == "bfloat16":
        return weight_bytes * (2 * copies + 1 - uses_reference(graph)) // 2
    return weight_bytes * copies


def state_copies(graph: Graph) -> int:
    """The state's size in copies of the fp32 weights: policy + 2 AdamW moments, +1 for a reference,
    +3 for a critic (its weights and moments)."""
    return 3 + uses_reference(graph) + 3 * uses_critic(graph)


def model_bytes(model_dir: Path, dtype: str = "float32") -> int:
    """Bytes of the weights saved in a HF model directory once loaded in `dtype` (float32: 4 a parameter,
    bfloat16: 2), whatever dtype the files hold: parameters counted from the safetensors headers
    (`count_parameters`), so a bf16 checkpoint is not taken for half its fp32 size. A weights file whose header
    cannot be read counts its size on disk: sizing a job's plan never fails on it, loading the job says what
    is wrong."""
    try:
        return count_parameters(model_dir) * (2 if dtype == "bfloat16" else 4)
    except ValueError:  # a damaged or foreign *.safetensors (not a missing one: FileNotFoundError)
        return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def count_parameters(model_dir: Path) -> int:
    """Parameters (tensor elements) saved in a HF model directory, read from the safetensors headers (no
    tensor is loaded; any dtype)."""
    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with f.open("rb") as fh:
            head = fh.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < size <= f.stat().st_size - 8:  # a damaged or foreign file: never read a bogus length
                raise ValueError(
                    f"{f} is not a safetensors file (no valid header); re-save the model with save_pretrained"
                )
            header = json.loads(fh.read(size))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    if not total:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return total


def lora_state_bytes(model_dir: str | Path, r: int, targets: list[str]) -> int:
    """Estimated bytes of a LoRA job's state (fp32 adapter + 2 AdamW moments) for a Llama-family config:
    each targeted projection of each layer adds r * (in + out) parameters. Unknown module names count as a
    hidden x hidden projection. An estimate: the planner replaces it with the measured size after the first
    swap-out."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg.get("intermediate_size", 4 * cfg["hidden_size"])
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim", h // heads)
    dims = {
        "q_proj": (h, heads * hd),
        "k_proj": (h, kv * hd),
        "v_proj": (h, kv * hd),
        "o_proj": (heads * hd, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    per_layer = sum(r * sum(dims.get(t, (h, h))) for t in targets)
    return per_layer * cfg["num_hidden_layers"] * 4 * 3


def built_weight_bytes(vocab: int, layers: int, hidden: int, intermediate: int, tie_embeddings: bool) -> int:
    """fp32 bytes of a Llama-architecture model built from sizes (`model: {layers, hidden, ...}`): embeddings
    (twice when the head is not tied), per layer the four attention and three MLP projections and two norms,
    and the final norm.

    >>> built_weight_bytes(vocab=16, layers=1, hidden=8, intermediate=16, tie_embeddings=True)
    3168
    """
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    params = vocab * hidden * (1 if tie_embeddings else 2) + layers * per_layer + hidden
    return params * 4


__all__ = [
    "Graph",
    "built_weight_bytes",
    "count_parameters",
    "estimate_state_bytes",
    "lora_state_bytes",
    "model_bytes",
    "state_copies",
    "state_parts",
    "uses_critic",
    "uses_reference",
]
