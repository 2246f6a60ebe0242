"""`FSDPEngine`: one rank's part of a job's engine on a worker group (a service over N ranks).

Training is FSDP2 (`fully_shard` on each decoder layer, then on the model, over a 1-D device mesh of the
group): each rank holds 1/N of the policy's parameters, gradients and AdamW moments. Every rank runs the
same minibatch (the data is replicated, not split: FSDP here shards memory, not compute; splitting rows
needs a loss whose normalisation is known across ranks, which the operators' losses do not expose), so a
step equals the single-process step up to the order of the gradient-norm reduction (~1e-7).

Generation and scoring run on rank 0 only, on a plain `TorchEngine` that holds a full copy of the policy
(and the frozen reference, when the job has one); its result is broadcast to the other ranks, so every
rank runs every operator the same way (SPMD) and every collective is met. After each update the full
policy is gathered to rank 0's copy, parameter by parameter and device to device (`_sync_full`): the
weight sync. vLLM with tensor parallelism is not used here (CPU: see docs/architecture.md).

Checkpoints: `export_state` / `load_state` are this rank's share (its shards, and on rank 0 the full copy):
each rank writes its own part, a resume on a group of the same size reads it back (`services/group.py`).
Not supported on a group: PPO's critic (`values`, `train_critic_step`): it raises with the reason.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plexrl.engines.base import GenerationOutput, LossFn
from plexrl.engines.logprobs import token_logprobs
from plexrl.engines.torch_engine import OPTIMIZER_FILE, TorchEngine, positions
from plexrl.ranks import RankState, guarded


def _local(t: Tensor) -> Tensor:
    """The rank's own part of a tensor: a DTensor's local shard, else the tensor."""
    out: Tensor = t.to_local() if hasattr(t, "to_local") else t
    return out


def shard_model(model: Any, mesh: Any) -> Any:
    """FSDP2 over `mesh`: each decoder layer is its own unit (all-gathered only while it computes), then the
    rest (embeddings, final norm, head). Same parameter order as the unsharded model."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class FSDPEngine:
    """One rank's engine of one job. `state_tensors()` names this rank's share of the job's state."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        eos_id: int,
        pad_id: int,
        group: RankState,
        device: str = "cpu",
        with_reference: bool = False,
        attention: str = "sdpa",
    ) -> None:
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor
        from transformers import AutoModelForCausalLM

        self.group, self.rank = group, group.rank
        self.device = torch.device(device)
        self.model_dir = Path(model_dir)
        # rank 0: the full copy that generates and scores (and the reference); other ranks: none
        self.full: TorchEngine | None = None
        if self.rank == 0:
            self.full = TorchEngine(model_dir, eos_id=eos_id, pad_id=pad_id, device=device,
                                    with_reference=with_reference, attention=attention)  # fmt: skip
            self.full.optimizer = None  # the moments live sharded below, not in the generation copy
            with torch.no_grad():  # own, resizable storage (from_pretrained may map the file): swaps resize it
                for model in (self.full.policy, self.full.reference):
                    for p in model.parameters() if model is not None else ():
                        p.data = p.data.clone()
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation=attention)
        self.policy = shard_model(model.to(self.device), group.mesh)  # type: ignore[arg-type]
        self.policy.eval()
        self.optimizer: torch.optim.Optimizer | None = None
        self.weight_version = 0
        opt_file = self.model_dir / OPTIMIZER_FILE
        if opt_file.is_file():  # the warm start's AdamW moments, sliced to this rank's shards (no communication)
            osd = torch.load(opt_file, weights_only=True)
            params = list(self.policy.parameters())
            for i, st in osd["state"].items():
                p = params[int(i)]
                for k, v in list(st.items()):
                    if isinstance(v, Tensor) and v.dim() > 0 and hasattr(p, "device_mesh"):
                        dt = distribute_tensor(v.to(self.device), p.device_mesh, [Shard(0)], src_data_rank=None)
                        # its own compact storage (the slice is a view of the whole loaded tensor, whose storage
                        # belongs to the file reader and cannot be resized by a swap)
                        st[k] = DTensor.from_local(dt.to_local().clone(), p.device_mesh, [Shard(0)], run_check=False,
                                                   shape=dt.shape, stride=dt.stride())  # fmt: skip
            self.optimizer = torch.optim.AdamW(params)
            self.optimizer.load_state_dict(osd)

    def init_optimizer_state(self) -> None:
        """AdamW and this rank's shards of its moments now, as its first step would make them (step 0, zeros:
        training is bit-identical), so the size the rank reports at the load is the size its state keeps
        (`TorchEngine.init_optimizer_state`)."""
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.policy.parameters())
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # AdamW's own
        for p in [p for group in self.optimizer.param_groups for p in group["params"]]:
            state = self.optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=scalar)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    # -- rank 0 computes, every rank gets the result ---------------------------------------------------
    def _from_rank0(self, what: str, fn: Any) -> Any:
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.full is not None:
            try:
                box = [("ok", fn())]
            except Exception as exc:  # every rank raises it, so the ranks stay in step (no broken group)
                box = [("error", f"{type(exc).__name__}: {exc}")]
        side = self.group.side  # the gloo side group: a pickled object never stages on a CUDA device (`ranks.join`)
        guarded(self.group, f"broadcast of {what}", lambda: dist.broadcast_object_list(box, src=0, group=side))
        kind, value = box[0]
        if kind == "error":
            raise RuntimeError(f"{what} on rank 0 failed: {value}")
        return value

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
    ) -> GenerationOutput:
        """`TorchEngine.generate` on rank 0's full copy; every rank returns the same output."""

        def run() -> GenerationOutput:
            assert self.full is not None
            return self.full.generate(prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                                      greedy=greedy, stop_token_ids=stop_token_ids, stop=stop, top_p=top_p)  # fmt: skip

        out: GenerationOutput = self._from_rank0("a generation", run)
        return out

    def logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, *, temperature: float = 1.0, which: str = "policy"
    ) -> Tensor:
        """Token log-probs [N, L] on rank 0's full policy (or reference); every rank returns them."""

        def run() -> Tensor:
            assert self.full is not None
            return self.full.logprobs(input_ids, attention_mask, temperature=temperature, which=which)

        out: Tensor = self._from_rank0("log-probs", run)
        return out

    # -- training (collective) -------------------------------------------------------------------------
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
        epochs: int = 1,
        betas: tuple[float, float] = (0.9, 0.999),
    ) -> dict[str, float]:
        """`TorchEngine.train_step` under FSDP2 on every rank (same minibatches everywhere), then the full
        policy gathered to rank 0's generation copy. Returns the same stats on every rank."""
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=lr, weight_decay=weight_decay)
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"], group["betas"] = lr, weight_decay, betas
        stats: dict[str, float] = guarded(
            self.group, "FSDP train step",
            lambda: self._optimize(batch, loss_fn, temperature, max_grad_norm, minibatches, epochs),
        )  # fmt: skip
        guarded(self.group, "weight gather to rank 0", self._sync_full)
        self.weight_version += 1
        if self.full is not None:
            self.full.weight_version = self.weight_version
        return stats

    def _optimize(
        self, batch: dict[str, Tensor], loss_fn: LossFn, temperature: float, max_grad_norm: float, minibatches: int,
        epochs: int,
    ) -> dict[str, float]:  # fmt: skip
        """`torch_engine._optimize` for DTensor parameters (the grad norm is reduced over the group)."""
        assert self.optimizer is not None
        model = self.policy
        model.train()
        bounds = torch.linspace(0, batch["input_ids"].shape[0], minibatches + 1).long().tolist()
        totals: dict[str, float] = {}
        # the loss and grad norm summed on the device (float64: the same sums as Python floats) and read once
        summed = torch.zeros(2, dtype=torch.float64, device=self.device)
        steps = 0
        for _ in range(epochs):
            for a, b in itertools.pairwise(bounds):
                if b <= a:
                    continue
                mb = {k: v[a:b].to(self.device) for k, v in batch.items()}
                mask = mb["attention_mask"]
                logits = model(input_ids=mb["input_ids"], attention_mask=mask, position_ids=positions(mask)).logits
                loss, stats = loss_fn(mb, *token_logprobs(logits, mb["input_ids"], temperature))
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
                gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
                self.optimizer.step()
                summed += torch.stack([loss.detach().double(), _local(gnorm.detach()).double().to(self.device)])
                for k, v in stats.items():
                    if k not in ("loss", "grad_norm"):  # the engine's own win, as before
                        totals[k] = totals.get(k, 0.0) + v
                steps += 1
        self.optimizer.zero_grad(set_to_none=True)  # the sharded grads are not state: free them
        model.eval()
        if steps:
            totals["loss"], totals["grad_norm"] = summed.tolist()
        return {**{k: v / max(steps, 1) for k, v in totals.items()}, "steps": float(steps)}

    def _sync_full(self) -> None:
        """The weight sync: each parameter all-gathered (`full_tensor`, every rank in the same order) and, on
        rank 0, copied device to device into the generation copy; one parameter's full tensor at a time, no
        trip through host memory."""
        own = dict(self.full.policy.named_parameters(remove_duplicate=True)) if self.full is not None else {}
        with torch.no_grad():
            for name, p in self.policy.named_parameters(remove_duplicate=True):
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                if self.full is not None:
                    own[name].copy_(full)
                del full

    # -- not on a group ---------------------------------------------------------------------------------
    def values(self, *args: Any, **kwargs: Any) -> Tensor:
        raise NotImplementedError("a critic (PPO) is not supported on a worker group (services.ranks > 1)")

    def train_critic_step(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        raise NotImplementedError("a critic (PPO) is not supported on a worker group (services.ranks > 1)")

    def export_state(self) -> dict[str, Any]:
        """THIS rank's share of the job's state, as copies: its shards of the policy and of the AdamW state
        (local parts; step counts and hyper-parameters as they are), the weight version, the group's size,
        and on rank 0 the full generation copy and reference (`full`). No collective: every rank writes its own;
        `load_state` on the same rank of a group of the same size restores it exactly."""
        state: dict[str, Any] = {
            "rank": self.rank, "world": self.group.spec.world, "weight_version": self.weight_version,
            "policy": {n: _local(p).detach().clone() for n, p in self.policy.named_parameters(remove_duplicate=True)},
        }  # fmt: skip
        if self.optimizer is not None:
            osd = self.optimizer.state_dict()
            osd["state"] = {i: {k: _local(v).clone() if isinstance(v, Tensor) else v for k, v in st.items()}
                            for i, st in osd["state"].items()}  # fmt: skip
            state["optimizer"] = osd
        if self.full is not None:
            state["full"] = self.full.export_state()
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `export_state` wrote on this rank (same rank, same group size; else a clear error)."""
        from torch.distributed.tensor import DTensor

        if (state.get("rank"), state.get("world")) != (self.rank, self.group.spec.world):
            raise ValueError(f"a checkpoint of rank {state.get('rank')} of {state.get('world')} cannot resume rank "
                             f"{self.rank} of {self.group.spec.world}: resume on a group of the same size")  # fmt: skip
        params = dict(self.policy.named_parameters(remove_duplicate=True))
        with torch.no_grad():
            for name, saved in state["policy"].items():
                _local(params[name]).copy_(saved)
        if "optimizer" in state:
            osd, plist = state["optimizer"], list(self.policy.parameters())
            for i, st in osd["state"].items():
                p = plist[int(i)]
                for k, v in list(st.items()):
                    if isinstance(v, Tensor) and v.dim() > 0 and hasattr(p, "device_mesh"):
                        st[k] = DTensor.from_local(v.to(self.device), p.device_mesh, p.placements, run_check=False,
                                                   shape=p.shape, stride=p.stride())  # fmt: skip
            if self.optimizer is None:
                self.optimizer = torch.optim.AdamW(plist)
            self.optimizer.load_state_dict(osd)
        if self.full is not None and "full" in state:
            self.full.load_state(state["full"])
        self.weight_version = int(state["weight_version"])

    # -- state --------------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, Tensor]:
        """This rank's live tensors by stable name: its shards of the policy and of the AdamW moments (the
        DTensors' local parts), and on rank 0 the full generation copy and reference (`full.` prefix)."""
        out: dict[str, Tensor] = {}
        for name, p in self.policy.named_parameters(remove_duplicate=True):
            out[f"policy.{name}"] = _local(p)
        if self.optimizer is not None:
            for gi, group in enumerate(self.optimizer.param_groups):
                for pi, param in enumerate(group["params"]):
                    for key, value in self.optimizer.state.get(param, {}).items():
                        if isinstance(value, Tensor) and value.dim() > 0:
                            out[f"optimizer.{gi}.{pi}.{key}"] = _local(value)
        if self.full is not None:
            out.update({f"full.{k}": v for k, v in self.full.state_tensors().items()})
        return out

    def save_pretrained(self, path: str | Path) -> None:
        """Rank 0 writes its full copy (the current weights after every sync); the other ranks do nothing."""
        if self.full is not None:
            self.full.save_pretrained(path)
