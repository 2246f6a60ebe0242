"""A service over 2 ranks (FSDP2 worker group) against 1 rank, side by side in one run: the training step
time, and the per-switch swap time of a job's state (out to host and back in), sharded vs whole.

Builds a Llama-shaped model locally (`--hidden`, `--layers`), then:

* 1 rank, in this process: `TorchEngine.train_step` on a fixed batch (`--rows` x `--length` tokens, a
  policy-gradient loss on the token log-probs), timed over `--steps` steps after one warm-up step; then the
  swap a plain service does per switch: `swap.device_to_host` + `swap.host_to_device` of
  `TorchEngine.state_tensors()` (weights, AdamW moments);
* 2 ranks, two spawned processes forming one gloo group (`plexrl.runtime.group.join`): `FSDPEngine.train_step`
  on the same batch (replicated: both ranks run it; it includes the gather of the full weights to rank 0's
  generation copy), and each rank's `RankService` move of its own shard (rank 0 also holds the full
  generation copy) out to host and back, both ranks at once; the per-switch time is the slower rank's.

Each process uses `--threads` torch threads (default 1), so the 2-rank side uses twice the cores: on a
2-core machine the two sides are as fair as it gets, and another process's load distorts the 2-rank side
more. Printed: median step and switch times per side and the ratio 2-rank / 1-rank. The data is replicated
across ranks (FSDP shards memory, not compute), so on CPU the 2-rank step is NOT expected to be faster: it
adds an all-gather per layer and the weight gather per step. What a group buys is room: per-rank state.

    .venv/bin/python benchmarks/worker_group.py [--hidden 256] [--layers 4] [--steps 5] [--smoke]

`--smoke`: a 1-layer, hidden-32 model, one timed step and one switch (seconds; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def build(out: Path, hidden: int, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(hidden // 32, 1), num_key_value_heads=max(hidden // 32, 1),
                      tie_word_embeddings=True, max_position_embeddings=256)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(str(out))


def batch(rows: int, length: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(3, 64, (rows, length), generator=g),
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "advantages": torch.randn(rows, generator=g),
    }


def loss_fn(mb: dict[str, torch.Tensor], logprobs: torch.Tensor, entropy: torch.Tensor) -> Any:
    loss = -(logprobs[:, 1:].mean(1) * mb["advantages"]).mean()
    return loss, {}


def train(engine: Any, data: dict[str, torch.Tensor], steps: int) -> list[float]:
    times = []
    for i in range(steps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        engine.train_step(data, loss_fn, temperature=1.0, lr=1e-4, weight_decay=0.0, max_grad_norm=1.0, minibatches=1)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def one_rank(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from plexrl.engines.torch_engine import TorchEngine
    from plexrl.services import swap as sw
    from plexrl.services.host import HostPool
    from plexrl.services.streams import stream_order

    torch.set_num_threads(args.threads)
    engine = TorchEngine(model, eos_id=1, pad_id=0)
    steps = train(engine, batch(args.rows, args.length), args.steps)
    pool, order = HostPool(pin=engine.device.type == "cuda"), stream_order(engine.device)  # a service's
    switches = []
    for _ in range(args.switches):
        live = engine.state_tensors()
        t0 = time.perf_counter()
        host, _ = sw.device_to_host("job", live, engine.device, pool, order)
        sw.host_to_device("job", live, host, engine.device, order)
        pool.give(host.buffer)
        switches.append(time.perf_counter() - t0)
    return {"step": steps, "switch": switches, "bytes": sw.nbytes(engine.state_tensors())}


def rank_main(rank: int, model: str, port: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from plexrl.engines.fsdp_engine import FSDPEngine
    from plexrl.planner.state import Move
    from plexrl.runtime.group import GroupSpec, join, leave
    from plexrl.services.group import RankService, ShardLocation, _storages

    torch.set_num_threads(args.threads)
    state = join(GroupSpec("bench", 2, "127.0.0.1", port, timeout_s=120), rank, "cpu")
    try:
        engine = FSDPEngine(model, eos_id=1, pad_id=0, group=state)
        steps = train(engine, batch(args.rows, args.length), args.steps)
        svc = RankService("service-0", state)
        svc.engines["j"] = engine
        nbytes = sum(s.nbytes() for s in _storages(engine.state_tensors())[0].values())
        svc.states["j"] = ShardLocation("device", nbytes=nbytes)
        switches = []
        for _ in range(args.switches):
            dist.barrier()  # both ranks switch at once, as a group service does
            t0 = time.perf_counter()
            svc.apply([Move("j", "device", "host", 0), Move("j", "host", "device", 0)])
            switches.append(time.perf_counter() - t0)
        svc.close()
        return {"step": steps, "switch": switches, "bytes": nbytes}
    finally:
        leave("bench")


def two_ranks(model: Path, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Two processes running this file with `--rank r` (a fresh interpreter each: the tests load this module
    under another name, which a spawned child could not import); each prints its figures as JSON."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--model", str(model), "--port", str(port)]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, env=env, text=True) for r in range(2)]
    results = {}
    try:
        for r, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"rank {r} failed (exit {proc.returncode}); its stderr is above")
            results[r] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    switch = [max(a, b) for a, b in zip(results[0]["switch"], results[1]["switch"], strict=True)]
    return {"step": results[0]["step"], "switch": switch, "bytes": results[0]["bytes"], "bytes1": results[1]["bytes"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--switches", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="tiny model, one step, one switch (seconds)")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # internal: one rank's process
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.rows, args.length, args.steps, args.switches = 32, 1, 4, 8, 1, 1
    if args.rank is not None:
        result = rank_main(args.rank, args.model, args.port, args)
        sys.stdout.write(json.dumps(result) + "\n")
        return result
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build(model, args.hidden, args.layers)
        one, two = one_rank(model, args), two_ranks(model, args, argv)
    med = {k: (statistics.median(one[k]), statistics.median(two[k])) for k in ("step", "switch")}
    print(f"model hidden {args.hidden} x {args.layers} layers; batch {args.rows} x {args.length}; "
          f"{args.threads} thread(s) per rank")  # fmt: skip
    print(f"{'':24}{'1 rank':>12}{'2 ranks':>12}{'2/1':>8}")
    print(f"{'train step (s)':24}{med['step'][0]:12.4f}{med['step'][1]:12.4f}{med['step'][1] / med['step'][0]:8.2f}")
    print(f"{'switch out+in (s)':24}{med['switch'][0]:12.4f}{med['switch'][1]:12.4f}"
          f"{med['switch'][1] / med['switch'][0]:8.2f}")  # fmt: skip
    mib = 2**20
    print(f"{'state per rank (MiB)':24}{one['bytes'] / mib:12.2f}{two['bytes'] / mib:12.2f}{'':8}"
          f"  (rank 1: {two['bytes1'] / mib:.2f}; rank 0 also holds the full generation copy)")  # fmt: skip
    return {"one": one, "two": two, "median": med}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
