"""The `sessions` part of the GPU check (benchmarks/gpu_check.py): N LoRA sessions over one base on one service,
as a Tinker server runs them, without the HTTP in between (the SDK's own cost is measured on CPU: 1.05x the
same calls in-process, docs/benchmarks.md). A session's step is one sample call (`--group` samples of
`--tokens` tokens), one `forward_backward` (cross entropy on what it sampled) and one `optim_step`.

- alone: each session's step by itself, one session after another (the single-session rate r1);
- together: the N sessions' sample calls as ONE cohort (one engine call, `plexrl/sessions/sampling.py`), their
  forward_backward calls as one cohort (one training pass on an accelerator, `plexrl/sessions/training.py`),
  then each session's optim_step.

Printed: steps per second together / alone next to the bound N, and where each arm's seconds went by call. The
goal of issue "many sessions, one engine call" is >= 3x at 8 sessions (SkyRL's multi-tenant LoRA reports 2.81x);
on a CPU the forward_backward cohort runs its calls one after another (`training.ONE_PASS_DEVICES`), so a CPU
dry run says nothing of the GPU figure.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def session_spec(model: Path, name: str, run_dir: Path, seed: int, device: str = "cpu") -> Any:
    """A LoRA session's spec with the defaults of `device` (on CUDA a bfloat16 base and sdpa, as a server gives)."""
    from plexrl.sessions.spec import SessionConfig, prepare_session

    lora = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    cfg = SessionConfig.model_validate({
        "kind": "session", "name": name, "seed": seed, "run_dir": str(run_dir), "engine": "torch",
        "model": {"path": str(model), "lora": lora},
        "tracking": {"mlflow": False, "progress": False, "log_model": False},
    })  # fmt: skip
    return prepare_session(cfg, device=device)


def sessions(model: Path, device: torch.device, n: int, steps: int, group: int, tokens: int, work: Path) -> float:
    """Run both arms (see the module docstring), print the figures; returns together / alone."""
    from plexrl.services.batched import Member, run_cohort
    from plexrl.services.service import Service
    from plexrl.sessions.calls import Datum, ForwardBackward, OptimStep, Sample, unpack

    svc = Service("s0", device=str(device), spill_dir=work / "spill")
    ids = [f"s{i}" for i in range(n)]
    prompt = (1, 17, 25, 9, 12, 30, 4)
    seconds: dict[str, dict[str, float]] = {"warm-up": {}, "alone": {}, "together": {}}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(arm: str, kind: str, fn: Any) -> Any:
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        seconds[arm][kind] = seconds[arm].get(kind, 0.0) + time.perf_counter() - t0
        return out

    def reply_of(result: Any) -> dict[str, Any]:
        if not result.report.ok:
            raise RuntimeError(f"a session call failed: {result.report.error}")
        got: dict[str, Any] = unpack(result.report.reply)
        if got.get("error"):
            raise RuntimeError(f"a session call was refused: {got['error']}")
        return got

    def fb_of(sample_reply: dict[str, Any]) -> ForwardBackward:
        data = []
        for seq in sample_reply["value"]["sequences"]:
            toks = np.array([*prompt, *seq["tokens"]], dtype=np.int64)
            targets = np.array([*toks[1:], toks[0]], dtype=np.int64)
            weights = np.zeros(len(toks), dtype=np.float32)
            weights[len(prompt) - 1 : -1] = 1.0
            data.append(Datum(toks, {"target_tokens": targets, "weights": weights}))
        return ForwardBackward(tuple(data), "cross_entropy")

    def single(job: str, step: int, call: Any) -> dict[str, Any]:
        return reply_of(svc.run_node(job, step, call.kind, {}, call=call))

    def cohort(step: int, calls: list[Any]) -> list[dict[str, Any]]:
        members = [Member(j, step, c.kind, {}, c) for j, c in zip(ids, calls, strict=True)]
        return [reply_of(r) for r in run_cohort(svc, members, (), ())]

    try:
        for i, job in enumerate(ids):
            svc.load_job(session_spec(model, job, work / "runs", seed=i, device=device.type))
        step = 0
        for arm in ("warm-up", "alone", "together"):
            for _ in range(1 if arm == "warm-up" else steps):
                step += 1
                calls = [Sample(prompt, num_samples=group, max_tokens=tokens, seed=1000 * step + i) for i in range(n)]
                if arm == "together":
                    samples = timed(arm, "sample", functools.partial(cohort, step, calls))
                    timed(arm, "forward_backward", functools.partial(cohort, step, [fb_of(s) for s in samples]))
                else:
                    for j, c in zip(ids, calls, strict=True):
                        s = timed(arm, "sample", functools.partial(single, j, step, c))
                        timed(arm, "forward_backward", functools.partial(single, j, step, fb_of(s)))
                for j in ids:
                    timed(arm, "optim_step", functools.partial(single, j, step, OptimStep(1e-4)))
    finally:
        svc.close()
    ratio = sum(seconds["alone"].values()) / sum(seconds["together"].values())
    print(f"{n} LoRA sessions (r 16) over one base on {device}; a step: one sample call ({group} x {tokens} tokens), "
          f"one forward_backward, one optim_step; {steps} timed steps per session in each arm")  # fmt: skip
    for arm in ("alone", "together"):
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in seconds[arm].items())
        print(f"  {arm:<9} {sum(seconds[arm].values()):7.2f} s for {n * steps} session-steps ({parts})")
    print(f"together / alone: {ratio:.2f}x the steps per second (bound {n}x; goal >= 3x at 8 sessions)")
    return ratio


__all__ = ["session_spec", "sessions"]
