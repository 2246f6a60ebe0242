"""The parts of the GPU check (`benchmarks/gpu_check.sh` runs each under its own time limit): what a CUDA
machine can tell that the CPU machines cannot, with no model download and no vLLM (a model of SmolLM2-135M's
real shape with random weights, built here in seconds, stands in for the real one: 30 layers, hidden 576,
9 heads / 3 KV heads, MLP 1536, vocabulary 49152, tied embeddings; ~135M parameters, an fp32 AdamW state of
1.6 GB).

    python benchmarks/gpu_check.py build DIR            the SmolLM2-shaped model (and a tokenizer) in DIR
    python benchmarks/gpu_check.py env                  the GPU, its PCIe link and free memory
    python benchmarks/gpu_check.py race DIR             the copy-stream race: background moves after a train step
    python benchmarks/gpu_check.py iteration DIR --dtype bfloat16 | --lora   one GRPO iteration, peak memory
    python benchmarks/gpu_check.py nccl1 DIR            a 1-rank NCCL worker group end to end
    python benchmarks/gpu_check.py mux DIR              3 jobs on one service whose device holds 2

`--cpu` on any part: the same code on the CPU with a tiny model (the script's dry run, and the test suite's).
Each part prints what it measured and exits 0, or names what failed and exits 1.

race: the copy stream against compute; `--control N` first runs N rounds with the ordering switched off (the
check's own control, informational). `benchmarks/_gpu_race.py` holds the rounds and says what they compare.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from _gpu_race import Unordered, race_rounds

GiB = 2**30
SMOL = {"layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "intermediate": 1536, "vocab": 49152}
TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512}
LANE_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}  # PCIe GT/s per lane by generation


def size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.2f} MiB"


def work_dir() -> Path:
    """Where the jobs' run directories go (`GPU_CHECK_WORK`; never `$OUT`, whose files travel back)."""
    return Path(os.environ.get("GPU_CHECK_WORK", "/tmp/plexrl-gpu-check"))


def fail(msg: str) -> None:
    print(f"FAILED: {msg}")
    raise SystemExit(1)


def device_of(cpu: bool) -> torch.device:
    if cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        fail("no CUDA device (run with --cpu on a CPU machine)")
    return torch.device("cuda", 0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- build ----------------------------------------------------------------------------------------------------
def build(out: Path, cpu: bool) -> None:
    """A Llama of SmolLM2-135M's shape (TINY's with --cpu), random weights (seed 0), with the project's
    character tokenizer (ids past it are never decoded to anything: fine for a check that does not learn)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from plexrl.job.models import build_tokenizer

    hf_logging.disable_progress_bar()
    shape = TINY if cpu else SMOL
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    config = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        dtype="float32",
    )  # fmt: skip
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out))
    n = sum(p.numel() for p in model.parameters())
    print(f"built {n / 1e6:.1f}M parameters ({shape}) in {time.perf_counter() - t0:.1f} s -> {out}")


# -- env ------------------------------------------------------------------------------------------------------
def link() -> tuple[str, float | None]:
    """nvidia-smi's view of GPU 0 and the PCIe bound in GB/s (None when it cannot say)."""
    query = "name,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,memory.total"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20, check=True).stdout.splitlines()[0]  # fmt: skip
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        return f"nvidia-smi: {exc}", None
    fields = [f.strip() for f in line.split(",")]
    try:
        gen, width = int(fields[1]), int(fields[2])
    except (ValueError, IndexError):
        return line, None
    # gen 3+: 128b/130b encoding; one direction
    gbs = LANE_GTS.get(gen, 0.0) * width * (128 / 130 if gen >= 3 else 0.8) / 8
    return line, gbs


def env(cpu: bool) -> None:
    import plexrl.services.service  # noqa: F401  (the project imports)

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}")
    if cpu:
        print("cpu dry run: no GPU queried")
        return
    device = device_of(cpu)
    line, gbs = link()
    free, total = torch.cuda.mem_get_info(device)
    print(f"nvidia-smi: {line}")
    print(f"PCIe bound (one direction): {gbs:.1f} GB/s" if gbs else "PCIe bound: unknown")
    print(f"{torch.cuda.get_device_name(device)}: {free / GiB:.1f} of {total / GiB:.1f} GiB free")


