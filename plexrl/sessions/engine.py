"""`SessionEngine`: a session's engine on its service. It wraps the job's ordinary engine (a `LoRAEngine` on the
service's shared base, or a full `TorchEngine`) and adds what the Tinker calls need and a DAG job does not:

- gradients that outlive a call: `forward_backward` adds to them, `optim_step` applies and clears them. They are
  part of the session's state (`state_tensors`, `export_state`), so the StateManager moves them with the
  adapter and its optimizer, and a checkpoint keeps them;
- `weights_id`, a fresh token at every change of the trained weights: a sampler snapshot names the weights it
  holds, and a `sample` on a snapshot whose weights are still the live ones loads nothing;
- the calls themselves (`run`): forward_backward / forward with a built-in loss, optim_step (AdamW), sample
  and prompt log-probs (through the job's generation engine, the same as a DAG job's on that service: torch, or
  vLLM where the job resolved to it), save (state or sampler weights), load.

Everything else (generation, scoring, `weight_version`, saving) is the wrapped engine's. Determinism: no call
draws from a global RNG (sampling seeds come with the call), so a session computes the same numbers alone or
beside other jobs (docs invariant 4). Full fine-tuning sessions train in float32 only (bf16 training keeps
master copies that these calls do not drive): `check_session_model` refuses the rest at creation.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from plexrl.sessions import losses, sampling
from plexrl.sessions.calls import Call, ForwardBackward, Load, OptimStep, Reply, Sample, Samples, Save
from plexrl.sessions.refused import CallRefused, failed_text

log = logging.getLogger(__name__)

MAX_FORWARD_TOKENS = 2048  # padded tokens per forward pass of a forward_backward (the logits' memory)


def _new_id() -> str:
    return uuid.uuid4().hex


class SessionEngine:
    """See the module docstring. `inner`: the job's engine (LoRAEngine or TorchEngine); attributes this class
    does not define are the inner engine's (so a vLLM wrapper built over it finds `policy`, `weight_version`,
    ...)."""

    def __init__(self, inner: Any) -> None:
        if getattr(inner, "master", None) is not None:
            raise ValueError("a full fine-tuning session trains in float32; set model.dtype: float32 (or use LoRA)")
        self.inner = inner
        self.grads: dict[str, Tensor] = {}  # accumulated by forward_backward, applied by optim_step
        self.weights_id = _new_id()

    def __getattr__(self, name: str) -> Any:  # (only for names not found on this object)
        return getattr(self.__dict__["inner"], name)

    @property
    def weight_version(self) -> int:
        return int(self.inner.weight_version)

    @weight_version.setter
    def weight_version(self, value: int) -> None:
        self.inner.weight_version = value

    # -- what is trained ----------------------------------------------------------------------------
    def trainable(self) -> dict[str, Tensor]:
        """The trained parameters by a name that does not depend on the job (`canonical`): a LoRA session's
        adapter, or every weight of a full one. Saved weights use these names, so another session loads them."""
        adapter = getattr(self.inner, "_adapter_params", None)  # (LoRAEngine's; the planner never sees it)
        if adapter is not None:
            return {canonical(n): p for n, p in adapter().items()}
        return dict(self.inner.policy.named_parameters(remove_duplicate=True))

    def _activate(self) -> None:
        """A LoRA session's adapter becomes the shared base's active one (no-op for a full engine)."""
        shared = getattr(self.inner, "shared", None)
        if shared is not None:
            shared.activate(self.inner.adapter)

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.inner.optimizer is None:
            self.inner.optimizer = torch.optim.AdamW(list(self.trainable().values()))
        opt: torch.optim.Optimizer = self.inner.optimizer
        return opt

    # -- state: the inner engine's, plus the accumulated gradients ----------------------------------
    def state_tensors(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = dict(self.inner.state_tensors())
        out.update({f"session_grad.{n}": g for n, g in self.grads.items()})
        return out

    def export_state(self) -> dict[str, Any]:
        state: dict[str, Any] = dict(self.inner.export_state())
        state["session_grads"] = {n: g.detach().clone() for n, g in self.grads.items()}
        state["weights_id"] = self.weights_id
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        self.inner.load_state(state)
        live = self.trainable()
        self.grads = {n: g.to(live[n].device).clone() for n, g in state.get("session_grads", {}).items() if n in live}
        self.weights_id = str(state.get("weights_id") or _new_id())

    # -- calls --------------------------------------------------------------------------------------
    def run(self, call: Call, generator: Any = None) -> Reply:
        """Carry out one call; `generator`: the engine that generates for this job on its service (a vLLM
        wrapper around this one, or None: this one). A user error comes back in the reply, changing nothing."""
        try:
            if isinstance(call, ForwardBackward):
                return self.forward_backward(call)
            if isinstance(call, OptimStep):
                return self.optim_step(call)
            if isinstance(call, Sample):
                return self.sample(call, generator if generator is not None else self)
            if isinstance(call, Samples):  # (its calls run together: `sampling.sample_many`)
                gen, n = generator if generator is not None else self, len(call.calls)
                return sampling.bundled(sampling.sample_many([self] * n, [gen] * n, call.calls))
            if isinstance(call, Save):
                return self.save(call)
            if isinstance(call, Load):
                return self.load(call)
        except CallRefused as exc:
            return Reply(error=str(exc))
        except Exception as exc:
            if isinstance(call, OptimStep | Load):  # (weights may be half-changed: the node fails, as a job's does)
                raise
            # a call that changes at most the accumulated gradients failed on the service: the session goes on
            log.exception("session call %s failed", call.kind)
            if isinstance(call, ForwardBackward):
                return self.failed(call, exc)
            return Reply(error=failed_text(call.kind, exc))
        raise TypeError(f"not a session call: {type(call).__name__}")

    def forward_backward(self, call: ForwardBackward) -> Reply:
        """The call's loss over its data: per datum the target tokens' log-probs (`logprobs`), and with
        `backward` the loss's gradients added to the accumulated ones. Forward passes take at most
        `MAX_FORWARD_TOKENS` padded tokens each; the loss is a sum, so their gradients add up to the whole's.
        Several sessions' calls in one pass: `training.forward_backward_many`."""
        self.check_data(call)
        self._activate()
        model = self.inner.policy
        params = self.trainable()
        model.train(call.backward)
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        try:
            for part in _forward_parts([len(d.tokens) for d in call.data], MAX_FORWARD_TOKENS):
                data = [call.data[i] for i in part]
                with torch.set_grad_enabled(call.backward):
                    lps = self._target_logprobs(model, data)
                    loss = torch.zeros((), device=self.inner.device)
                    for d, lp in zip(data, lps, strict=True):
                        inputs = {k: torch.from_numpy(v).to(lp.device) for k, v in d.inputs.items()}
                        loss = loss + losses.elementwise(call.loss, lp, inputs, call.config).sum()
                        outputs.append({"logprobs": lp.detach().float().cpu().numpy()})
                    if call.backward:
                        loss.backward()
                        self._accumulate(params)
                total += float(loss.detach())
        finally:
            for p in params.values():
                p.grad = None
            model.eval()
        tokens = sum(len(d.tokens) for d in call.data)
        return Reply({"outputs": outputs, "metrics": {"loss:sum": total}},
                     metrics={"loss": total, "datums": float(len(call.data)), "tokens": float(tokens)})  # fmt: skip

    def check_data(self, call: ForwardBackward) -> None:
        """Raise `CallRefused` naming the first problem of a forward_backward call's loss config or data."""
        vocab = int(self.inner.policy.get_input_embeddings().weight.shape[0])
        problem = losses.check_config(call.loss, call.config)
        for i, d in enumerate(call.data):
            if problem is not None:
                break
            if d.tokens.ndim != 1 or not len(d.tokens) or d.tokens.dtype != np.int64:
                problem = f"datum {i}: the model input must be a non-empty list of token ids"
            elif int(d.tokens.min()) < 0 or int(d.tokens.max()) >= vocab:
                problem = f"datum {i}: model input token ids must lie in [0, {vocab})"
            else:
                problem = losses.check(call.loss, d.inputs, len(d.tokens), vocab)
                problem = None if problem is None else f"datum {i}: {problem}"
        if problem is not None:
            raise CallRefused(problem)

    def failed(self, call: ForwardBackward, exc: BaseException) -> Reply:
        """The reply of a forward_backward that failed on the service: the gradients accumulated since the last
        optim_step are dropped (part of this call's may have been added)."""
        dropped = ""
        if call.backward and self.grads:
            self.grads = {}
            dropped = "; the gradients accumulated since the last optim_step were dropped"
        return Reply(error=failed_text(call.kind, exc) + dropped)

    def _target_logprobs(self, model: Any, data: list[Any]) -> list[Tensor]:
        """One forward over `data` (right-padded): per datum the log-prob [N] (or [N, K]) of each position's
        target token(s) under the current weights at temperature 1."""
        from plexrl.engines.torch_engine import positions

        device = self.inner.device
        width = max(len(d.tokens) for d in data)
        ids = torch.zeros((len(data), width), dtype=torch.long)
        mask = torch.zeros((len(data), width), dtype=torch.long)
        for i, d in enumerate(data):
            ids[i, : len(d.tokens)] = torch.from_numpy(d.tokens)
            mask[i, : len(d.tokens)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
        if all(d.inputs["target_tokens"].ndim == 1 for d in data):  # the batch at once, then a row per datum (a
            # row sliced off the logits instead would fill a gradient of the whole logits per datum in backward)
            target = torch.zeros((len(data), width), dtype=torch.long)
            for i, d in enumerate(data):
                target[i, : len(d.tokens)] = torch.from_numpy(d.inputs["target_tokens"])
            lp = -F.cross_entropy(logits.float().flatten(0, 1), target.to(device).flatten(), reduction="none")
            rows = lp.view(len(data), width)
            return [rows[i, : len(d.tokens)] for i, d in enumerate(data)]
        out: list[Tensor] = []
        for i, d in enumerate(data):
            n = len(d.tokens)
            target = torch.from_numpy(d.inputs["target_tokens"]).to(device)
            row = logits[i, :n].float()
            if target.ndim == 1:
                out.append(-F.cross_entropy(row, target, reduction="none"))
            else:
                out.append(F.log_softmax(row, dim=-1).gather(-1, target))
        return out

    def _accumulate(self, params: dict[str, Tensor]) -> None:
        for name, p in params.items():
            if p.grad is None:
                continue
            held = self.grads.get(name)
            self.grads[name] = p.grad.detach().clone() if held is None else held.add_(p.grad.detach())
            p.grad = None

    def optim_step(self, call: OptimStep) -> Reply:
        """One AdamW step on the accumulated gradients (clipped to `grad_clip_norm` when > 0), then they are
        cleared; the trained weights change (`weight_version` + 1, a new `weights_id`)."""
        if not self.grads:
            raise CallRefused(
                "no gradient to apply: call forward_backward before optim_step (a session resumed after a server "
                "restart starts from its last checkpoint, without the gradients accumulated since)"
            )
        params = self.trainable()
        for name, p in params.items():
            p.grad = self.grads.get(name)
        listed = [p for p in params.values() if p.grad is not None]
        limit = call.grad_clip_norm if call.grad_clip_norm > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(listed, limit))
        opt = self._optimizer()
        for group in opt.param_groups:
            group["lr"], group["betas"], group["eps"] = call.learning_rate, (call.beta1, call.beta2), call.eps
            group["weight_decay"] = call.weight_decay
        opt.step()
        for p in params.values():
            p.grad = None
        self.grads = {}
        self.inner.weight_version += 1
        self.weights_id = _new_id()
        return Reply({"metrics": {"grad_norm": norm}}, metrics={"grad_norm": norm, "lr": call.learning_rate})

    @contextlib.contextmanager
    def weights(self, path: str | None, weights_id: str | None) -> Iterator[None]:
        """The trained weights of a sampler snapshot (`path`, holding `weights_id`) in place for the body, the
        live ones back after; nothing is loaded when they are the live ones. The weight version is marked
        meanwhile, so a generation engine that caches weights by version reloads them both times."""
        if path is None or weights_id == self.weights_id:
            yield
            return
        from safetensors.torch import load_file

        live = self.trainable()
        if not Path(path).is_file():
            raise CallRefused("this sampling client's weights snapshot was dropped (a model keeps its latest "
                              "snapshots only); make a new one with save_weights_and_get_sampling_client")  # fmt: skip
        saved = load_file(path)
        if set(saved) != set(live) or any(saved[n].shape != live[n].shape for n in live):
            raise CallRefused(f"the sampler weights at {Path(path).name} do not fit this session's model")
        kept = {n: t.detach().clone() for n, t in live.items()}
        version = self.inner.weight_version
        try:
            with torch.no_grad():
                for n, t in live.items():
                    t.copy_(saved[n])
            self.inner.weight_version = -1 - abs(hash(weights_id)) % (2**31)
            yield
        finally:
            with torch.no_grad():
                for n, t in live.items():
                    t.copy_(kept[n])
            self.inner.weight_version = version

    def sample(self, call: Sample, generator: Any) -> Reply:
        """`num_samples` completions of the prompt from `generator` under the sampler's weights: per sequence
        its tokens (the stop token included), their log-probs under the sampling distribution and why it
        ended; with `prompt_logprobs`, the prompt's log-probs (NaN where not scored: position 0, and before
        the last `prompt_logprobs_last_n`). Several sessions' calls in one engine call: `sampling.sample_many`."""
        sampling.check(self, call)
        with self.weights(call.weights, call.weights_id):
            self._activate()
            out = generator.generate([list(call.prompt)], **sampling.generate_kwargs(call))
            return sampling.reply(out, *sampling.prompt_scores(self, call), sessions=1)

    @torch.no_grad()
    def _prompt_topk(self, call: Sample) -> dict[str, np.ndarray]:
        """The `topk_prompt_logprobs` likeliest tokens at each prompt position and their log-probs under the
        current weights (temperature 1): `token_ids` [L, K] int32, `logprobs` [L, K] float32; the sentinel
        (token 0, -99999) where not scored (position 0, and before the last `prompt_logprobs_last_n`)."""
        from plexrl.engines.torch_engine import positions

        self._activate()
        k, n = call.topk_prompt_logprobs, len(call.prompt)
        ids = torch.tensor([list(call.prompt)], device=self.inner.device)
        mask = torch.ones_like(ids)
        first = 1 if call.prompt_logprobs_last_n is None else n - call.prompt_logprobs_last_n
        model = self.inner.policy
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
        scored = F.log_softmax(logits[0, first - 1 : n - 1].float(), dim=-1).topk(k, dim=-1)  # row i: token i + 1
        token_ids = np.zeros((n, k), dtype=np.int32)
        logprobs = np.full((n, k), -99999.0, dtype=np.float32)
        token_ids[first:] = scored.indices.cpu().numpy()
        logprobs[first:] = scored.values.cpu().numpy()
        return {"token_ids": token_ids, "logprobs": logprobs}

    def save(self, call: Save) -> Reply:
        """Write the state (`export_state`: trained weights, optimizer, gradients) or the sampler weights
        (the trained tensors, safetensors) to the call's path, atomically."""
        from plexrl.services.swap import save_checkpoint

        path = Path(call.path)
        if call.what == "state":
            save_checkpoint({"engine": self.export_state()}, path)
        else:
            from safetensors.torch import save_file

            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            save_file({n: t.detach().cpu().contiguous() for n, t in self.trainable().items()}, str(tmp),
                      metadata={"weights_id": self.weights_id})  # fmt: skip
            tmp.replace(path)
        return Reply({"path": str(path), "weights_id": self.weights_id}, metrics={"saved": 1.0})

    def load(self, call: Load) -> Reply:
        """The trained weights of the state at the call's path (and its optimizer state with `optimizer`; else
        a fresh optimizer); accumulated gradients are dropped."""
        from plexrl.services.swap import load_checkpoint

        live = self.trainable()
        try:
            if call.path.endswith(".safetensors"):  # a sampler's weights: the trained tensors only
                from safetensors.torch import load_file

                key = "adapter" if hasattr(self.inner, "shared") else "policy"
                state: dict[str, Any] = {key: load_file(call.path)}
            else:
                state = load_checkpoint(Path(call.path))["engine"]
        except Exception as exc:  # (nothing changed yet)
            raise CallRefused(f"the saved state cannot be read: {type(exc).__name__}: {exc}") from None
        weights = _trained_in(state, live)
        if weights is None:
            raise CallRefused("that checkpoint does not fit this session's model (another base, rank or modules)")
        with torch.no_grad():
            for n, t in live.items():
                t.copy_(weights[n])
        if call.optimizer and "optimizer" in state:
            self._optimizer().load_state_dict(state["optimizer"])
        else:
            self.inner.optimizer = torch.optim.AdamW(list(live.values()))
        self.grads = {}
        self.inner.weight_version += 1
        self.weights_id = _new_id()
        return Reply({"path": call.path}, metrics={"loaded": 1.0})


