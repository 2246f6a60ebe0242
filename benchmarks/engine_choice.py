"""Which rollout engine is faster for which model: the evidence behind `engine: auto`'s rule.

For Llama models of growing size (built locally, random weights), one rollout of the main job's shape
(`--prompts` addition prompts x `--n` samples, temperature 1.0, at most `--tokens` new tokens) on the torch
engine (`TorchEngine.generate`) and on vLLM (`VLLMEngine.generate` on an in-process engine), side by side in
one process with `--threads` torch threads (1 = a service's default in the shipped mixes). Seconds per
rollout: median over `--repeats` calls after one untimed warm-up; the same seeds on both. Prints the ratio
vLLM / torch per size and the smallest size at which vLLM was faster: `engine: auto` picks vLLM from
`vllm.auto_min_params` parameters on (plexrl/job/config.py), a threshold set from this table.

    .venv/bin/python benchmarks/engine_choice.py [--tokens 6] [--repeats 3] [--threads 1] [--smoke]

`--smoke`: the smallest size, 1 repeat, 4 prompts (the test suite runs it when vLLM is installed).

`--lora R` instead: the real SmolLM2-135M-Instruct (or its first `--layers` decoder layers,
`benchmarks/_smol_short.py`) on four engines, the full model and a rank-R LoRA adapter on q/k/v/o each on torch
(`TorchEngine`, `LoRAEngine` over a `SharedBase`) and on vLLM (`VLLMEngine`, `VLLMLoRAEngine` on a LoRA-enabled
engine), the real job's prompts (its chat template over addition questions), `--prompts` x `--n` samples of at
most `--tokens` tokens. The model stops at its end-of-turn token, so lengths differ between engines: printed
as generated tokens per second beside the seconds. The evidence for what `engine: auto` picks for LoRA jobs.

    .venv/bin/python benchmarks/engine_choice.py --lora 16 [--layers 30] [--prompts 8 --n 8 --tokens 24]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

SIZES = {  # name: layers, hidden, heads, intermediate (head size 32 or 64: both served by vLLM's CPU attention)
    "0.5M": (2, 128, 4, 512),
    "2M": (4, 192, 3, 768),
    "5M": (4, 320, 5, 1280),
    "14M": (6, 384, 6, 1536),
    "32M": (10, 512, 8, 1376),
}


def median_seconds(fn: Callable[..., object], repeats: int) -> float:
    """Median seconds of fn(seed=k) for k = 1..repeats, after an untimed fn(seed=0)."""
    fn(seed=0)  # warm-up
    times = []
    for seed in range(1, repeats + 1):
        t0 = time.perf_counter()
        fn(seed=seed)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=6, help="max new tokens (the main job: 6)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--smoke", action="store_true", help="smallest size, 1 repeat, 4 prompts (for the tests)")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank: SmolLM2 with and without an adapter instead")
    ap.add_argument("--layers", type=int, default=30, help="with --lora: SmolLM2's first LAYERS layers (30: all)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.sizes, args.repeats, args.prompts = ["0.5M"], 1, 4
    if args.lora:
        return lora_rows(args)
    from plexrl.engines.torch_engine import TorchEngine
    from plexrl.engines.vllm_engine import SharedLLM, VLLMEngine, vllm_installed
    from plexrl.job.model_config import ModelConfig
    from plexrl.job.models import build_model, build_tokenizer

    if not vllm_installed():
        raise SystemExit("vLLM is not installed: make setup-vllm")
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="plexrl-engine-choice-") as tmp:
        for name in args.sizes:
            layers, hidden, heads, inter = SIZES[name]
            d = Path(tmp) / name
            d.mkdir()
            tok = build_tokenizer(d)
            model = ModelConfig(layers=layers, hidden=hidden, heads=heads, intermediate=inter, max_position=64)
            build_model(model, tok, d, seed=0)
            trainer = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
            params = sum(p.numel() for p in trainer.policy.parameters())
            shared = SharedLLM(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, kv_cache_bytes=64 * 2**20)
            torch.set_num_threads(args.threads)  # building an LLM may change it
            wrapper = VLLMEngine(trainer, shared, "bench")
            prompts = [tok(f"{100 + 97 * i % 900}+{555 - 41 * i % 400}=")["input_ids"] for i in range(args.prompts)]
            kw = {"n": args.n, "temperature": 1.0, "max_new_tokens": args.tokens}
            t_torch, t_vllm = (
                median_seconds(partial(engine.generate, prompts, **kw), args.repeats) for engine in (trainer, wrapper)
            )
            shared.shutdown()
            rows.append((name, params, t_torch, t_vllm))
            print(f"{name:>5} {params / 1e6:6.2f}M params: torch {t_torch:.3f}s vLLM {t_vllm:.3f}s "
                  f"vLLM/torch time {t_vllm / t_torch:.2f}", flush=True)  # fmt: skip
    print(f"\n{args.prompts} prompts x {args.n} samples, <= {args.tokens} new tokens, {args.threads} torch thread(s), "
          f"median of {args.repeats}")  # fmt: skip
    print(f"{'model':>6}{'params':>10}{'torch s':>10}{'vLLM s':>10}{'vLLM / torch time':>19}{'faster':>8}")
    for name, params, t_torch, t_vllm in rows:
        faster = "vLLM" if t_vllm < t_torch else "torch"
        print(f"{name:>6}{params / 1e6:>9.2f}M{t_torch:>10.3f}{t_vllm:>10.3f}{t_vllm / t_torch:>19.2f}{faster:>8}")
    wins = [params for _, params, t_torch, t_vllm in rows if t_vllm < t_torch]
    print(f"smallest model where vLLM was faster: {min(wins) / 1e6:.2f}M parameters" if wins else
          "vLLM was faster for none of these sizes")  # fmt: skip


def lora_rows(args: argparse.Namespace) -> None:
    """SmolLM2 on torch and vLLM, without and with a rank-`args.lora` adapter (see the module docstring)."""
    import sys

    from transformers import AutoTokenizer

    from plexrl.data.prompts import prompt_ids, render_prompt
    from plexrl.engines.lora import LoRAEngine, SharedBase
    from plexrl.engines.torch_engine import TorchEngine
    from plexrl.engines.vllm_engine import SharedLLM, VLLMEngine, vllm_installed
    from plexrl.engines.vllm_lora import SharedLoRALLM, VLLMLoRAEngine
    from plexrl.job.pretrained import pretrained_path

    if not vllm_installed():
        raise SystemExit("vLLM is not installed: make setup-vllm")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _smol_short import NAME, short_copy

    model = pretrained_path(NAME) if args.layers >= 30 else short_copy(args.layers)
    tok = AutoTokenizer.from_pretrained(model)
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    pairs = [(10 + 37 * i % 90, 55 - 13 * i % 40) for i in range(args.prompts)]
    questions = [f"What is {a} + {b}? Answer with the number only." for a, b in pairs]
    prompts = [prompt_ids(tok, render_prompt(tok, q)) for q in questions]  # as the job renders them
    kw = {"n": args.n, "temperature": 1.0, "max_new_tokens": args.tokens}
    torch.set_num_threads(args.threads)
    rows: list[tuple[str, float, float]] = []

    def timed(name: str, engine: Any) -> None:
        tokens: list[int] = []

        def call(seed: int) -> None:
            tokens.append(int(engine.generate(prompts, seed=seed, **kw).response_mask.sum()))

        seconds = median_seconds(call, args.repeats)
        rows.append((name, seconds, statistics.median(tokens[1:]) / seconds))
        print(f"{name:<14} {seconds:8.3f} s  {rows[-1][2]:8.1f} tokens/s", flush=True)

    full = TorchEngine(model, eos_id=eos, pad_id=pad)
    timed("torch", full)
    shared = SharedLLM(model, eos_id=eos, pad_id=pad, kv_cache_bytes=256 * 2**20, max_model_len=512)
    torch.set_num_threads(args.threads)  # building an LLM may change it
    timed("vLLM", VLLMEngine(full, shared, "bench"))
    shared.shutdown()
    del full
    base = SharedBase(model, torch.device("cpu"), "eager")
    trainer = LoRAEngine(base, "bench", eos_id=eos, pad_id=pad, seed=0, r=args.lora, alpha=2.0 * args.lora,
                         dropout=0.0, targets=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    timed("torch + LoRA", trainer)
    llm = SharedLoRALLM(model, r=args.lora, eos_id=eos, pad_id=pad, kv_cache_bytes=256 * 2**20, max_model_len=512)
    torch.set_num_threads(args.threads)
    timed("vLLM + LoRA", VLLMLoRAEngine(trainer, llm, "bench"))
    llm.shutdown()
    print(
        f"\n{model.name} ({args.layers} layers), LoRA r {args.lora} on q/k/v/o; {args.prompts} prompts x "
        f"{args.n} samples, <= {args.tokens} new tokens, {args.threads} torch thread(s), median of {args.repeats}"
    )
    print(f"{'engine':<14}{'seconds':>9}{'tokens/s':>10}{'x torch (same weights)':>24}")
    for i, (name, seconds, rate) in enumerate(rows):
        print(f"{name:<14}{seconds:>9.3f}{rate:>10.1f}{rate / rows[i - i % 2][2]:>24.2f}")


if __name__ == "__main__":
    main()
