"""LoRA jobs over one shared base: `SharedBase` (one per service and base model) and `LoRAEngine` (one per job).

A LoRA job trains only its low-rank adapter (peft); the base weights are loaded ONCE per service and shared,
read-only, by every LoRA job on that base. Each job is one named adapter inside the service's `PeftModel`:
switching jobs is `set_adapter` (no copy), and a job's state, what the StateManager swaps between tiers, is
its adapter's tensors and their AdamW moments only: megabytes, where a full fine-tune of the same model moves
its weights and two moments (gigabytes for a 135M model). The KL reference of a LoRA job is the base itself
(`disable_adapter`): no reference copy either.

Invariants kept:
- the base never changes: its parameters have requires_grad False and are outside every optimizer (the tests
  compare a checksum of `SharedBase.base_tensors` before and after training and swaps);
- a job's results do not depend on the other adapters (docs invariant 4): only the active adapter takes
  part in a forward; a new adapter's A matrix is drawn from a generator seeded by the job's seed (peft would
  draw it from the global RNG, so the draw would depend on what ran before); B starts at zero (the adapted
  model starts as the base). LoRA dropout draws from the global RNG: keep `dropout: 0` (the default) for
  exact reproducibility under multiplexing;
- the base's forward is shared but its use is not concurrent: a service runs one node at a time.

dtype (`model.dtype: bfloat16`): the shared base holds and computes in bf16 (half its bytes), while every
adapter's parameters stay fp32 (peft's `autocast_adapter_dtype`, checked here): the adapter IS the fp32 master,
AdamW steps it directly, so no master copy is needed and a job's state is the same fp32 adapter + two moments
as at float32. The LoRA layers compute in fp32 on bf16 activations (peft casts the input) and add onto the
base's bf16 output. `gradient_checkpointing` recomputes the base's layer activations in the backward pass.
Both are settings of the shared base: jobs share a base only at one dtype and checkpointing (`base_key`).

Rollouts run on this engine (the torch engine) or, with `engine: vllm` (or auto by the same rule as a full
job), on a shared vLLM engine that applies the job's adapter (`plexrl/engines/vllm_lora.py`).

Several jobs' generations can share one decode loop, each row under its own adapter (`plexrl/engines/mixed.py`:
the sample calls of LoRA sessions queued together), and several LoRA sessions' forward_backward calls one
training pass (`plexrl/sessions/training.py`, `stacked_lora.grouped`). What it does NOT do: mix adapters in a DAG
job's training step, or train a critic (PPO) on an adapter.
"""

from __future__ import annotations

import copy
import hashlib
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plexrl.engines.torch_engine import DTYPES, TorchEngine, _copy_tensors


def adapter_name(job_id: str) -> str:
    """A module-safe adapter name for a job id (peft names modules after it: no dots)."""
    return "job_" + hashlib.sha1(job_id.encode()).hexdigest()[:12]


def base_key(model_dir: str | Path, dtype: str = "float32", gradient_checkpointing: bool = False) -> str:
    """The key under which jobs share a base on a service: the resolved model directory, and the dtype and
    gradient checkpointing the base runs with (jobs that differ in them get a base each)."""
    return (
        "lora-base:"
        + str(Path(model_dir).resolve())
        + ("" if dtype == "float32" else f":{dtype}")
        + (":checkpointed" if gradient_checkpointing else "")
    )


class SharedBase:
    """A base model loaded once on a service, with the adapters of the LoRA jobs placed there. `dtype`: the
    base's (float32 or bfloat16; adapters are fp32 either way); `gradient_checkpointing`: recompute the base's
    layer activations in the backward pass (the same gradients, less memory, more compute)."""

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        attention: str,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if dtype not in DTYPES:
            raise ValueError(f"model dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        self.model_dir = Path(model_dir)
        self.device = device
        self.dtype = DTYPES[dtype]
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=self.dtype, attn_implementation=attention)
        self.base = base.to(device)  # type: ignore[arg-type]
        self.base.requires_grad_(False)
        if gradient_checkpointing:  # non-reentrant: gradients reach the adapters through frozen layers
            self.base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.base.eval()
        self.model: Any = None  # the PeftModel, made with the first adapter
        self.adapters: dict[str, str] = {}  # job id -> adapter name

    def base_tensors(self) -> dict[str, Tensor]:
        """The base's own parameters (not the adapters'), by name: what must never change."""
        model = self.base if self.model is None else self.model.get_base_model()
        return {n: p for n, p in model.named_parameters() if "lora_" not in n}

    def add(self, job_id: str, r: int, alpha: float, dropout: float, targets: list[str], seed: int) -> str:
        """Add job `job_id`'s adapter (A drawn from `seed`, B zero); returns its name."""
        from peft import LoraConfig, get_peft_model

        name = adapter_name(job_id)
        cfg = LoraConfig(
            r=r,
            lora_alpha=alpha,  # type: ignore[arg-type]  # peft annotates an int; a float scales as well
            lora_dropout=dropout,
            target_modules=list(targets),
            bias="none",
        )
        with warnings.catch_warnings():  # an adapter on a tied output head (`lm_head`: a session's train_unembed)
            # adapts the head only, the embedding stays the base's; peft warns about merging such an adapter,
            # which PlexRL never does
            warnings.filterwarnings("ignore", message=".*ensure_weight_tying.*")
            if self.model is None:
                self.model = get_peft_model(self.base, cfg, adapter_name=name)
            else:
                self.model.add_adapter(name, cfg)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in self.model.named_parameters():
                if f".{name}." not in pname:
                    continue
                if p.dtype != torch.float32:  # the fp32 master (peft's autocast does it; a bf16 base must not)
                    p.data = p.data.float()
                if ".lora_A." in pname:  # kaiming-uniform as peft does, from the job's own generator
                    bound = 1.0 / math.sqrt(p.shape[1])
                    p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
                elif ".lora_B." in pname:
                    p.zero_()
        self.adapters[job_id] = name
        return name

    def remove(self, job_id: str) -> None:
        name = self.adapters.pop(job_id, None)
        # the last adapter stays inside the PeftModel (peft cannot delete it): the service frees the whole
        # base with its last LoRA job (`unused`)
        if name is not None and self.model is not None and len(self.model.peft_config) > 1:
            if self.model.active_adapter == name:  # peft warns when the active adapter goes
                self.activate(next(n for n in self.model.peft_config if n != name))
            self.model.delete_adapter(name)

    def activate(self, name: str) -> None:
        if self.model.active_adapter != name:
            self.model.set_adapter(name)

    @property
    def unused(self) -> bool:
        return not self.adapters

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.base_tensors().values())