ADAPTER = re.compile(r"\.job_[0-9a-f]{12}\.")  # a LoRA job's adapter name inside a parameter name (`adapter_name`)


def canonical(name: str) -> str:
    """A parameter name without the job's own adapter name (`.job_<hash>.` -> `.adapter.`)."""
    return ADAPTER.sub(".adapter.", name)


def _trained_in(state: dict[str, Any], live: dict[str, Tensor]) -> dict[str, Tensor] | None:
    """The trained tensors of an exported state by the live names (a LoRA state's `adapter`, a full one's
    `policy`), or None when they do not match the live ones' names and shapes."""
    adapter = {canonical(k): v for k, v in state.get("adapter", {}).items()}
    found = adapter or {k: v for k, v in state.get("policy", {}).items() if k in live}
    if set(found) != set(live) or any(found[n].shape != live[n].shape for n in live):
        return None
    return dict(found)


def _forward_parts(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive datums in parts whose padded size (count x longest) stays within `budget` tokens (a longer
    datum alone)."""
    out: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, n) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def check_session_model(lora: Any, dtype: str) -> str | None:
    """Why a session cannot train this model setting, or None: full fine-tuning sessions run in float32."""
    if lora is None and dtype != "float32":
        return "a full fine-tuning session trains in float32; set dtype float32 or use a LoRA adapter"
    return None


def session_engine(engine: Any) -> SessionEngine:
    """The `SessionEngine` of a job's engine on its service (inside a vLLM wrapper: its trainer)."""
    inner = engine
    while not isinstance(inner, SessionEngine):
        inner = getattr(inner, "trainer", None)
        if inner is None:
            raise TypeError("this job is not a session (its engine has no SessionEngine)")
    return inner


__all__ = ["MAX_FORWARD_TOKENS", "CallRefused", "SessionEngine", "check_session_model", "session_engine"]