# -- jobs -----------------------------------------------------------------------------------------------------
def job_config(model: Path, name: str, run_dir: Path, **model_opts: Any) -> dict[str, Any]:
    return {
        "name": name, "seed": 0, "iterations": 1, "run_dir": str(run_dir), "engine": "torch",
        "model": {"path": str(model), "attention": "sdpa", **model_opts},
        "task": {"digits": 2, "train_size": 64, "eval_size": 8},
        "warm_start": {"enabled": False},
        "pipeline": {"name": "grpo", "params": {"batch_size": 4, "n": 4, "max_new_tokens": 16, "eval_every": 1000,
                                                "optimiser": {"minibatches": 1},
                                                "normaliser": {"skip_zero_advantage": False}}},
        "tracking": {"mlflow": False, "progress": False, "log_model": False},
    }  # fmt: skip


def job_spec(cfg: dict[str, Any]) -> Any:
    from plexrl.job.load import load_job
    from plexrl.job.spec import prepare_job

    return prepare_job(load_job(cfg))


def train_batch(engine: Any, rows: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.policy.config.vocab_size
    ids = torch.randint(3, vocab, (rows, length), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def loss_fn(mb: dict[str, torch.Tensor], logp: torch.Tensor, entropy: torch.Tensor) -> tuple[torch.Tensor, dict]:
    return -logp.mean(), {}


def train(engine: Any, seed: int, rows: int = 4, length: int = 64) -> dict[str, float]:
    batch = train_batch(engine, rows, length, seed)
    return dict(engine.train_step(batch, loss_fn, temperature=1.0, lr=1e-4, weight_decay=0.0, max_grad_norm=1.0,
                                  minibatches=1))  # fmt: skip


# -- race -----------------------------------------------------------------------------------------------------
def race(model: Path, cpu: bool, repeats: int, control: int) -> None:
    import dataclasses

    from plexrl.planner.state import Move
    from plexrl.services.service import Service
    from plexrl.services.streams import stream_order

    device = device_of(cpu)
    spec = job_spec(job_config(model, "race", work_dir() / "race-runs"))
    a, b = (dataclasses.replace(spec, job_id=n) for n in ("a", "b"))
    passes = 1 if cpu else 10
    results = {}
    for label, rounds in (("control (unordered)", control), ("service order", repeats)):
        if rounds == 0:
            continue
        order = stream_order(device)
        svc = Service("race", str(device), order=Unordered(order) if label.startswith("control") else order)
        nbytes = svc.load_job(a)
        svc.load_job(b)
        train(svc.engines["b"], 10_000)  # b's AdamW moments exist, then it leaves the device
        svc.node_end(["b"], None)
        svc.apply([Move("b", "device", "host", 0)])
        host_b = svc.states["b"].host
        assert host_b is not None
        b_ref = (host_b.layout, host_b.buffer.to(device, copy=True))
        t0 = time.perf_counter()
        results[label] = race_rounds(svc, rounds, b_ref, passes, train)
        seconds = time.perf_counter() - t0
        state = sw_nbytes(svc, "a")  # with its AdamW moments
        rep = svc.report()
        print(f"{label}: {rounds} rounds, state {size(state)} (loaded {size(nbytes)}), "
              f"torn host copies of a: {results[label][0]}, rounds where b's state changed: {results[label][1]}, "
              f"{seconds:.1f} s, copies {rep['copies']}, pinned {size(rep['pinned_bytes'])}")  # fmt: skip
        svc.close()
    torn, clobbered = results["service order"]
    if torn or clobbered:
        fail(f"the service's background moves raced the compute stream: {torn} torn copies, {clobbered} "
             "overwritten states")  # fmt: skip
    print("ok: every host copy equals the state after a full synchronize; no job's state was overwritten")


def sw_nbytes(svc: Any, job_id: str) -> int:
    from plexrl.services import swap as sw

    return sw.nbytes(svc.engines[job_id].state_tensors())


# -- one iteration ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def peak(device: torch.device) -> Iterator[dict[str, float]]:
    out: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    yield out
    if device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated(device)


def run_jobs(
    specs: list[Any], device: torch.device, budgets: Any = None, hooks: Sequence[Any] = ()
) -> tuple[list[Any], dict[str, Any]]:
    from plexrl.planner import Planner
    from plexrl.runtime import InlineExecutor, Runner

    executor = InlineExecutor(services=1, device=str(device))
    runner = Runner(executor, Planner(clock=executor.clock), budgets=budgets, hooks=list(hooks))
    runs = runner.run(specs)
    bad = [(r.job_id, r.error) for r in runs if r.status != "done"]
    if bad:
        fail(f"jobs did not finish: {bad}")
    return runs, runner.service_reports["service-0"]


def iteration(model: Path, cpu: bool, dtype: str, lora: bool) -> None:
    device = device_of(cpu)
    opts: dict[str, Any] = {"dtype": dtype}
    if lora:
        opts["lora"] = {"r": 16, "alpha": 32}
    name = "lora" if lora else dtype
    spec = job_spec(job_config(model, f"iter-{name}", work_dir() / "iter-runs", **opts))
    t0 = time.perf_counter()
    with peak(device) as mem:
        (run,), _ = run_jobs([spec], device)
    # random weights earn no reward, so the advantages (and the policy gradient) are zero: what is checked
    # is that the whole step ran (forward, backward, AdamW) at its real memory, not that it learned
    rows = [r for r in run.history if r.get("train/steps", 0) >= 1]
    if not rows or not all(abs(r["train/loss"]) < float("inf") for r in rows):
        fail(f"no train step ran with a finite loss: {run.history}")
    est = spec.state_bytes()
    line = (
        f"{name}: one GRPO iteration in {time.perf_counter() - t0:.1f} s on {device}; loss {rows[-1]['train/loss']:.4f}"
    )
    line += f", grad norm {rows[-1]['train/grad_norm']:.3f}; planner's state estimate {size(est)}"
    if "peak" in mem:
        line += f"; peak allocated {size(mem['peak'])} ({mem['peak'] / max(est, 1):.2f}x the estimate)"
    print(line)


# -- a 1-rank NCCL worker group -------------------------------------------------------------------------------
def nccl1(model: Path, cpu: bool) -> None:
    from plexrl.planner.state import Move
    from plexrl.ranks import GroupSpec, agree, join, leave
    from plexrl.services.group import RankService

    device = device_of(cpu)
    backend = "gloo" if cpu else "nccl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    out = work_dir()
    spec = job_spec(job_config(model, "nccl1", out / "nccl1-runs"))
    t0 = time.perf_counter()
    state = join(GroupSpec("check/nccl1", 1, "127.0.0.1", port, backend=backend, timeout_s=60), 0, str(device))
    try:
        svc = RankService("nccl1", state, str(device), spill_dir=out / "nccl1-spill")
        svc.load_job(spec)  # fully_shard over the 1-rank mesh; rank 0's full copy
        engine = svc.engines[spec.job_id]
        stats = train(engine, 0)  # FSDP collectives, then the weight sync (full_tensor, device to device)
        if not stats.get("grad_norm", 0) > 0:
            fail(f"the FSDP train step did not train: {stats}")
        if agree(state, None) is not None:
            fail("agree reported an error with none given")
        tok = spec.tokenizer
        gen = engine.generate([tok("12+34=")["input_ids"]], n=2, temperature=1.0, max_new_tokens=4, seed=0)
        live = engine.state_tensors()
        before = {k: v.detach().clone() for k, v in live.items()}
        svc.apply([Move(spec.job_id, "device", "host", 0), Move(spec.job_id, "host", "disk", 0)])
        svc.apply([Move(spec.job_id, "disk", "host", 0), Move(spec.job_id, "host", "device", 0)])
        after = engine.state_tensors()
        bad = [k for k in before if not torch.equal(after[k], before[k])]
        if bad:
            fail(f"device -> host -> disk -> device changed {len(bad)} tensors, e.g. {bad[:3]}")
        stats2 = train(engine, 1)  # the state trains again after the round trip
        svc.close()
    finally:
        leave("check/nccl1")
    print(f"ok: {backend} group of 1 on {device}: init, fully_shard, train (grad norm {stats['grad_norm']:.3f}, "
          f"then {stats2['grad_norm']:.3f}), agree, broadcast of a generation {tuple(gen.response_ids.shape)}, "
          f"device -> host -> disk -> device bit-exact, {time.perf_counter() - t0:.1f} s")  # fmt: skip


# -- several jobs on one service ------------------------------------------------------------------------------
def copy_bound(device: torch.device, nbytes: int, reps: int = 3) -> float:
    """GB/s of a plain copy of `nbytes` between touched buffers, the slower way of the two: on CUDA a pinned
    host buffer to a device buffer and back (the PCIe link as this machine gives it), on CPU memory to memory
    (best of `reps` each way)."""
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    worst = 0.0
    for dst, src in ((dev, host), (host, dev)):
        best = float("inf")
        for _ in range(reps + 1):  # the first: a warm-up
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            best = min(best, time.perf_counter() - t0)
        worst = max(worst, best)
    del host, dev
    return nbytes / worst / 1e9


def mux(model: Path, cpu: bool, jobs: int, iterations: int) -> None:
    from plexrl.hooks.timeline import TimelineRecorder
    from plexrl.runtime import Budgets
    from plexrl.services.records import format_summary
    from plexrl.sim.calibrate import swap_constants

    device = device_of(cpu)
    out = work_dir() / "mux-runs"
    timeline = TimelineRecorder(work_dir() / "mux-timeline", draw=False)  # every move's record
    specs = []
    for i in range(jobs):
        cfg = job_config(model, f"mux-{i}", out)
        cfg["iterations"], cfg["seed"] = iterations, i
        specs.append(job_spec(cfg))
    state = max(s.state_bytes() for s in specs)
    budgets = Budgets(device=2 * state + state // 2)  # two states fit, not three
    t0 = time.perf_counter()
    _, report = run_jobs(specs, device, budgets, [timeline])
    wall = time.perf_counter() - t0
    moved = report["bytes_moved"]
    busy_moving = report["blocking_swap_seconds"] - report["prefetch_wait_seconds"] + report["prefetch_seconds"]
    gbs = moved / busy_moving / 1e9 if busy_moving > 0 else float("nan")
    measured = copy_bound(device, state)
    print(f"{jobs} jobs x {iterations} iterations, device budget {size(budgets.device)} (2.5 states of "
          f"{size(state)}), {wall:.1f} s")  # fmt: skip
    print(f"moved {size(moved)} in {report['moves']} moves ({report['copies']} copies); "
          f"{busy_moving:.2f} s moving -> {gbs:.1f} GB/s (measured copy bound {measured:.1f} GB/s: "
          f"{gbs / measured:.2f} of it)")  # fmt: skip
    if not cpu:
        print(f"PCIe link (nvidia-smi): {link()[1] or float('nan'):.1f} GB/s one way")
    print(f"move records: {format_summary(report['move_records'], measured)}")
    print(f"blocking swap {report['blocking_swap_seconds']:.2f} s, background {report['prefetch_seconds']:.2f} s "
          f"(waited {report['prefetch_wait_seconds']:.2f} s): share hidden by prefetch {report['hidden_share']:.2f}; "
          f"pinned {size(report['pinned_bytes'])} (peak {size(report['pinned_peak_bytes'])})")  # fmt: skip
    print(f"the simulator's swap constants from these records: {swap_constants(timeline.moves)}")
    if os.environ.get("OUT"):  # the records travel back with the logs (`benchmarks/calibrate.py --moves` reads them)
        (Path(os.environ["OUT"]) / "mux-moves.json").write_text(json.dumps(timeline.moves))
    if report["moves"] == 0:
        fail("no state moved: the device budget did not force swaps")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", nargs="?", choices=["build", "env", "race", "iteration", "nccl1", "mux", "sessions"])
    ap.add_argument("model", nargs="?", type=Path, help="the model directory (`build` writes it)")
    ap.add_argument("--cpu", action="store_true", help="on the CPU with the tiny model (a dry run)")
    ap.add_argument("--repeats", type=int, default=20, help="race: rounds with the service's order")
    ap.add_argument("--control", type=int, default=0, help="race: rounds with the order off first (informational)")
    ap.add_argument("--dtype", default="float32", help="iteration: the model dtype")
    ap.add_argument("--lora", action="store_true", help="iteration: a LoRA job (r 16)")
    ap.add_argument("--jobs", type=int, default=3, help="mux: jobs on the one service")
    ap.add_argument("--iterations", type=int, default=2, help="mux: iterations per job")
    ap.add_argument("--sessions", type=int, default=8, help="sessions: LoRA sessions on the one service")
    ap.add_argument("--steps", type=int, default=3, help="sessions: timed steps per session in each arm")
    ap.add_argument("--smoke", action="store_true", help="build a tiny model and run the race on the CPU (tests)")
    args = ap.parse_intermixed_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if args.smoke:  # the whole check's dry run is tests/test_gpu_check.py's (gpu_check.sh run --cpu)
        import tempfile

        with tempfile.TemporaryDirectory(prefix="plexrl-gpu-check-") as tmp:
            os.environ.setdefault("GPU_CHECK_WORK", tmp)
            build(Path(tmp) / "model", cpu=True)
            race(Path(tmp) / "model", cpu=True, repeats=2, control=1)
        return
    if args.part is None:
        ap.error("name a part (or --smoke)")
    if args.part not in ("env",) and args.model is None:
        ap.error(f"{args.part} needs the model directory")
    if args.part == "build":
        build(args.model, args.cpu)
    elif args.part == "env":
        env(args.cpu)
    elif args.part == "race":
        race(args.model, args.cpu, args.repeats, args.control)
    elif args.part == "iteration":
        iteration(args.model, args.cpu, args.dtype, args.lora)
    elif args.part == "nccl1":
        nccl1(args.model, args.cpu)
    elif args.part == "sessions":
        from _gpu_sessions import sessions

        sessions(args.model, device_of(args.cpu), args.sessions, args.steps, 4, 16, work_dir() / "sessions")
    else:
        mux(args.model, args.cpu, args.jobs, args.iterations)


if __name__ == "__main__":
    main()
