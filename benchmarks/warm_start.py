"""The supervised warm start's learning-rate schedules and initial weight scales, side by side: for each
schedule, init std and seed, the steps at which held-out greedy accuracy first reached 50/90/95/97%, and the
process CPU seconds.

The jump from ~1% to ~80% held-out accuracy on 3-digit addition comes after a plateau whose length depends
on the seed and on the scale of the initial weights (`model.init_std`; at the Llama default of 0.02 one seed
in six stayed on it for ~800 steps); a variant is judged by its slowest seed. Each run builds the seed's
model and calls `plexrl.job.models.warm_start` with `stop_at_accuracy` 0.985, reading the accuracy checks from
its log.

    .venv/bin/python benchmarks/warm_start.py [--seeds 0,1,2] [--schedules constant,cosine]
        [--init-stds 0.02] [--threads 1] [--eval-every 25] [--max-steps 1000] [--smoke]

Schedules: `constant` (AdamW 1e-3, the default warm start), `cosine` (3e-3 after a 50-step warm-up, cosine
decay over 900 steps), `cosine2e-3` (the same at 2e-3), `hold50` (3e-3 held until a check reaches 50%, then
cosine decay over 700 steps), `warmup400` (a 400-step linear warm-up to 3e-3, then cosine decay over 700).
Measure with nothing else running; the steps do not depend on the machine's load, the seconds do.
"""

from __future__ import annotations

import argparse
import logging
import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plexrl.job.config import TaskConfig, WarmStartConfig
from plexrl.job.model_config import ModelConfig

SCHEDULES: dict[str, dict[str, Any]] = {
    "constant": {"lr": 1e-3},
    "cosine": {"lr": 3e-3, "warmup_steps": 50, "decay_steps": 900},
    "cosine2e-3": {"lr": 2e-3, "warmup_steps": 50, "decay_steps": 900},
    "hold50": {"lr": 3e-3, "warmup_steps": 50, "decay_steps": 700, "decay_from_accuracy": 0.5},
    "warmup400": {"lr": 3e-3, "warmup_steps": 400, "decay_steps": 700},
}
THRESHOLDS = (0.5, 0.9, 0.95, 0.97)
CHECK = re.compile(r"warm start step (\d+) loss [\d.]+ held-out accuracy ([\d.]+)")


class Checks(logging.Handler):
    """Collects (step, accuracy) from the warm start's log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.curve: list[tuple[int, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = CHECK.match(record.getMessage())
        if m:
            self.curve.append((int(m.group(1)), float(m.group(2))))


def run(
    schedule: str, init_std: float, seed: int, args: argparse.Namespace, root: Path
) -> tuple[list[tuple[int, float]], float]:
    import torch

    from plexrl.job.models import build_model, build_tokenizer, warm_start
    from plexrl.job.tasks import make_task

    torch.set_num_threads(args.threads)
    model_cfg = ModelConfig(**args.model, init_std=init_std)
    task = make_task(TaskConfig(**args.task))
    cfg = WarmStartConfig(
        **SCHEDULES[schedule], stop_at_accuracy=0.985, eval_every=args.eval_every, max_steps=args.max_steps,
        eval_size=args.eval_size, **args.warm,
    )  # fmt: skip
    here = root / f"{schedule}-{init_std}-{seed}"
    base, out = here / "base", here / "warm"
    base.mkdir(parents=True)
    out.mkdir(parents=True)
    tok = build_tokenizer(base, task.alphabet, task.special_tokens)
    build_model(model_cfg, tok, base, seed)
    checks = Checks()
    logger = logging.getLogger("plexrl.job.models")
    logger.addHandler(checks)
    logger.setLevel(logging.INFO)
    t0 = time.process_time()
    try:
        warm_start(base, out, tok, task, cfg, seed, model_cfg)
    finally:
        logger.removeHandler(checks)
    return checks.curve, time.process_time() - t0


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--schedules", default="constant,cosine", help=f"comma-separated, of {', '.join(SCHEDULES)}")
    ap.add_argument("--init-stds", default="0.02", help="comma-separated initial weight scales (model.init_std)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--smoke", action="store_true", help="a tiny model and task, 4 steps (tests)")
    args = ap.parse_args(argv)
    schedules = args.schedules.split(",")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        ap.error(f"unknown schedule(s) {unknown}; choose from {', '.join(SCHEDULES)}")
    args.model, args.task, args.warm, args.eval_size = {}, {}, {}, 500
    if args.smoke:
        args.seeds, args.max_steps, args.eval_every, args.eval_size = "0", 4, 2, 16
        args.model = {"layers": 1, "hidden": 32, "heads": 2, "intermediate": 64}
        args.task = {"digits": 2, "train_size": 200, "eval_size": 16}
        args.warm = {"batch_size": 16}
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = [(schedule, float(std)) for schedule in schedules for std in args.init_stds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="plexrl-warm-start-") as tmp:
        for schedule, std in variants:
            for seed in seeds:
                curve, cpu = run(schedule, std, seed, args, Path(tmp))
                firsts = [next((s for s, a in curve if a >= t), None) for t in THRESHOLDS]
                shown = ", ".join(f"{s}:{a:.3f}" for s, a in curve)
                name = f"{schedule}/{std:g}"
                print(f"{name} seed {seed}: {shown}", flush=True)
                rows.append((name, seed, firsts, curve[-1] if curve else (0, 0.0), cpu))
    print()
    head = "".join(f"{f'steps to {t:.0%}':>15}" for t in THRESHOLDS)
    print(f"{'schedule/init':<18}{'seed':>5}{head}{'last check':>16}{'CPU s':>8}")
    for name, seed, firsts, (step, acc), cpu in rows:
        cells = "".join(f"{'-' if f is None else f:>15}" for f in firsts)
        print(f"{name:<18}{seed:>5}{cells}{f'{acc:.3f} @ {step}':>16}{cpu:>8.1f}")
    for schedule in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == schedule]
        worst = [max((r[2][i] for r in mine), key=lambda f: float("inf") if f is None else f) for i in range(4)]
        print(f"{schedule}: slowest seed's steps to " + ", ".join(
            f"{t:.0%} {'-' if w is None else w}" for t, w in zip(THRESHOLDS, worst, strict=True)
        ))  # fmt: skip


if __name__ == "__main__":
    main()
