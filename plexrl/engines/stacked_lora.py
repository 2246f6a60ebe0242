"""Each row of a batch under its own LoRA adapter, in a FIXED number of ops per layer (`stacked`): what
`mixed.generate_mixed` runs its forward passes with, in place of peft's mixed-adapter forward (`adapter_names`),
whose LoRA layers loop over the adapters of the batch (a sub-batch gather, two matmuls and a scatter per adapter,
and a Python pass over the row names, in every layer at every step: with 8 sessions the LoRA ops outnumber the
base's many times over, and a small model's step is as slow as the 8 calls one after another).

Within `stacked(model, adapters)`, every LoRA `Linear` of the model computes, for input x [B, ..., in]:

    base(x) + ((x @ A) * mask) @ B      A [in, K*R]: the K adapters' lora_A, transposed, side by side
                                        B [K*R, out]: their lora_B, transposed, scaled, stacked
                                        mask [B, 1, K*R]: 1 on the columns of each row's adapter

(R: the largest rank; a smaller rank's extra columns are zero, and so are the blocks of an adapter a layer does
not have.) Four ops per layer whatever K; the stacks are built once per call (the weights do not change while it
generates). `select(rows)` names each row's adapter (its index in `adapters`) before each forward. The same
sums as peft's forward, in another order: equal within float noise.

What it does NOT do: LoRA variants (DoRA and the like), merged adapters, LoRA on other layers than `Linear`, or
dropout (generation runs in eval mode). `stacked` yields None for such a model: the caller uses peft's
`adapter_names` instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

Select = Callable[[Sequence[int]], None]


class _Rows:
    """The mask of the rows of the next forward (shared by every layer)."""

    def __init__(self, block: Tensor, dtype: torch.dtype) -> None:
        self.block, self.dtype = block, dtype  # block [K*R]: the adapter of each stacked column
        self.mask: Tensor | None = None

    def select(self, rows: Sequence[int]) -> None:
        index = torch.tensor(list(rows), device=self.block.device)
        self.mask = (self.block[None, :] == index[:, None]).unsqueeze(1).to(self.dtype)


def _stacks(layer: Any, adapters: Sequence[str], rank: int) -> tuple[Tensor, Tensor] | None:
    """The layer's A [in, K*R] and scaled B [K*R, out]; None when it has none of `adapters`."""
    have = [a for a in adapters if a in layer.lora_A]
    if not have:
        return None
    ref = layer.lora_A[have[0]].weight
    k = len(adapters)
    a = torch.zeros(layer.in_features, k * rank, dtype=ref.dtype, device=ref.device)
    b = torch.zeros(k * rank, layer.out_features, dtype=ref.dtype, device=ref.device)
    for j, name in enumerate(adapters):
        if name not in layer.lora_A:
            continue
        wa, wb = layer.lora_A[name].weight, layer.lora_B[name].weight  # [r, in], [out, r]
        r = wa.shape[0]
        a[:, j * rank : j * rank + r] = wa.t()
        b[j * rank : j * rank + r] = wb.t() * layer.scaling[name]
    return a, b


def _forward(layer: Any, stacks: tuple[Tensor, Tensor] | None, rows: _Rows) -> Callable[..., Tensor]:
    base = layer.base_layer

    def forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        result: Tensor = base(x, *args, **kwargs)
        if stacks is None:
            return result
        assert rows.mask is not None, "select the rows' adapters before each forward"
        a, b = stacks
        h = x.to(a.dtype) @ a
        mask = rows.mask if h.dim() == 3 else rows.mask.view(h.shape[0], *([1] * (h.dim() - 2)), -1)
        return result + ((h * mask) @ b).to(result.dtype)

    return forward


def _lora_layers(model: nn.Module, adapters: Sequence[str]) -> list[Any] | None:
    """The model's LoRA layers, or None when one of them is of a kind `stacked` does not run."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import Linear

    layers: list[Any] = []
    for m in model.modules():
        if not isinstance(m, LoraLayer):
            continue
        variants = getattr(m, "lora_variant", {})
        if not isinstance(m, Linear) or m.merged or any(a in variants for a in adapters):
            return None
        layers.append(m)
    return layers


@contextlib.contextmanager
def stacked(model: nn.Module, adapters: Sequence[str]) -> Iterator[Select | None]:
    """See the module docstring: within, `select(rows)` (row -> index in `adapters`) before each forward, and
    call the model without `adapter_names`; None: this model's LoRA layers need peft's path."""
    layers = _lora_layers(model, adapters)
    weights = [layer.lora_A[a].weight for layer in layers or () for a in adapters if a in layer.lora_A]
    if not layers or not weights:
        yield None
        return
    rank = max(w.shape[0] for w in weights)
    rows = _Rows(torch.arange(len(adapters) * rank, device=weights[0].device) // rank, weights[0].dtype)
    patched = []
    try:
        with torch.no_grad():
            for layer in layers:
                layer.forward = _forward(layer, _stacks(layer, adapters, rank), rows)
                patched.append(layer)
        yield rows.select
    finally:
        for layer in patched:
            del layer.forward  # (the class's forward again)


__all__ = ["Select", "stacked"]
