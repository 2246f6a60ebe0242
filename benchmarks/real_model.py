"""A real pretrained model learning by RL alone: SmolLM2-135M-Instruct, no supervised warm start, DAPO
(GRPO with clip-higher and dynamic sampling; the config says which) on two-digit addition from a data file in
verl's layout, held-out greedy accuracy on 500 problems.

    .venv/bin/python benchmarks/real_model.py --write-data runs/data/addition   # the data files (once)
    .venv/bin/python benchmarks/real_model.py [--config configs/dapo_smollm2_addition.yaml] [--seeds 0,1,2]
        [--minutes 20] [--target 0.85] [--smoke]

Each seed runs alone, in this process (the lean path `plexrl run` takes), from the converted model in the
cache (`make setup`). The clock starts before the model loads and includes everything: rollouts, weight
syncs, training AND the held-out evaluations (500 greedy answers every `eval_every` iterations, which take a
good part of the time on 2 cores; the time outside evaluations is printed beside it). A seed stops when its
accuracy reaches `--target` or when `--minutes` have passed. Prints per seed the curve (iteration, minutes,
accuracy), the zero-shot accuracy (iteration 0, before any update), the first iteration at the target and
its time; writes each curve as a PNG under runs/real_model/ (and logs it to the job's MLflow run when
tracking is on). The bound beside the training time: one iteration's training FLOPs (forward + backward of
every trained row's response, each prompt once for its n samples, the output head on the responses only) at
the machine's measured fp32 matmul rate, the least time any implementation needs for that work.

The prompt: a short system prompt (the config's `data.system_prompt`), one worked example as an earlier chat
turn (the model follows "Answer: N" only when shown: docs/benchmarks.md), then the question: 66 tokens,
as accurate zero-shot as two worked examples under SmolLM2's default system prompt (114 tokens) and a third
cheaper to train on. The reward: 1 when the last "Answer: N" line gives the sum (`regex`), else 0.

`--smoke`: a tiny random model with the real SmolLM2 tokenizer, 2 iterations, 16 held-out problems, in a
temporary directory (the test suite runs it; its figures mean nothing).

Run it alone on the machine: other processes on the 2 cores distort every figure.
"""

from __future__ import annotations

import argparse
import copy
import logging
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXAMPLES = [(61, 17)]


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def messages(a: int, b: int) -> list[dict[str, str]]:
    """The worked example as an earlier turn, then the question (the config adds a short system prompt)."""
    out = []
    for x, y in EXAMPLES:
        out += [
            {"role": "user", "content": question(x, y)},
            {"role": "assistant", "content": f"{x} + {y} = {x + y}\nAnswer: {x + y}"},
        ]
    return [*out, {"role": "user", "content": question(a, b)}]


def write_data(directory: str | Path, train: int = 5000, held_out: int = 500, seed: int = 0) -> tuple[Path, Path]:
    """`train.parquet` and `test.parquet` of distinct two-digit additions (disjoint, the worked example not among
    them) in verl's RL layout: data_source, prompt (chat messages), ability, reward_model {style,
    ground_truth}, extra_info {split, index}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if (a, b) not in EXAMPLES]
    rng.shuffle(pairs)
    if train + held_out > len(pairs):
        raise ValueError(f"at most {len(pairs)} distinct problems")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for split, rows in (("test", pairs[:held_out]), ("train", pairs[held_out : held_out + train])):
        table = pa.table(
            {
                "data_source": ["addition"] * len(rows),
                "prompt": [messages(a, b) for a, b in rows],
                "ability": ["math"] * len(rows),
                "reward_model": [{"style": "rule", "ground_truth": str(a + b)} for a, b in rows],
                "extra_info": [{"split": split, "index": i} for i in range(len(rows))],
            }
        )
        path = out / f"{split}.parquet"
        pq.write_table(table, path)
        files.append(path)
    return files[1], files[0]


def matmul_gflops(seconds: float = 1.0) -> float:
    """The machine's fp32 matmul rate (GFLOP/s) with the torch threads in use: the compute bound's rate."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return 2 * 1024**3 * n / (time.perf_counter() - start) / 1e9


