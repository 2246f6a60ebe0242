"""Sensitivity bands of the simulator's headline: each scenario rerun with one uncertain constant moved at a
time (max response tokens, length sigma, switch cost, training MFU, host link), baselines tuned again, and
the on-policy saving at matched step time vs the shipped figure (`plexrl/sim/sensitivity.py`).

    .venv/bin/python benchmarks/sim_sensitivity.py [configs/sim/qwen25_7b.yaml ...] [--knobs "sigma +0.2"]
        [--jobs 4] [--samples 8] [--smoke]

Configs: scenario files (default: the three shipped). `--smoke`: the first only, a small batch, one knob.

`--jobs`: jobs simulated (default 4: the baselines' jobs do not interact and PlexRL pools hold 2, so a few
stand for the scenario's); deterministic.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from plexrl.sim.config import Scenario, load_sim
from plexrl.sim.sensitivity import KNOBS, format_bands, sensitivity

SCENARIOS = ["configs/sim/qwen25_7b.yaml", "configs/sim/qwen3_30b_a3b.yaml", "configs/sim/qwen3_235b_a22b.yaml"]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=SCENARIOS, help="scenario configs (default: the three shipped)")
    ap.add_argument("--knobs", nargs="*", help=f"a subset of: {', '.join(KNOBS)}")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--samples", type=int, help="rollout_samples per layout (fewer: faster, coarser)")
    ap.add_argument("--smoke", action="store_true", help="a small batch, 3 steps, one knob")
    args = ap.parse_args(argv)
    for path in args.configs[:1] if args.smoke else args.configs:
        over: dict[str, object] = {"sweep_accelerators": [], "jobs": args.jobs}
        if args.samples:
            over["rollout_samples"] = args.samples
        sc = load_sim(path, over)
        if not isinstance(sc, Scenario):
            ap.error(f"{path} is a trace; give a scenario")
        knobs = args.knobs
        if args.smoke:
            work = sc.workload.model_copy(update={"prompts": 32, "samples": 4, "steps": 3})
            sc = sc.model_copy(update={"rollout_samples": 2, "workload": work})
            knobs = knobs or ["sigma +0.2"]
        t0 = time.perf_counter()
        print(format_bands(sc, sensitivity(sc, knobs)))
        print(f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
