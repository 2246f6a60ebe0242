"""`TorchEngine`: generation, log-probs and training of a transformers causal LM in plain torch.

Generation is a hand-written sampling loop with a KV cache (left-padded prompts, explicit position ids),
seeded by a `torch.Generator` per call so results depend only on the seed, never on what ran before. It can
stop between two decode steps and resume later (`begin_generation` / `resume`; plexrl/engines/decoding.py),
with finished rows dropped from the batch, running the same computation as without the pause (on CPU the same
tokens bit for bit; on CUDA the same distribution: docs/gpu.md).
Training runs a caller-supplied loss (`LossFn`) over minibatches with AdamW and gradient clipping; the
algorithm (GRPO, PPO, ...) lives in the operator, not here.

`dtype="bfloat16"`: the policy (and reference) hold and compute in bf16, and training keeps fp32 MASTER
copies of the policy's parameters: each step's bf16 gradients are copied onto the masters, clipped there,
AdamW steps the masters (its moments are fp32), and the policy gets the masters rounded to bf16. A job's
state is then policy (2 bytes a parameter) + masters (4) + moments (8); `state_tensors` lists all of them.
The critic stays fp32. `gradient_checkpointing=True` recomputes each layer's activations in the backward
pass (transformers' non-reentrant checkpointing): the same gradients, less memory, more compute.

Not done here: scheduling, swapping between jobs (the StateManager's job), tracking.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plexrl.engines import decoding
from plexrl.engines.base import GenerationOutput, LossFn
from plexrl.engines.decoding import Decoding
from plexrl.engines.logprobs import scored_logprobs, token_logprobs
from plexrl.engines.steps import nucleus as nucleus
from plexrl.engines.steps import positions as positions

log = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _copy_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


def _optimize(
    model: Any, optimizer: torch.optim.Optimizer, batch: dict[str, Tensor],
    forward: Callable[[dict[str, Tensor]], tuple[Tensor, ...]], loss_fn: Callable[..., tuple[Tensor, dict[str, float]]],
    device: torch.device, *, minibatches: int, epochs: int, max_grad_norm: float,
    master: Sequence[tuple[Tensor, Tensor]] = (),
) -> tuple[dict[str, float], int]:  # fmt: skip
    """`epochs` passes of `minibatches` AdamW steps over `batch` (rows split in order):
    loss, stats = loss_fn(minibatch, *forward(minibatch)). Returns the mean stats (plus `loss` and the
    pre-clip `grad_norm`) and the number of steps. `master`: (model parameter, fp32 master) pairs when the
    optimizer steps masters (bf16 training): gradients move onto the masters before clipping, the model
    parameters get the masters back after each step."""
    model.train()
    # clip over what this optimizer steps: a LoRA job's model also holds other jobs' adapters
    params = [p for group in optimizer.param_groups for p in group["params"]]
    bounds = torch.linspace(0, batch["input_ids"].shape[0], minibatches + 1).long().tolist()
    totals: dict[str, float] = {}
    steps = 0
    for _ in range(epochs):
        for a, b in itertools.pairwise(bounds):
            if b <= a:
                continue
            mb = {k: v[a:b].to(device) for k, v in batch.items()}
            loss, stats = loss_fn(mb, *forward(mb))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for p, m in master:
                m.grad, p.grad = (None if p.grad is None else p.grad.float()), None
            gnorm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            with torch.no_grad():
                for p, m in master:
                    p.copy_(m)
            for k, v in {**stats, "loss": float(loss.detach()), "grad_norm": float(gnorm)}.items():
                totals[k] = totals.get(k, 0.0) + v
            steps += 1
    optimizer.zero_grad(set_to_none=True)  # no gradient outlives the step: a swapped-out state leaves nothing
    model.eval()
    return {k: v / max(steps, 1) for k, v in totals.items()}, steps


class TorchEngine:
    """Holds one job's policy (and optionally a frozen reference) and its AdamW optimizer.

    A response ends at `eos_id` (the tokenizer's) or any other eos id of the model's `generation_config.json`
    (`extra_eos`; Llama 3 and Qwen list several); a `pad_id` of None is the generation config's, else eos."""

    extra_eos: tuple[int, ...] = ()  # set by __init__ (and by LoRAEngine, which skips it)
    master: dict[str, Tensor] | None = None  # fp32 copies of the policy's parameters (bf16 training only)

    def __init__(
        self,
        model_dir: str | Path,
        *,
        eos_id: int | None,
        pad_id: int | None,
        device: str = "cpu",
        with_reference: bool = False,
        attention: str = "sdpa",
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        load_on: str | None = None,
    ) -> None:
        """`device`: where the engine computes; `load_on`: where its tensors are made (None: `device`). A
        service builds a job admitted to host or disk on "cpu" and hands its tensors to that tier: they reach
        `device` only when the planner brings the job in (`plexrl.devices.build_device`)."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from plexrl.data.prompts import engine_special_ids

        hf_logging.disable_progress_bar()  # no "Loading weights" bars in job output

        self.device = torch.device(device)
        special = engine_special_ids(model_dir, eos_id, pad_id)  # every eos of generation_config.json too
        self.eos_id, self.pad_id, self.extra_eos = special.eos[0], special.pad, special.eos[1:]
        if dtype not in DTYPES:
            raise ValueError(f"model dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        self.dtype = DTYPES[dtype]
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=self.dtype, attn_implementation=attention)
        self.policy = model.to(torch.device(load_on) if load_on is not None else self.device)  # type: ignore[arg-type]
        if gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.policy.eval()
        self.reference = None
        if with_reference:
            self.reference = copy.deepcopy(self.policy).requires_grad_(False)
        if self.dtype != torch.float32:
            self.master = {
                name: torch.nn.Parameter(p.detach().float().clone())
                for name, p in self.policy.named_parameters(remove_duplicate=True)
            }
        self.optimizer: torch.optim.Optimizer | None = None
        self.model_dir = Path(model_dir)
        self.critic: Any = None  # created on first use (PPO): the policy's backbone with a scalar head
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.weight_version = 0
        self._tokenizer: Any = None  # loaded on first use of stop strings
        opt_file = Path(model_dir) / OPTIMIZER_FILE
        if opt_file.is_file():  # e.g. the warm start's AdamW moments: training continues where it stopped
            self.optimizer = torch.optim.AdamW(self._trained())
            self.optimizer.load_state_dict(torch.load(opt_file, weights_only=True))

    def init_optimizer_state(self, critic: bool = False) -> None:
        """Make AdamW and its moments now, as its first step would (step 0, zeros: training is bit-identical), so
        the state has all its tensors from the start: the size a service reports at the load is the size the
        planner budgets, and the state stays one flat buffer (`plexrl.services.swap.flatten`). `critic` (PPO):
        the critic and its AdamW too, as `train_critic_step` makes them."""
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self._trained())
        if critic and self.critic_optimizer is None:
            self.critic_optimizer = torch.optim.AdamW(self._ensure_critic().parameters(), weight_decay=0.0)
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # AdamW's own
        for opt in [o for o in (self.optimizer, self.critic_optimizer) if o is not None]:
            for p in [p for group in opt.param_groups for p in group["params"]]:
                state = opt.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=scalar)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _trained(self) -> list[Tensor]:
        """What the optimizer steps: the fp32 masters (bf16 training), else the policy's parameters."""
        return list(self.master.values()) if self.master is not None else list(self.policy.parameters())

    def _master_pairs(self) -> list[tuple[Tensor, Tensor]]:
        if self.master is None:
            return []
        params = dict(self.policy.named_parameters(remove_duplicate=True))
        return [(params[name], m) for name, m in self.master.items()]

    # -- generation ---------------------------------------------------------------------------------
    @torch.no_grad()
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
        """`Engine.generate`: `begin_generation` + `resume` to the end (plexrl/engines/decoding.py)."""
        d = self.begin_generation(
            prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed, greedy=greedy,
            stop_token_ids=stop_token_ids, stop=stop, top_p=top_p, top_k=top_k,
        )  # fmt: skip
        return self.resume(d).output()

    def begin_generation(self, prompts: list[list[int]], **kwargs: Any) -> Decoding:
        """A generation (arguments as `generate`) after its prefill, before its first decode step: advance it
        with `resume`; between two calls the engine may run anything else (another job's generation, a train
        step of another job), and the result equals an unpaused `generate`'s."""
        return decoding.begin(self, prompts, **kwargs)

    def resume(self, d: Decoding, max_steps: int | None = None) -> Decoding:
        """Run at most `max_steps` more decode steps of `d` (None: to the end); `d.finished` says when its
        `output()` is ready. Rows finished are dropped from the batch, the others keep their KV cache."""
        return decoding.advance(self, d, max_steps)

    def _stopped(self, resp: Tensor, done: Tensor, stop: Sequence[str]) -> Tensor:
        """Rows (not done yet) whose decoded response contains a stop string."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        hit = torch.zeros_like(done)
        for i in (~done).nonzero().flatten().tolist():
            text = self._tokenizer.decode(resp[i].tolist(), skip_special_tokens=True)
            hit[i] = any(s in text for s in stop)
        return hit

    # -- scoring ------------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, *, temperature: float = 1.0, which: str = "policy"
    ) -> Tensor:
        model = self.policy if which == "policy" else self.reference
        if model is None:
            raise RuntimeError("this engine has no reference model; create it with with_reference=True")
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        return token_logprobs(logits, ids, temperature)[0].cpu()

    # -- training -----------------------------------------------------------------------------------
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
        """Run `epochs` passes of `minibatches` optimizer steps over `batch` (rows split in order).

        batch must hold `input_ids` and `attention_mask` [N, L] plus whatever `loss_fn` reads.
        Returns the mean of the loss stats over steps, plus `grad_norm` (pre-clip) and `steps`.
        """
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self._trained(), lr=lr, weight_decay=weight_decay)
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"], group["betas"] = lr, weight_decay, betas

        def forward(mb: dict[str, Tensor]) -> tuple[Tensor, ...]:
            # the head only over the responses ("mask": the response mask policy losses read)
            return scored_logprobs(
                self.policy, mb["input_ids"], mb["attention_mask"], temperature, mb.get("mask"), use_cache=False
            )

        stats, steps = _optimize(
            self.policy, self.optimizer, batch, forward, loss_fn, self.device,
            minibatches=minibatches, epochs=epochs, max_grad_norm=max_grad_norm, master=self._master_pairs(),
        )  # fmt: skip
        self.weight_version += 1
        return {**stats, "steps": float(steps)}

    # -- critic (value model) -----------------------------------------------------------------------
    def _ensure_critic(self) -> Any:
        if self.critic is None:
            from transformers import AutoConfig, AutoModelForTokenClassification
            from transformers.utils import logging as hf_logging

            level = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # the new head is expected to be missing from the checkpoint
            try:
                # no dropout: in train() mode it would draw from the global RNG, so a job's results would
                # depend on what other jobs ran before it (docs invariant 4)
                model_dir = str(self.model_dir)
                config = AutoConfig.from_pretrained(model_dir, num_labels=1)
                config.classifier_dropout = 0.0
                critic = AutoModelForTokenClassification.from_pretrained(model_dir, config=config, dtype=torch.float32)
            finally:
                hf_logging.set_verbosity(level)
            critic.score.weight.data.zero_()  # V = 0 at the start: deterministic, no random head
            if getattr(critic.score, "bias", None) is not None:
                critic.score.bias.data.zero_()
            self.critic = critic.to(self.policy.device)  # where the state is: a job built on the host keeps it there
            self.critic.eval()
        return self.critic

    def _critic_forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        out = self._ensure_critic()(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        v = out[..., 0].float()
        return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], 1)  # column j: state before token j

    @torch.no_grad()
    def values(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Critic values [N, L], aligned like `logprobs` (column j scores the state before token j)."""
        return self._critic_forward(input_ids.to(self.device), attention_mask.to(self.device)).cpu()

    def train_critic_step(
        self,
        batch: dict[str, Tensor],
        loss_fn: Any,
        *,
        lr: float,
        max_grad_norm: float,
        minibatches: int,
    ) -> dict[str, float]:
        """Minibatch AdamW steps on `loss_fn(minibatch, values [n, L]) -> (loss, stats)` for the critic."""
        critic = self._ensure_critic()
        if self.critic_optimizer is None:
            self.critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=lr, weight_decay=0.0)
        for group in self.critic_optimizer.param_groups:
            group["lr"] = lr

        def forward(mb: dict[str, Tensor]) -> tuple[Tensor, ...]:
            return (self._critic_forward(mb["input_ids"], mb["attention_mask"]),)

        stats, _ = _optimize(
            critic, self.critic_optimizer, batch, forward, loss_fn, self.device,
            minibatches=minibatches, epochs=1, max_grad_norm=max_grad_norm,
        )  # fmt: skip
        return stats

    # -- state --------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, Tensor]:
        """The live tensors (not copies) that make this job's state, by a stable name: policy parameters, their
        fp32 masters (bf16 training), optimizer moments, reference and critic weights. Shared tensors (tied
        embeddings) appear once; each counts its real bytes (bf16: 2 a parameter).
        The StateManager's swaps move exactly these; buffers derived from the config (rotary tables) stay."""
        out: dict[str, Tensor] = {}
        seen: set[int] = set()

        def add(prefix: str, named: Any) -> None:
            for name, t in named:
                if id(t) not in seen:
                    seen.add(id(t))
                    out[f"{prefix}.{name}"] = t

        add("policy", self.policy.named_parameters(remove_duplicate=True))
        if self.master is not None:
            add("master", self.master.items())
        if self.reference is not None:
            add("reference", self.reference.named_parameters(remove_duplicate=True))
        if self.critic is not None:
            add("critic", self.critic.named_parameters(remove_duplicate=True))
        for label, opt in (("optimizer", self.optimizer), ("critic_optimizer", self.critic_optimizer)):
            if opt is None:
                continue
            for gi, group in enumerate(opt.param_groups):
                for pi, param in enumerate(group["params"]):
                    for key, value in opt.state.get(param, {}).items():
                        if isinstance(value, Tensor) and value.dim() > 0:  # `step` scalars stay on the host
                            add(label, [(f"{gi}.{pi}.{key}", value)])
        return out

    def export_state(self) -> dict[str, Any]:
        """A copy (not views) of everything that makes this job's engine state: weights, optimizer state,
        reference weights, weight version. Later training does not change an exported state."""
        state: dict[str, Any] = {
            "policy": _copy_tensors(self.policy.state_dict()),
            "weight_version": self.weight_version,
        }
        if self.master is not None:
            state["master"] = _copy_tensors(self.master)
        if self.optimizer is not None:
            state["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        if self.reference is not None:
            state["reference"] = _copy_tensors(self.reference.state_dict())
        if self.critic is not None:
            state["critic"] = _copy_tensors(self.critic.state_dict())
        if self.critic_optimizer is not None:
            state["critic_optimizer"] = copy.deepcopy(self.critic_optimizer.state_dict())
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        if self.master is not None:  # the saved masters (a bf16 state), else the loaded weights in fp32
            params = dict(self.policy.named_parameters(remove_duplicate=True))
            with torch.no_grad():
                for name, m in self.master.items():
                    m.copy_(state["master"][name] if "master" in state else params[name].float())
        if "reference" in state and self.reference is not None:
            self.reference.load_state_dict(state["reference"])
        if "optimizer" in state:
            if self.optimizer is None:
                self.optimizer = torch.optim.AdamW(self._trained())
            self.optimizer.load_state_dict(state["optimizer"])
        if "critic" in state:
            self._ensure_critic().load_state_dict(state["critic"])
        if "critic_optimizer" in state:
            self.critic_optimizer = torch.optim.AdamW(self._ensure_critic().parameters())
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.weight_version = int(state.get("weight_version", 0))

    def save_pretrained(self, path: str | Path) -> None:
        self.policy.save_pretrained(str(path))