def run_seed(cfg: dict[str, Any], seed: int, minutes: float, target: float) -> dict[str, Any]:
    """One seed alone, stopped at `target` or after `minutes`; its curve and timings."""
    from plexrl.hooks.base import Hook
    from plexrl.job.load import load_job
    from plexrl.job.spec import JobRun, prepare_job
    from plexrl.planner import Planner
    from plexrl.runtime.inline import InlineExecutor
    from plexrl.runtime.jobs import configure_torch, standard_hooks
    from plexrl.runtime.runner import Runner

    cfg = copy.deepcopy(cfg)
    cfg["seed"] = seed
    cfg["name"] = f"{cfg.get('name', 'real-model')}-seed{seed}"
    loaded = load_job(cfg)
    configure_torch(loaded.config.threads)
    start = time.perf_counter()
    spec = prepare_job(loaded)
    curve: list[tuple[int, float, float]] = []
    eval_s = [0.0]

    class Watch(Hook):
        def __init__(self) -> None:
            self.runner: Any = None

        def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
            eval_s[0] += metrics.get("time/evaluate", 0.0)
            elapsed = time.perf_counter() - start
            if "evaluate/accuracy" in metrics:
                curve.append((iteration + 1, elapsed / 60, metrics["evaluate/accuracy"]))
                print(f"  seed {seed} iteration {iteration + 1:>3}  {elapsed / 60:6.2f} min  held-out accuracy "
                      f"{metrics['evaluate/accuracy']:.3f}", flush=True)  # fmt: skip
                if metrics["evaluate/accuracy"] >= target:
                    self.runner.cancel(run.job_id, f"reached {target:.0%}")
            if elapsed > minutes * 60:
                self.runner.cancel(run.job_id, f"{minutes} minutes passed")

    watch = Watch()
    hooks = [
        *standard_hooks(Path(loaded.config.run_dir).resolve(), progress=False, mlflow=loaded.config.tracking.mlflow),
        watch,
    ]
    executor = InlineExecutor(services=1)
    runner = Runner(executor, Planner(clock=executor.clock), hooks=hooks)
    watch.runner = runner
    (run,) = runner.run([spec])
    wall = time.perf_counter() - start
    rows = run.history[1:]
    keys = ("time/rollout", "time/train", "time/evaluate", "time/iteration")
    means = {k: sum(r.get(k, 0.0) for r in rows) / max(len(rows), 1) for k in keys}
    # the compute bound of one iteration's training (a lower bound of the iteration): forward + backward,
    # 6 FLOPs per parameter per token, where a prompt counts once for its n samples (the engine computes a
    # shared prompt once: plexrl/engines/prefix.py) and the output head (vocab x hidden) runs on the response
    # tokens only (the engine computes no prompt logits); attention and generation not counted
    import json

    from plexrl.sizes import count_parameters

    params = count_parameters(spec.model_path)
    shape = json.loads((Path(spec.model_path) / "config.json").read_text())
    head = int(shape["vocab_size"]) * int(shape["hidden_size"])
    prompt = len(spec.task.train[0].prompt_ids) if hasattr(spec.task.train[0], "prompt_ids") else 0
    rows_n = sum(r.get("train/rows", 0.0) for r in rows) / max(len(rows), 1)
    resp = sum(r.get("rollout/response_length", 0.0) for r in rows) / max(len(rows), 1)
    n = int(loaded.config.pipeline.params.get("n", 8))
    flops = 6 * rows_n * ((params - head) * (prompt / n + resp) + head * resp)
    zero = run.history[0].get("evaluate/accuracy") if run.history else None
    if zero is not None and (not curve or curve[0][0] != 0):
        curve.insert(0, (0, 0.0, zero))
    return {"seed": seed, "run": run, "curve": curve, "wall": wall, "eval_s": eval_s[0], "means": means,
            "iterations": run.iterations_done, "flops": flops}  # fmt: skip