class LoRAEngine(TorchEngine):
    """A job's engine over a `SharedBase`: the TorchEngine's generation, scoring and training, with only this
    job's adapter active and trainable; its state is the adapter and its optimizer."""

    def __init__(
        self,
        shared: SharedBase,
        job_id: str,
        *,
        eos_id: int,
        pad_id: int,
        r: int,
        alpha: float,
        dropout: float,
        targets: list[str],
        seed: int,
    ) -> None:
        # no TorchEngine.__init__: the model is the shared one, with this job's adapter added
        self.shared, self.job_id = shared, job_id
        self.adapter = shared.add(job_id, r, alpha, dropout, targets, seed)
        self.device = shared.device
        from plexrl.data.prompts import engine_special_ids

        special = engine_special_ids(shared.model_dir, eos_id, pad_id)  # every eos of generation_config.json too
        self.eos_id, self.pad_id, self.extra_eos = special.eos[0], special.pad, special.eos[1:]
        self.policy = shared.model
        self.reference = None  # the base itself, through disable_adapter
        self.model_dir = shared.model_dir
        self.critic = None
        self.critic_optimizer = None
        self.weight_version = 0
        self._tokenizer = None
        self.shared.activate(self.adapter)
        self.optimizer = torch.optim.AdamW(list(self._adapter_params().values()))

    def _adapter_params(self) -> dict[str, Tensor]:
        return {n: p for n, p in self.policy.named_parameters() if f".{self.adapter}." in n}

    # every use of the shared model runs with this job's adapter active
    def generate(self, prompts: list[list[int]], **kwargs: Any) -> Any:
        self.shared.activate(self.adapter)
        return super().generate(prompts, **kwargs)

    @torch.no_grad()
    def logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, *, temperature: float = 1.0, which: str = "policy"
    ) -> Tensor:
        from plexrl.engines.logprobs import token_logprobs
        from plexrl.engines.torch_engine import positions

        self.shared.activate(self.adapter)
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        if which == "policy":
            logits = self.policy(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        else:  # the reference of a LoRA job is its base
            with self.policy.disable_adapter():
                logits = self.policy(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        return token_logprobs(logits, ids, temperature)[0].cpu()

    def train_step(self, batch: dict[str, Tensor], loss_fn: Any, **kwargs: Any) -> dict[str, float]:
        self.shared.activate(self.adapter)
        return super().train_step(batch, loss_fn, **kwargs)

    def values(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        raise NotImplementedError("a LoRA job has no critic; use a pipeline without value_estimate (not ppo)")

    def train_critic_step(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        raise NotImplementedError("a LoRA job has no critic; use a pipeline without train_critic (not ppo)")

    # -- state: the adapter and its optimizer, never the base ---------------------------------------
    def state_tensors(self) -> dict[str, Tensor]:
        out = {f"adapter.{n}": p for n, p in self._adapter_params().items()}
        assert self.optimizer is not None
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, param in enumerate(group["params"]):
                for key, value in self.optimizer.state.get(param, {}).items():
                    if isinstance(value, Tensor) and value.dim() > 0:
                        out[f"optimizer.{gi}.{pi}.{key}"] = value
        return out

    def export_state(self) -> dict[str, Any]:
        assert self.optimizer is not None
        return {
            "adapter": _copy_tensors(self._adapter_params()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "weight_version": self.weight_version,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        if "adapter" not in state:
            raise ValueError("this state is not a LoRA job's (no adapter): a checkpoint of a full fine-tune?")
        live = self._adapter_params()
        with torch.no_grad():
            for name, t in state["adapter"].items():
                live[name].copy_(t)
        assert self.optimizer is not None
        self.optimizer.load_state_dict(state["optimizer"])
        self.weight_version = int(state.get("weight_version", 0))

    def save_pretrained(self, path: str | Path) -> None:
        """The adapter in peft's format (adapter_config.json + adapter_model.safetensors), not the base."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        weights = get_peft_model_state_dict(self.policy, adapter_name=self.adapter)
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(path / "adapter_model.safetensors")
        )
        self.policy.peft_config[self.adapter].save_pretrained(str(path))

    def release(self) -> None:
        self.shared.remove(self.job_id)


__all__ = ["LoRAEngine", "SharedBase", "adapter_name", "base_key"]
