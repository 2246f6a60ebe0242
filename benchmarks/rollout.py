"""Rollout throughput: raw `vllm.LLM.generate`, PlexRL's `VLLMEngine` wrapper and the torch engine, side by
side in one run, on the tiny model of the main job and on a ~30M-parameter Llama, both built locally.

Workload per call: a batch of 64 sequences (8 addition prompts x 8 samples, as in GRPO), temperature 1.0,
`--tokens` new tokens at most (random weights rarely sample eos, and the untrained tiny model never does, so
nearly every row runs to the limit; the mean length is printed so the three can be compared). tokens/s =
generated tokens / wall seconds of the call, median over `--repeats` after one untimed warm-up.

* raw vLLM: one `LLM.generate` call with `SamplingParams(n=8, logprobs=0)` on the same in-process engine the
  wrapper uses (same settings: fp32, eager, processed log-probs), and the SAME detokenize setting as the
  wrapper: the wrapper asks vLLM to detokenize only when a stop string is given (none here), so raw calls
  pass `detokenize=False` too (vLLM's default is True; `--raw-detokenize` times raw calls with it, to show
  what it costs), and the same eos stop token;
* wrapper: `VLLMEngine.generate` (one request per row with its own seed, building the padded tensors and
  behaviour log-probs of `GenerationOutput`); goal: overhead <= 10% vs raw;
* torch: `TorchEngine.generate` (a KV-cached sampling loop); goal on the larger model: vLLM >= 1.5x torch.

Also timed: a weight sync (the policy's tensors streamed into vLLM after a training step) and a per-job
weight swap (two jobs alternating on one shared engine), median over the repeats.

    .venv/bin/python benchmarks/rollout.py [--repeats 5] [--tokens 128] [--skip-large] [--raw-detokenize] [--smoke]

`--smoke`: the tiny model only, built in a temporary directory, 8 tokens, 1 repeat (the test suite runs it;
it still imports vLLM and starts an engine: ~10 s).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

MODELS = {
    "tiny (0.4M, main job)": {"layers": 2, "hidden": 128, "heads": 4, "intermediate": 512, "max_position": 256},
    "30M": {"layers": 10, "hidden": 512, "heads": 8, "intermediate": 1376, "max_position": 256},
}


def build(name: str, sizes: dict[str, int], root: Path) -> tuple[Path, Any]:
    from plexrl.job.model_config import ModelConfig
    from plexrl.job.models import build_model, build_tokenizer

    d = root / name.split()[0]
    if not (d / "config.json").is_file():
        d.mkdir(parents=True, exist_ok=True)
        tok = build_tokenizer(d)
        build_model(ModelConfig(**sizes), tok, d, seed=0)  # type: ignore[arg-type]
    from transformers import AutoTokenizer

    return d, AutoTokenizer.from_pretrained(str(d))


def timed(fn: Callable[[int], int], repeats: int) -> tuple[float, float]:
    """Median seconds of fn(seed) for seeds 1..repeats (seed 0 is an untimed warm-up), and mean tokens."""
    fn(0)
    times, counts = [], []
    for seed in range(1, repeats + 1):
        t0 = time.perf_counter()
        counts.append(fn(seed))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), statistics.mean(counts)


def bench_model(
    name: str, sizes: dict[str, int], root: Path, repeats: int, tokens: int, raw_detokenize: bool = False
) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from plexrl.engines.torch_engine import TorchEngine
    from plexrl.engines.vllm_engine import SharedLLM, VLLMEngine, row_seed

    d, tok = build(name, sizes, root)
    prompts = [tok(f"{100 + 97 * i}+{555 - 41 * i}=")["input_ids"] for i in range(8)]
    n = 8
    params_count = sum(p.numel() for p in TorchEngine(d, eos_id=tok.eos_token_id, pad_id=0).policy.parameters())
    shared = SharedLLM(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, kv_cache_bytes=256 * 2**20)
    trainer = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, attention="sdpa")
    wrapper = VLLMEngine(trainer, shared, "job-a")
    wrapper.sync()
    row: dict[str, Any] = {"model": name, "params": params_count}

    def engines(greedy: bool) -> dict[str, Callable[[int], int]]:
        """Each takes the call's seed and returns the tokens generated; call k of every engine uses seed k, so
        raw and wrapper sample the same rows (greedy: all three produce the same tokens)."""
        kw: dict[str, Any] = {"n": n, "temperature": 1.0, "max_new_tokens": tokens, "greedy": greedy}

        def raw(seed: int) -> int:
            per, reqs = (1, [p for p in prompts for _ in range(n)]) if greedy else (n, prompts)
            temp = 0.0 if greedy else 1.0
            sp = [
                SamplingParams(
                    n=per, temperature=temp, max_tokens=tokens, logprobs=0, seed=row_seed(seed, i * per),
                    stop_token_ids=[tok.eos_token_id], detokenize=raw_detokenize,
                )
                for i in range(len(reqs))
            ]  # fmt: skip
            outs = shared.llm.generate([TokensPrompt(prompt_token_ids=p) for p in reqs], sp, use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        return {
            "raw vLLM": raw,
            "VLLMEngine": lambda seed: int(wrapper.generate(prompts, seed=seed, **kw).lengths.sum()),
            "torch": lambda seed: int(trainer.generate(prompts, seed=seed, **kw).lengths.sum()),
        }

    for greedy in (False, True):
        for label, fn in engines(greedy).items():
            sec, count = timed(fn, repeats)
            row[label, greedy] = (count / sec, count / (len(prompts) * n))

    # weight sync: the trainer's weights change (as after train), the next generation streams them in
    def sync() -> float:
        trainer.weight_version += 1
        load = wrapper.sync()
        assert load is not None and load.kind == "sync"
        return load.end - load.start

    row["sync"] = statistics.median([sync() for _ in range(repeats + 1)][1:])
    other = VLLMEngine(TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id), shared, "job-b")

    def swap() -> float:
        loads = [e.sync() for e in (other, wrapper)]
        assert all(w is not None and w.kind == "swap" for w in loads)
        return statistics.mean(w.end - w.start for w in loads if w is not None)

    row["swap"] = statistics.median([swap() for _ in range(repeats + 1)][1:])
    row["weight_mb"] = sum(t.numel() * 4 for t in trainer.policy.state_dict().values()) / 2**20
    shared.shutdown()
    return row


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--root", default="runs/bench-models", help="where the built models are cached")
    ap.add_argument("--skip-large", action="store_true", help="only the tiny model")
    ap.add_argument("--raw-detokenize", action="store_true", help="raw calls detokenize (the wrapper does not)")
    ap.add_argument("--smoke", action="store_true", help="tiny model in a temp dir, 8 tokens, 1 repeat (tests)")
    args = ap.parse_args(argv)
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="plexrl-rollout-")
        args.root, args.skip_large, args.repeats, args.tokens = tmp.name, True, 1, 8
    from plexrl.engines.vllm_engine import vllm_installed

    if not vllm_installed():
        raise SystemExit("vLLM is not installed: make setup-vllm")
    rows = []
    for name, sizes in MODELS.items():
        if args.skip_large and name != next(iter(MODELS)):
            continue
        rows.append(bench_model(name, sizes, Path(args.root), args.repeats, args.tokens, args.raw_detokenize))
    if tmp is not None:
        tmp.cleanup()
    detok = "raw calls detokenize, the wrapper does not" if args.raw_detokenize else "neither detokenizes"
    print(f"\nbatch 64 (8 prompts x 8 samples), <= {args.tokens} new tokens, torch threads "
          f"{torch.get_num_threads()}, median of {args.repeats}; sampled = temperature 1.0 (raw and wrapper with "
          f"the same seeds), greedy = the same tokens on all three; {detok}")  # fmt: skip
    print(f"{'model':24} {'decoding':8} {'params':>7} {'raw vLLM tok/s':>15} {'VLLMEngine':>11} {'torch':>9} "
          f"{'wrapper/raw':>12} {'vLLM/torch':>11} {'mean len':>15}")  # fmt: skip
    for r in rows:
        for greedy in (False, True):
            raw, ours, tch = (r[k, greedy][0] for k in ("raw vLLM", "VLLMEngine", "torch"))
            lens = "/".join(f"{r[k, greedy][1]:.0f}" for k in ("raw vLLM", "VLLMEngine", "torch"))
            print(f"{r['model']:24} {'greedy' if greedy else 'sampled':8} {r['params'] / 1e6:6.1f}M {raw:15,.0f} "
                  f"{ours:11,.0f} {tch:9,.0f} {ours / raw:12.3f} {ours / tch:11.2f} {lens:>15}")  # fmt: skip
    print(f"\n{'model':24} {'weights MiB':>12} {'weight sync s':>14} {'per-job swap s':>15}")
    for r in rows:
        print(f"{r['model']:24} {r['weight_mb']:12.1f} {r['sync']:14.4f} {r['swap']:15.4f}")


if __name__ == "__main__":
    main()