def plot(results: list[dict[str, Any]], target: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        ax.plot([m for _, m, _ in r["curve"]], [a for _, _, a in r["curve"]], marker="o", label=f"seed {r['seed']}")
    ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("minutes (2 CPU cores, evaluations included)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title)
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def smoke_config(tmp: Path) -> dict[str, Any]:
    """A tiny random model with the real SmolLM2 tokenizer and chat template; data written into `tmp`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from plexrl.job.pretrained import pretrained_path

    real = pretrained_path("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(str(real))
    model_dir = tmp / "model"
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    specials = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    config = LlamaConfig(vocab_size=len(tok), num_key_value_heads=2, max_position_embeddings=512, **sizes, **specials)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    train, test = write_data(tmp / "data", train=64, held_out=16)
    return {
        "name": "real-model-smoke", "iterations": 2, "run_dir": str(tmp / "runs"), "engine": "torch",
        "model": {"path": str(model_dir)}, "warm_start": {"enabled": False},
        "data": {"train": str(train), "held_out": str(test),
                 "rewards": [{"name": "regex", "params": {"pattern": "Answer:\\s*(-?\\d+)"}}]},
        "pipeline": {"name": "grpo", "params": {"batch_size": 2, "n": 2, "max_new_tokens": 4, "eval_every": 1,
                                                "eval_size": 16}},
        "tracking": {"mlflow": False, "progress": False, "log_model": False},
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/dapo_smollm2_addition.yaml")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, chosen before the runs (default 0,1,2)")
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-time budget per seed (default 20)")
    ap.add_argument("--target", type=float, default=0.85, help="held-out accuracy that ends a seed (default 0.85)")
    ap.add_argument("--write-data", metavar="DIR", help="write train.parquet and test.parquet into DIR and exit")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value by dotted key, the value read as YAML (a recipe trial), e.g. "
                         "--set pipeline.params.temperature=1.2; repeatable")  # fmt: skip
    ap.add_argument("--out", default="runs/real_model", help="where the curve PNG goes (default runs/real_model)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model with the real tokenizer, 2 iterations")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.write_data:
        train, test = write_data(args.write_data)
        print(f"wrote {train} and {test}")
        return
    tmp = tempfile.TemporaryDirectory(prefix="plexrl-real-") if args.smoke else None
    if tmp is not None:
        cfg, seeds, out = smoke_config(Path(tmp.name)), [0], Path(tmp.name) / "out"
    else:
        from plexrl.yamlio import load_yaml_file

        cfg, seeds, out = load_yaml_file(args.config), [int(s) for s in args.seeds.split(",")], Path(args.out)
        from plexrl.job.load import apply_overrides

        problems = apply_overrides(cfg, args.set)  # the same `--set` as `plexrl run`
        if problems:
            raise SystemExit("\n".join(f"{p.where}: {p.message}" for p in problems))
        for split in ("train", "held_out"):
            if not Path(cfg["data"][split]).is_file():
                raise SystemExit(f"{cfg['data'][split]} is missing: run benchmarks/real_model.py --write-data "
                                 f"{Path(cfg['data'][split]).parent}")  # fmt: skip
    rate = matmul_gflops(0.2 if args.smoke else 2.0)
    results = [run_seed(cfg, s, args.minutes, args.target) for s in seeds]
    print()
    print(f"{'seed':>4} {'zero-shot':>9} {'final':>6} {'iterations':>10} {'first >= target':>16} {'minutes':>8} "
          f"{'of which eval':>13} {'s/it rollout':>12} {'s/it train':>10}")  # fmt: skip
    for r in results:
        curve = r["curve"]
        hit = next(((i, m) for i, m, a in curve if a >= args.target), None)
        zero = curve[0][2] if curve else float("nan")
        final = curve[-1][2] if curve else float("nan")
        first = f"it {hit[0]} ({hit[1]:.1f} min)" if hit else "not reached"
        m = r["means"]
        print(f"{r['seed']:>4} {zero:>9.3f} {final:>6.3f} {r['iterations']:>10} {first:>16} {r['wall'] / 60:>8.2f} "
              f"{r['eval_s'] / 60:>12.2f}m {m['time/rollout']:>12.1f} {m['time/train']:>10.1f}")  # fmt: skip
    for r in results:
        bound = r["flops"] / (rate * 1e9)
        train = r["means"]["time/train"]
        print(f"seed {r['seed']}: train {train:.1f} s/iteration; its compute bound {bound:.1f} s "
              f"({r['flops'] / 1e12:.2f} TFLOP at {rate:.0f} GFLOP/s, fp32 matmul measured here): "
              f"measured / bound {train / max(bound, 1e-9):.2f}")  # fmt: skip
    picture = out / "curve.png"
    algorithm = str(cfg["pipeline"]["name"]).upper()
    plot(results, args.target, picture, f"SmolLM2-135M-Instruct, {algorithm} from zero-shot, 2-digit addition")
    print(f"curve: {picture}")
    for r in results:  # the picture in each seed's MLflow run too
        tracking = r["run"].tracking
        if tracking.get("uri") and tracking.get("run_id"):
            from mlflow.tracking import MlflowClient

            MlflowClient(tracking_uri=str(tracking["uri"])).log_artifact(str(tracking["run_id"]), str(picture))
    reached = sum(any(a >= args.target for _, _, a in r["curve"]) for r in results)
    print(f"seeds at >= {args.target:.0%} within {args.minutes:g} minutes: {reached} of {len(results)}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
