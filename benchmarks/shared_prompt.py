"""The training step of a GRPO batch with each prompt computed once for its n samples, against the plain forward.

    .venv/bin/python benchmarks/shared_prompt.py [--groups 2] [--n 8] [--prompt 66] [--response 18] [--reps 3]
        [--model smollm2-135m-instruct] [--smoke]

One minibatch of `groups` prompts x `n` samples (the SmolLM2 addition job's shape: 16 rows per AdamW step, a
66-token prompt, an 18-token answer; token ids drawn at random: the cost does not depend on them) through a
forward + backward of a token-mean surrogate on the response log-probs, side by side in this process:
(a) plain: the forward a user would write, the output head on the responses only (`logits_to_keep`, what the
    engine did before `plexrl/engines/prefix.py`), over every row's prompt + response;
(b) shared: `scored_logprobs` as the engine runs it (each distinct prompt once, its KV cache for its rows).
Both give the same loss and gradients (checked here and in tests/test_prefix.py). Printed: seconds per
minibatch (best of `--reps` after one untimed warm-up each), the ratio, and each arm's compute bound (6 FLOPs
per parameter per token it must compute, at the machine's measured fp32 matmul rate; attention not counted).

`--smoke`: a tiny random model, 1 rep (the test suite runs it; its figures mean nothing).
Run it alone on the machine: other processes on the 2 cores distort every figure.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

from plexrl.engines.torch_engine import positions, scored_logprobs, token_logprobs


def matmul_gflops(seconds: float) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return 2 * 1024**3 * n / (time.perf_counter() - start) / 1e9


def load_model(name: str, smoke: bool) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if smoke:
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        )  # fmt: skip
        return LlamaForCausalLM(cfg).float()
    from plexrl.job.pretrained import pretrained_path

    path = pretrained_path(name, convert=False)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")


def batch(vocab: int, groups: int, n: int, prompt: int, response: int) -> tuple[torch.Tensor, ...]:
    """`groups` prompts x `n` samples: left-padded prompts (the first a few tokens shorter), right-padded
    responses of lengths from `response` down to about half of it."""
    g = torch.Generator().manual_seed(0)
    rows = groups * n
    ids = torch.zeros(rows, prompt + response, dtype=torch.long)
    attn = torch.zeros_like(ids)
    scored = torch.zeros(rows, prompt + response)
    for k in range(groups):
        width = prompt - (3 if k == 0 else 0)
        tokens = torch.randint(3, vocab, (width,), generator=g)
        for j in range(n):
            i = k * n + j
            length = response - (j * response // (2 * n))
            ids[i, prompt - width : prompt], attn[i, prompt - width : prompt] = tokens, 1
            ids[i, prompt : prompt + length] = torch.randint(3, vocab, (length,), generator=g)
            attn[i, prompt : prompt + length], scored[i, prompt : prompt + length] = 1, 1
    return ids, attn, scored


def plain_logprobs(model: Any, ids: torch.Tensor, attn: torch.Tensor, start: int) -> torch.Tensor:
    keep = ids.shape[1] - start + 1
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions(attn), logits_to_keep=keep).logits
    lp = token_logprobs(logits, ids[:, start - 1 :], 1.0)[0]
    return torch.cat([lp.new_zeros(ids.shape[0], start - 1), lp], 1)


def step(model: Any, arm: str, ids: torch.Tensor, attn: torch.Tensor, scored: torch.Tensor, start: int) -> float:
    """One forward + backward; returns the loss."""
    model.zero_grad(set_to_none=True)
    if arm == "plain":
        lp = plain_logprobs(model, ids, attn, start)
    else:
        lp = scored_logprobs(model, ids, attn, 1.0, scored, use_cache=False)[0]
    loss = -(lp * scored).sum() / scored.sum()
    loss.backward()
    return float(loss.detach())


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=66)
    ap.add_argument("--response", type=int, default=18)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.reps, args.prompt, args.response = 1, 12, 4
    torch.set_num_threads(torch.get_num_threads())
    model = load_model(args.model, args.smoke)
    model.train()
    vocab = int(model.config.vocab_size)
    ids, attn, scored = batch(vocab, args.groups, args.n, args.prompt, args.response)
    start = args.prompt
    seconds: dict[str, float] = {}
    losses: dict[str, float] = {}
    grads: dict[str, torch.Tensor] = {}
    for arm in ("plain", "shared"):
        step(model, arm, ids, attn, scored, start)  # warm-up, untimed
        best = float("inf")
        for _ in range(args.reps):
            t0 = time.perf_counter()
            losses[arm] = step(model, arm, ids, attn, scored, start)
            best = min(best, time.perf_counter() - t0)
        seconds[arm] = best
        grads[arm] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    same = abs(losses["plain"] - losses["shared"]) <= 1e-4 * max(1.0, abs(losses["plain"]))
    rel = float((grads["plain"] - grads["shared"]).norm() / grads["plain"].norm().clamp(min=1e-12))
    if not (same and rel < 1e-4):  # float sums in another order: ~1e-6 of the gradient's norm
        raise SystemExit(f"the arms disagree: loss {losses}, gradient difference {rel:.2e} of its norm")

    params = sum(p.numel() for p in model.parameters())
    head = vocab * int(model.config.hidden_size)
    rows, resp = args.groups * args.n, float(scored.sum()) / (args.groups * args.n)
    prompt_tokens = float(attn[:, :start].sum()) / rows
    tokens = {"plain": rows * prompt_tokens, "shared": args.groups * prompt_tokens}
    rate = matmul_gflops(0.2 if args.smoke else 2.0)
    print(f"{rows} rows ({args.groups} prompts x {args.n} samples), prompt {prompt_tokens:.1f} tokens, response "
          f"{resp:.1f} on average; {params / 1e6:.1f} M parameters; fp32 matmul {rate:.0f} GFLOP/s")  # fmt: skip
    print(f"{'arm':8} {'s/minibatch':>12} {'bound s':>8} {'measured/bound':>15}")
    for arm in ("plain", "shared"):
        flops = 6 * ((params - head) * (tokens[arm] + rows * resp) + head * rows * resp)
        bound = flops / (rate * 1e9)
        print(f"{arm:8} {seconds[arm]:12.3f} {bound:8.3f} {seconds[arm] / bound:15.2f}")
    print(f"plain / shared = {seconds['plain'] / seconds['shared']:.2f}x (same loss; gradients differ by {rel:.1e} of "
          "their norm: float sums in another order)")  # fmt: skip


if __name__ == "__main__":
    main()
