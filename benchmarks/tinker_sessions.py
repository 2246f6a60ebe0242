"""Many LoRA sessions over one base on one `plexrl serve` service, each an SDK loop, against each alone.

Each session is the unmodified `tinker` SDK running a training loop: per step a sampler snapshot
(`save_weights_and_get_sampling_client`), `--prompts` sample calls of `--group` samples of `--tokens` tokens
(sent together), one `forward_backward` (importance_sampling) on what was sampled and one `optim_step`. Arms,
each on a fresh server with one service:

- alone: ONE session: its seconds per step (the single-session rate r1); and the same with
  `cluster.bundle_window_s: 0`, where the first of the step's sample calls sent at once runs alone and the rest
  together after it, instead of all in one engine call (the window's gain, printed beside);
- together, samples batched: `--sessions` N sessions at once, `cluster.batch_rollouts: true`, so sample calls
  of several sessions queued together run as ONE engine call (`plexrl/sessions/sampling.py`), and so do their
  forward_backward calls on an accelerator (one training pass, `plexrl/sessions/training.py`; on a CPU they run
  one after another, where one pass cost more); such a call that
  finds the service idle waits at most `--window` seconds (`cluster.batch_window_s`, default the config's) for
  the sessions of its base idle between calls (`plexrl/planner/batches.py`, `gather_until`), and while sessions of
  its base are busy on the service with calls after which they sample, other work goes first so that they sample
  together (`keep_phase`, `cluster.phase_window_s`);
- together, samples batched, phase not kept: the same with `cluster.phase_window_s: 0`;
- together, one call per sample: the same N sessions with `batch_rollouts: false`.

Every session first takes one warm-up step (not timed), then all start their `--steps` timed steps together. One
service means one accelerator: total training steps per second is also steps per accelerator-second. The bound
of N sessions is N x r1 (what N sessions would do if the service were free for each, as if alone); each
session's slowdown (its seconds per step over the alone arm's) has the bound 1.0. A service that ran every
call alone, one after another, would give about r1 / (the service's busy share of a step alone) in total.

    .venv/bin/python benchmarks/tinker_sessions.py [--sessions 8] [--steps 4] [--prompts 2] [--group 4] [--tokens 16]
        [--window SECONDS] [--phase SECONDS]
    .venv/bin/python benchmarks/tinker_sessions.py --smoke   # tiny model, 2 sessions, seconds (the tests run it)

The real run uses SmolLM2-135M-Instruct (converted at set-up) and takes the machine: run it alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TINKER_TELEMETRY", "0")  # (the SDK would post its telemetry to the server)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # (the tokenizer is local: no hub retries, ~20 s per session offline)
sys.path.insert(0, str(Path(__file__).resolve().parent))

HF_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def start(
    tmp: Path, model_dir: Path, batched: bool, window: float | None, bundle_window: float | None = None,
    phase_window: float | None = None,
) -> Any:  # fmt: skip
    from plexrl.server.api import start_server
    from plexrl.server.config import ServerConfig

    # every session on the one service, whatever their predicted loads (an SDK loop keeps its session busy)
    cluster: dict[str, Any] = {"driver": "local", "services": {"count": 1}, "batch_rollouts": batched,
                               "max_load": 64.0}  # fmt: skip
    if window is not None:
        cluster["batch_window_s"] = window
    if bundle_window is not None:
        cluster["bundle_window_s"] = bundle_window
    if phase_window is not None:
        cluster["phase_window_s"] = phase_window
    cfg = ServerConfig(port=0, journal=str(tmp / "journal.db"), run_dir=str(tmp / "runs"), cluster=cluster,
                       allowed_roots=[str(tmp), str(model_dir.parent)], mlflow=False)  # fmt: skip
    return start_server(cfg)


def session_loop(url: str, base: str, index: int, args: argparse.Namespace, ready: threading.Barrier) -> list[float]:
    """One session's loop through the SDK: one warm-up step, then (after every session's) `args.steps` timed
    steps; the seconds of each timed step."""
    import numpy as np
    import tinker
    from tinker import types
    from tinker.types.tensor_data import TensorData

    service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    times: list[float] = []
    try:
        training = service.create_lora_training_client(base_model=base, rank=args.rank, seed=index).result()
        prompt = training.get_tokenizer().encode(f"What is {17 + index} + 25? Answer with the sum.")
        for step in range(args.steps + 1):
            if step == 1:
                ready.wait(timeout=600)
            t0 = time.perf_counter()
            sampler = training.save_weights_and_get_sampling_client().result()
            params = [types.SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=1000 * step + p)
                      for p in range(args.prompts)]  # fmt: skip
            futs = [sampler.sample(types.ModelInput.from_ints(prompt), args.group, sp) for sp in params]
            data = []
            for k, fut in enumerate(futs):
                for s in fut.result().sequences:
                    ob = len(prompt) - 1
                    adv = 1.0 if (k + len(s.tokens)) % 2 else -1.0
                    inputs = {
                        "target_tokens": TensorData.from_numpy(np.array([0] * ob + list(s.tokens))),
                        "logprobs": TensorData.from_numpy(np.array([0.0] * ob + list(s.logprobs or []), "f4")),
                        "advantages": TensorData.from_numpy(np.array([0.0] * ob + [adv] * len(s.tokens), "f4")),
                    }
                    tokens = types.ModelInput.from_ints(prompt + list(s.tokens[:-1]))
                    data.append(types.Datum(model_input=tokens, loss_fn_inputs=inputs))
            training.forward_backward(data, "importance_sampling").result()
            training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            if step >= 1:
                times.append(time.perf_counter() - t0)
    finally:
        service.close("success").result()
    return times


def arm(
    tmp: Path, model_dir: Path, base: str, n: int, batched: bool, args: argparse.Namespace,
    bundle_window: float | None = None, phase_window: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """N sessions at once on a fresh server: per session its timed steps' seconds, the wall of the timed part,
    the planner's cohorts (sample calls that shared an engine call), its waits for a cohort's partners and the
    calls it held so that their partners caught up. `bundle_window`, `phase_window`: the server's
    `cluster.bundle_window_s`, `cluster.phase_window_s` (None: the config's defaults)."""
    from plexrl.sessions.calls import CALL_KINDS

    srv = start(tmp, model_dir, batched, args.window, bundle_window, phase_window)
    ready = threading.Barrier(n)
    out: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = session_loop(srv.url, base, i, args, ready)
        except BaseException as exc:  # (reported below; a broken barrier frees the others)
            errors.append(exc)
            ready.abort()

    threads = [threading.Thread(target=run, args=(i,), name=f"session-{i}") for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        counts = srv.controller.runner.planner.counts()
        timed = args.steps * (args.prompts + 3)  # the calls of the timed steps: a session's last ones
        rows: list[dict[str, float]] = []
        every: list[dict[str, float]] = []
        rounds: list[list[float]] = []  # per session: how many sessions each of its sample nodes' engine call served
        for j in srv.journal.jobs():
            if j.config.get("kind") == "session":
                mine = [e.data["metrics"] for e in srv.journal.events(j.job_id) if e.kind == "iteration"]
                rows, every = rows + mine[-timed:], every + mine
                rounds.append([m["sample/call_sessions"] for m in mine if "sample/call_sessions" in m])
    finally:
        srv.stop(120)
    if errors:
        raise RuntimeError(f"a session failed: {errors[0]!r}") from errors[0]
    wall = max(sum(v) for v in out.values())
    # the service's seconds per session-step by call kind (a cohort member's: its share), timed steps only
    per_step = {k: sum(r.get(f"time/{k}", 0.0) for r in rows) / (n * args.steps) for k in CALL_KINDS}
    shared = [r["forward_backward/call_sessions"] for r in every if r.get("forward_backward/call_sessions", 1) > 1]
    return {"times": out, "wall": wall, "cohorts": counts.get("cohorts_sent", 0),
            "fb": (round(sum(1.0 / v for v in shared)), len(shared)),
            "members": counts.get("cohort_members", 0), "waits": counts.get("partner_waits", 0),
            "kept": counts.get("phase_defers", 0),
            "rounds": [(min(r), max(r)) for r in zip(*rounds, strict=False)],
            "service": {k: v for k, v in per_step.items() if v > 0}}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per session (after one warm-up step)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--window", type=float, default=None,
                    help="cluster.batch_window_s of the batched arm (default: the config's)")  # fmt: skip
    ap.add_argument("--phase", type=float, default=None,
                    help="cluster.phase_window_s of the batched arm (default: the config's)")  # fmt: skip
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:  # (a generous window: a loaded test machine's SDK round trips, so that cohorts show)
        args.sessions, args.steps, args.prompts, args.group, args.tokens, args.rank = 2, 1, 2, 2, 4, 4
        args.window = 0.5 if args.window is None else args.window
    with tempfile.TemporaryDirectory(prefix="plexrl-tinker-sessions-") as d:
        tmp = Path(d)
        if args.smoke:
            from service_api import tiny_smol

            model_dir = tiny_smol(tmp / "model")
            base = str(model_dir)
        else:
            from plexrl.job.pretrained import pretrained_path

            model_dir, base = pretrained_path("smollm2-135m-instruct"), HF_NAME
        n = args.sessions
        alone = arm(tmp / "alone", model_dir, base, 1, True, args)
        # the same session with its calls sent at once not waited for: the first of each burst runs alone
        unwaited = arm(tmp / "alone-unwaited", model_dir, base, 1, True, args, bundle_window=0.0)
        arms = {"together, samples batched": arm(tmp / "batched", model_dir, base, n, True, args,
                                                 phase_window=args.phase),
                "together, samples batched, phase not kept": arm(tmp / "unphased", model_dir, base, n, True, args,
                                                                 phase_window=0.0),
                "together, one call per sample": arm(tmp / "single", model_dir, base, n, False, args)}  # fmt: skip
    r1 = args.steps / alone["wall"]
    shape = f"{args.prompts} prompts x {args.group} samples x {args.tokens} tokens, LoRA r{args.rank}"
    print(f"model {'tiny (smoke)' if args.smoke else HF_NAME}; a step: snapshot, {shape}, forward_backward, "
          f"optim_step; {args.steps} timed steps per session after one warm-up; one service")  # fmt: skip
    from plexrl.runtime.config import RuntimeConfig

    window = RuntimeConfig.model_fields["batch_window_s"].default if args.window is None else args.window
    phase = RuntimeConfig.model_fields["phase_window_s"].default if args.phase is None else args.phase
    print(f"alone: {r1:.3f} steps per accelerator-second ({alone['wall'] / args.steps:.2f} s/step); the batched "
          f"arm's wait for a cohort's partners: at most {window:g} s per sample call, kept in phase at most "
          f"{phase:g} s")  # fmt: skip
    bw = RuntimeConfig.model_fields["bundle_window_s"].default
    r0 = args.steps / unwaited["wall"]
    print(f"alone, the first call of each burst not waited for (bundle_window_s 0 against {bw:g}): {r0:.3f} steps "
          f"per accelerator-second ({unwaited['wall'] / args.steps:.2f} s/step): the window gives {r1 / r0:.2f}x; "
          f"sample seconds per step {unwaited['service'].get('sample', 0.0):.3f} against "
          f"{alone['service'].get('sample', 0.0):.3f}")  # fmt: skip
    print("| arm | sessions | total steps per accelerator-s | / alone | bound (N x alone) | cohorts (members) | "
          "of them forward_backward passes (calls) | waits for partners | calls kept in phase |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| alone | 1 | {r1:.3f} | 1.00 | 1.00 | {alone['cohorts']} ({alone['members']}) | {alone['fb'][0]} "
          f"({alone['fb'][1]}) | {alone['waits']} | {alone['kept']} |")  # fmt: skip
    for name, a in arms.items():
        total = n * args.steps / a["wall"]
        print(f"| {name} | {n} | {total:.3f} | {total / r1:.2f} | {n:.2f} | {a['cohorts']} ({a['members']}) | "
              f"{a['fb'][0]} ({a['fb'][1]}) | {a['waits']} | {a['kept']} |")  # fmt: skip
    every = {"alone": alone, **arms}
    kinds = sorted({k for a in every.values() for k in a["service"]})
    print("service seconds per session-step by call (timed steps; a cohort member's: its share of the call):")
    print(f"| arm | {' | '.join(kinds)} | all |")
    print("|---|" + "---|" * (len(kinds) + 1))
    for name, a in every.items():
        cells = " | ".join(f"{a['service'].get(k, 0.0):.3f}" for k in kinds)
        print(f"| {name} | {cells} | {sum(a['service'].values()):.3f} |")
    print("| session | s/step batched | slowdown | s/step unbatched | slowdown | bound |")
    print("|---|---|---|---|---|---|")
    per = alone["wall"] / args.steps
    batched, single = arms["together, samples batched"], arms["together, one call per sample"]
    for i in range(n):
        b, s = statistics.mean(batched["times"][i]), statistics.mean(single["times"][i])
        print(f"| {i} | {b:.2f} | {b / per:.2f} | {s:.2f} | {s / per:.2f} | 1.00 |")
    for name, a in arms.items():
        if a["rounds"] and a["cohorts"]:
            sizes = ", ".join(f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}" for lo, hi in a["rounds"])
            print(f"{name}: sessions per sample engine call, round by round (fewest-most over the sessions): {sizes}")
    total_b = n * args.steps / batched["wall"]
    unphased = arms["together, samples batched, phase not kept"]
    print(f"total steps/s together / alone (samples batched): {total_b / r1:.2f} (bound {n}; phase not kept: "
          f"{n * args.steps / unphased['wall'] / r1:.2f}; one call per sample: "
          f"{n * args.steps / single['wall'] / r1:.2f}; cohorts {batched['cohorts']} holding "
          f"{batched['members']} calls, {batched['fb'][1]} of them forward_backward)")  # fmt: skip


if __name__ == "__main__":
    main()
