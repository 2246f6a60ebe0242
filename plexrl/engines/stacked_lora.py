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

`grouped(model, adapters)` is the same for a TRAINING forward (several LoRA sessions' forward_backward calls in
one pass, `plexrl/sessions/training.py`): gradients reach each adapter's own parameters through autograd, so its
stacks are built from the live parameters inside every forward, and the rows are grouped by adapter so that each
row's LoRA matmuls are its own adapter's only (no K-fold work):

    g = x[index] as [P, m*L, in]            the rows of each of the P adapters present, m per adapter (padded;
                                            no gather when the rows come grouped and none is padded)
    base(x) + (bmm(bmm(g, A), B) as [P*m, L, out])[inverse]      A [P, in, R], B [P, R, out] (scaled)

`select(rows)` before each forward. A row's output, and so each adapter's gradient, is that of its rows alone up
to float noise (padding rows are computed and dropped: they get no gradient). It also refuses LoRA dropout
(`grouped` yields None: the caller runs the calls one after another).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
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


def _weights(model: nn.Module, adapters: Sequence[str]) -> tuple[list[Any], int, Tensor] | None:
    """The model's LoRA layers, the largest rank among `adapters` and one of their A weights (its device and
    dtype); None when they need peft's path or the model has none of them."""
    layers = _lora_layers(model, adapters)
    weights = [layer.lora_A[a].weight for layer in layers or () for a in adapters if a in layer.lora_A]
    if not layers or not weights:
        return None
    return layers, max(w.shape[0] for w in weights), weights[0]


@contextlib.contextmanager
def _patched(layers: Sequence[Any], make: Callable[[Any], Callable[..., Tensor]]) -> Iterator[None]:
    """Each layer's forward replaced by `make(layer)` while within; the class's forward again after."""
    patched = []
    try:
        for layer in layers:
            layer.forward = make(layer)
            patched.append(layer)
        yield
    finally:
        for layer in patched:
            del layer.forward  # (the class's forward again)


@contextlib.contextmanager
def stacked(model: nn.Module, adapters: Sequence[str]) -> Iterator[Select | None]:
    """See the module docstring: within, `select(rows)` (row -> index in `adapters`) before each forward, and
    call the model without `adapter_names`; None: this model's LoRA layers need peft's path."""
    found = _weights(model, adapters)
    if found is None:
        yield None
        return
    layers, rank, first = found
    rows = _Rows(torch.arange(len(adapters) * rank, device=first.device) // rank, first.dtype)

    def make(layer: Any) -> Callable[..., Tensor]:
        with torch.no_grad():
            return _forward(layer, _stacks(layer, adapters, rank), rows)

    with _patched(layers, make):
        yield rows.select


class _Groups:
    """The rows of the next training forward grouped by adapter (shared by every layer): `present` the adapters
    (indices) with rows, `index` [P*m] the batch row at each grouped slot (padding repeats a row), `inverse` [B]
    each row's slot."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.present: list[int] = []
        self.index: Tensor | None = None
        self.inverse: Tensor | None = None
        self.m = 0
        self.in_order = False

    def select(self, rows: Sequence[int]) -> None:
        slots: dict[int, list[int]] = {}
        for i, a in enumerate(rows):
            slots.setdefault(int(a), []).append(i)
        self.present = sorted(slots)
        self.m = max(len(s) for s in slots.values())
        index: list[int] = []
        inverse = [0] * len(rows)
        for p, a in enumerate(self.present):
            for j, r in enumerate(slots[a]):
                inverse[r] = p * self.m + j
            index += slots[a] + [slots[a][0]] * (self.m - len(slots[a]))
        self.index = torch.tensor(index, device=self.device)
        self.inverse = torch.tensor(inverse, device=self.device)
        self.in_order = index == list(range(len(rows)))  # rows already grouped, none padded: no gather


def _live_stacks(layer: Any, names: Sequence[str], rank: int, x: Tensor) -> tuple[Tensor, Tensor]:
    """The layer's A [P, in, R] and scaled B [P, R, out] of `names`, from the live parameters (autograd runs
    through them); zeros for an adapter the layer does not have, zero columns past a smaller rank."""
    dtype = next(layer.lora_A[n].weight.dtype for n in names if n in layer.lora_A)
    a_parts, b_parts = [], []
    for name in names:
        if name not in layer.lora_A:
            a_parts.append(x.new_zeros(layer.in_features, rank, dtype=dtype))
            b_parts.append(x.new_zeros(rank, layer.out_features, dtype=dtype))
            continue
        wa, wb = layer.lora_A[name].weight, layer.lora_B[name].weight  # [r, in], [out, r]
        pad = rank - wa.shape[0]
        a_parts.append(F.pad(wa.t(), (0, pad)) if pad else wa.t())
        b = wb.t() * layer.scaling[name]
        b_parts.append(F.pad(b, (0, 0, 0, pad)) if pad else b)
    return torch.stack(a_parts), torch.stack(b_parts)


def _grouped_forward(layer: Any, adapters: Sequence[str], rank: int, groups: _Groups) -> Callable[..., Tensor]:
    base = layer.base_layer

    def forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        result: Tensor = base(x, *args, **kwargs)
        assert groups.index is not None and groups.inverse is not None, "select the rows' adapters first"
        names = [adapters[i] for i in groups.present]
        if not any(n in layer.lora_A for n in names):
            return result
        if x.shape[0] != groups.inverse.shape[0]:
            raise RuntimeError(f"a LoRA layer got {x.shape[0]} rows where the batch has {groups.inverse.shape[0]}")
        a, b = _live_stacks(layer, names, rank, x)
        flat = x.to(a.dtype).reshape(x.shape[0], -1, x.shape[-1])  # [B, L, in]
        length, p = flat.shape[1], len(names)
        if not groups.in_order:  # (index_select: its backward adds in parallel, where indexing's is serial)
            flat = flat.index_select(0, groups.index)
        y = torch.bmm(torch.bmm(flat.reshape(p, groups.m * length, -1), a), b).reshape(p * groups.m, length, -1)
        if not groups.in_order:
            y = y.index_select(0, groups.inverse)
        return result + y.reshape(*x.shape[:-1], -1).to(result.dtype)

    return forward


@contextlib.contextmanager
def grouped(model: nn.Module, adapters: Sequence[str]) -> Iterator[Select | None]:
    """See the module docstring: within, `select(rows)` (row -> index in `adapters`) before each forward (with or
    without gradients), and call the model without `adapter_names`; None: these adapters need peft's path (a
    LoRA variant, dropout, a non-Linear LoRA layer) or the model has none of them."""
    found = _weights(model, adapters)
    dropout = found is not None and any(
        not isinstance(layer.lora_dropout[a], nn.Identity) for layer in found[0] for a in adapters
        if a in layer.lora_dropout
    )  # fmt: skip
    if found is None or dropout:
        yield None
        return
    layers, rank, first = found
    groups = _Groups(first.device)
    with _patched(layers, lambda layer: _grouped_forward(layer, adapters, rank, groups)):
        yield groups.select


__all__ = ["Select", "grouped", "stacked"]
