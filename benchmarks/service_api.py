"""What the Tinker API costs and what a loop through it learns, side by side in one run.

`overhead`: one sequence of session calls (a sampler snapshot, P sample calls of G samples, a forward_backward
with importance_sampling, an optim_step; `--steps` times) run twice: in-process, on a `Service` with the
session's engine (no HTTP, no planner: the same work at its cheapest), and through the unmodified `tinker` SDK
on `plexrl serve` (HTTP, futures, the planner, the journal; `--driver local | dask`), the two arms' steps
interleaved (a load that drifts during the run slows both alike). Prints per call kind the mean seconds of each,
their ratio and difference, and the headline `ratio sdk / in-process` over all calls.

`smollm2`: a GRPO loop through the SDK (the cookbook's rl_loop.py shape, importance_sampling, group-centred
rewards) against the same GRPO job declared as a DAG (`configs/grpo_smollm2_addition.yaml` with a LoRA adapter
of the same rank), both on SmolLM2-135M-Instruct, the same prompts, rewards and learning rate, each alone for
`--minutes`: steps per second and held-out greedy accuracy after that time. Needs the data files
(`benchmarks/real_model.py --write-data runs/data/addition`). Heavy: run it alone (on a shared
machine, under a lock such as `flock LOCKFILE ...`).

    .venv/bin/python benchmarks/service_api.py overhead [--steps 5] [--driver local] [--layers 2]
    .venv/bin/python benchmarks/service_api.py smollm2 [--minutes 20] [--eval-size N] [--arm both|dag|sdk]
    .venv/bin/python benchmarks/service_api.py --smoke        # both, tiny, seconds (the test suite runs it)
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TINKER_TELEMETRY", "0")  # (the SDK would post its telemetry to the server)

ROOT = Path(__file__).resolve().parent.parent
SMOL_CONFIG = ROOT / "configs" / "grpo_smollm2_addition.yaml"
PROMPT = "What is 17 + 25? Answer with the sum."


# -- a model --------------------------------------------------------------------------------------------
def tiny_smol(out: Path) -> Path:
    """A 1-layer random Llama (hidden 32) with the real SmolLM2 tokenizer (the smoke runs' model)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from plexrl.job.pretrained import pretrained_path

    real = pretrained_path("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(str(real))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig.from_pretrained(str(real)).save_pretrained(out)
    return out


def server(tmp: Path, model_dir: Path, driver: str, **fields: Any) -> Any:
    from plexrl.server.api import start_server
    from plexrl.server.config import ServerConfig

    cfg = ServerConfig(
        port=0, journal=str(tmp / "journal.db"), run_dir=str(tmp / "runs"),
        cluster={"driver": driver, "services": {"count": 1}}, allowed_roots=[str(tmp), str(model_dir.parent)],
        mlflow=False, **fields,
    )  # fmt: skip
    return start_server(cfg)


# -- overhead -------------------------------------------------------------------------------------------
class InProcess:
    """The session's engine on a Service in this process: each call's seconds, by kind (`times`)."""

    def __init__(self, model_dir: Path, tmp: Path, prompts: int, group: int, tokens: int) -> None:
        from plexrl.services.service import Service
        from plexrl.sessions.spec import SessionConfig, prepare_session

        model = {"path": str(model_dir), "lora": {"r": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}
        tracking = {"mlflow": False, "progress": False, "log_model": False}
        spec = prepare_session(SessionConfig(name="bench", run_dir=str(tmp), model=model, tracking=tracking))  # type: ignore[arg-type]
        self.svc = Service("s0", spill_dir=tmp / "spill")
        self.svc.load_job(spec)
        self.tmp, self.prompts, self.group, self.tokens, self.it = tmp, prompts, group, tokens, 0
        self.prompt = tuple(spec.tokenizer.encode(PROMPT))
        self.times: dict[str, list[float]] = defaultdict(list)

    def run(self, call: Any) -> dict[str, Any]:
        from plexrl.sessions.calls import unpack

        t0 = time.perf_counter()
        res = self.svc.run_node("bench", self.it, call.kind, {}, call=call)
        self.times["save_for_sampler" if call.kind == "save" else call.kind].append(time.perf_counter() - t0)
        self.it += 1
        assert res.report.ok and res.report.reply is not None, res.report.error
        out: dict[str, Any] = unpack(res.report.reply)["value"]
        return out

    def step(self, step: int) -> None:
        from plexrl.sessions.calls import ForwardBackward, OptimStep, Sample, Save

        snap = self.run(Save(str(self.tmp / f"snap{step}.safetensors"), "sampler"))
        data = []
        for p in range(self.prompts):
            got = self.run(Sample(self.prompt, self.group, self.tokens, seed=step * 1000 + p, weights=snap["path"],
                                  weights_id=snap["weights_id"]))  # fmt: skip
            for s in got["sequences"]:
                data.append(_datum(list(self.prompt), s["tokens"].tolist(), s["logprobs"].tolist(), 1.0))
        self.run(ForwardBackward(tuple(_as_call(d) for d in data), "importance_sampling"))
        self.run(OptimStep(learning_rate=1e-4))

    def close(self) -> None:
        self.svc.close()


def _datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float) -> dict[str, Any]:
    ob = len(prompt) - 1
    return {"tokens": prompt + tokens[:-1], "targets": [0] * ob + tokens, "logprobs": [0.0] * ob + logprobs,
            "advantages": [0.0] * ob + [advantage] * len(tokens)}  # fmt: skip


def _as_call(d: dict[str, Any]) -> Any:
    from plexrl.sessions.calls import Datum

    inputs = {"target_tokens": np.array(d["targets"], np.int64), "logprobs": np.array(d["logprobs"], "f4"),
              "advantages": np.array(d["advantages"], "f4")}  # fmt: skip
    return Datum(np.array(d["tokens"], np.int64), inputs)


def _sdk_datum(d: dict[str, Any]) -> Any:
    from tinker import types
    from tinker.types.tensor_data import TensorData

    inputs = {"target_tokens": TensorData.from_numpy(np.array(d["targets"])),
              "logprobs": TensorData.from_numpy(np.array(d["logprobs"], "f4")),
              "advantages": TensorData.from_numpy(np.array(d["advantages"], "f4"))}  # fmt: skip
    return types.Datum(model_input=types.ModelInput.from_ints(d["tokens"]), loss_fn_inputs=inputs)


class ThroughSDK:
    """The same calls through the SDK on a server at `url`: each call's seconds, by kind (`times`), from the call
    until its result is in the caller's hand."""

    def __init__(self, url: str, model_dir: Path, prompts: int, group: int, tokens: int) -> None:
        import tinker
        from tinker import types

        self.types, self.prompts, self.group = types, prompts, group
        self.times: dict[str, list[float]] = defaultdict(list)
        self.service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        self.training = self.service.create_lora_training_client(
            base_model=str(model_dir), rank=8, train_mlp=False, train_unembed=False, seed=0
        ).result()
        self.prompt = self.training.get_tokenizer().encode(PROMPT)
        self.params = types.SamplingParams(max_tokens=tokens, temperature=1.0)

    def timed(self, kind: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.times[kind].append(time.perf_counter() - t0)
        return out

    def step(self, step: int) -> None:
        types, training = self.types, self.training
        sampler = self.timed("save_for_sampler", lambda: training.save_weights_and_get_sampling_client().result())
        data = []
        for _p in range(self.prompts):
            prompt = types.ModelInput.from_ints(self.prompt)
            got = self.timed("sample", lambda p=prompt: sampler.sample(p, self.group, self.params).result())
            for s in got.sequences:
                data.append(_sdk_datum(_datum(self.prompt, s.tokens, list(s.logprobs or []), 1.0)))
        self.timed("forward_backward", lambda: training.forward_backward(data, "importance_sampling").result())
        self.timed("optim_step", lambda: training.optim_step(types.AdamParams(learning_rate=1e-4)).result())

    def close(self) -> None:
        self.service.close("success").result()


def overhead(args: argparse.Namespace, tmp: Path) -> None:
    """Both arms set up side by side, then their steps interleaved (one in-process step, then the same step through
    the SDK): a machine whose load drifts during the run slows both alike. Only one arm computes at a time; while
    the in-process arm runs, the idle server's threads only wake to sweep sessions (once a second)."""
    if args.smoke:
        model_dir = tiny_smol(tmp / "model")
    else:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _smol_short import short_copy

        model_dir = short_copy(args.layers)
    shape = (args.prompts, args.group, args.tokens)
    load_before = os.getloadavg()[0]
    local = InProcess(model_dir, tmp / "inproc", *shape)
    srv = server(tmp / "served", model_dir, args.driver)
    remote = None
    try:
        remote = ThroughSDK(srv.url, model_dir, *shape)
        for step in range(args.steps):
            local.step(step)
            remote.step(step)
    finally:
        local.close()
        if remote is not None:
            remote.close()
        srv.stop(120)
    shown = f"{args.steps} steps x ({args.prompts} prompts x {args.group} samples of {args.tokens} tokens)"
    load = f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after (1 min)"
    print(f"{shown}, model {model_dir.name}, driver {args.driver}; the arms' steps interleaved; the first step is a "
          f"warm-up, left out; {load}")  # fmt: skip
    print("| call | n | in-process s | through the SDK s | ratio | SDK - in-process ms |")
    print("|---|---|---|---|---|---|")
    total_local = total_remote = 0.0
    skip = 1 if args.steps > 1 else 0
    for kind in ("save_for_sampler", "sample", "forward_backward", "optim_step"):
        per = len(local.times[kind]) // args.steps
        a, b = local.times[kind][skip * per :], remote.times[kind][skip * per :]
        total_local, total_remote = total_local + sum(a), total_remote + sum(b)
        ma, mb = statistics.mean(a), statistics.mean(b)
        print(f"| {kind} | {len(a)} | {ma:.4f} | {mb:.4f} | {mb / ma:.2f} | {1000 * (mb - ma):.1f} |")
    calls = sum(len(v) for v in remote.times.values())
    print(f"ratio sdk / in-process (all calls): {total_remote / total_local:.2f} "
          f"({total_remote - total_local:.3f} s more over {calls} calls)")  # fmt: skip


# -- SmolLM2: a loop through the SDK against the same GRPO job as a DAG ----------------------------------
def dag_config(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from plexrl.yamlio import load_yaml_file

    if args.smoke:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _tiny import tiny_job

        raw = tiny_job(tmp / "runs", iterations=10_000)
        raw["model"]["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
        raw["pipeline"]["params"].update(eval_every=10, optimiser={"lr": 1e-3})
        return raw
    raw = load_yaml_file(SMOL_CONFIG)
    raw.update(iterations=100_000, run_dir=str(tmp / "runs"), engine="torch")
    if args.eval_size:
        raw["pipeline"]["params"]["eval_size"] = args.eval_size
    raw["model"]["lora"] = {"r": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    raw["tracking"] = {"mlflow": False, "progress": False, "log_model": False}
    return dict(raw)


def run_dag(raw: dict[str, Any], seconds: float) -> tuple[int, float, float | None, list[tuple[int, float]]]:
    """The DAG job alone, in-process, for `seconds`: (steps, seconds, its last held-out accuracy, its curve: the
    held-out accuracy after each evaluated step count; its evaluations run inside its clock)."""
    from plexrl.hooks.base import Hook
    from plexrl.job.load import load_job
    from plexrl.job.spec import JobRun, prepare_job
    from plexrl.planner import Planner
    from plexrl.runtime import InlineExecutor, Runner

    spec = prepare_job(load_job(raw))
    state: dict[str, Any] = {"steps": 0, "acc": None, "curve": []}
    runner: Any = None

    class Clock(Hook):
        def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
            if "evaluate/accuracy" in metrics:
                state["acc"] = metrics["evaluate/accuracy"]
                state["curve"].append((iteration + 1, metrics["evaluate/accuracy"]))
                print(f"[dag] after {iteration + 1} steps: held-out {state['acc']:.3f} "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
            if iteration >= 0:
                state["steps"] = iteration + 1
            if time.perf_counter() - start >= seconds:
                runner.stop("time is up")

    executor = InlineExecutor()
    runner = Runner(executor, Planner(clock=executor.clock), hooks=[Clock()])
    start = time.perf_counter()
    runner.run([spec])
    return state["steps"], time.perf_counter() - start, state["acc"], state["curve"]


CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # the grpo preset's clip_eps 0.2


def grpo_minibatches(rows: list[tuple[list[int], list[int], list[float], float]], group: int,
                     minibatches: int) -> list[list[dict[str, Any]]]:  # fmt: skip
    """The DAG's GRPO update as SDK data (`operators/train.py`, the grpo preset): group-normalised advantages
    ((r - mean) / (biased std + 1e-6) over each prompt's `group` samples), rows of advantage 0 left out, the
    rest split into `minibatches` steps; each token's advantage divided by the whole batch's sampled tokens /
    `minibatches` (`skip_norm: full`: Tinker's losses sum over tokens, the DAG's takes that token mean)."""
    rewards = np.array([r for *_, r in rows], dtype=np.float64).reshape(-1, group)
    adv = ((rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)).reshape(-1)
    denominator = max(sum(len(toks) for _, toks, _, _ in rows), 1) / minibatches
    kept = [
        _datum(prompt, toks, logps, float(a) / denominator)
        for (prompt, toks, logps, _), a in zip(rows, adv, strict=True)
        if a != 0.0
    ]  # fmt: skip
    cuts = [round(i * len(kept) / minibatches) for i in range(minibatches + 1)]
    return [kept[a:b] for a, b in itertools.pairwise(cuts) if b > a]


def run_sdk_loop(url: str, raw: dict[str, Any], spec: Any, seconds: float) -> tuple[int, float, float, Any]:
    """The GRPO loop through the SDK for `seconds` on the DAG job's prompts and rewards: (steps, seconds,
    held-out greedy accuracy at the end, (its curve at the DAG's evaluation steps, seconds spent evaluating)).
    Its evaluations (one sample call per held-out prompt, as an SDK user writes it) stop its clock."""
    import tinker
    from tinker import types

    from plexrl.data.prompts import prompts_of

    task, tok, params = spec.task, spec.tokenizer, raw["pipeline"]["params"]
    batch, group, max_new = params.get("batch_size", 8), params.get("n", 8), params.get("max_new_tokens", 24)
    opt, eval_size = params.get("optimiser", {}), params.get("eval_size", 64)
    lr, beta2 = opt.get("lr", 2e-5), opt.get("beta2", 0.999)
    lora = raw["model"]["lora"]
    service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    steps, start = 0, time.perf_counter()
    try:
        base = raw["model"].get("pretrained") or str(spec.model_path)  # (a served name, or a path under the roots)
        training = service.create_lora_training_client(
            base_model=base, rank=lora["r"], train_mlp=False, train_unembed=False, seed=0
        ).result()
        minibatches = opt.get("minibatches", 2)  # (the grpo preset's: operators/objective.py)
        adam = types.AdamParams(learning_rate=lr, beta1=0.9, beta2=beta2, eps=1e-8, grad_clip_norm=1.0)
        sampling = types.SamplingParams(max_tokens=max_new, temperature=params.get("temperature", 1.0),
                                        stop=[tok.eos_token_id])  # fmt: skip
        every, held = (
            params.get("eval_every", 10),
            prompts_of([task.held_out[i] for i in range(min(eval_size, len(task.held_out)))], tok),
        )
        greedy = types.SamplingParams(max_tokens=max_new, temperature=0.0, stop=[tok.eos_token_id])
        curve: list[tuple[int, float]] = []
        evaluating = 0.0

        def evaluate() -> float:
            nonlocal evaluating
            t0 = time.perf_counter()
            sampler = training.save_weights_and_get_sampling_client().result()
            outs = [sampler.sample(types.ModelInput.from_ints(p), 1, greedy) for p in held.token_ids]
            texts = [tok.decode(f.result().sequences[0].tokens, skip_special_tokens=True) for f in outs]
            verdicts = task.verify(texts, held.answers)
            evaluating += time.perf_counter() - t0
            curve.append((steps, sum(v or 0.0 for v in verdicts) / len(verdicts)))
            print(f"[sdk] after {steps} steps: held-out {curve[-1][1]:.3f} ({time.perf_counter() - start:.0f} s, "
                  f"{evaluating:.0f} s of it evaluating)", flush=True)  # fmt: skip
            return curve[-1][1]

        evaluate()
        start = time.perf_counter()
        while time.perf_counter() - start - evaluating < seconds:
            rows = [task.train[(steps * batch + i) % len(task.train)] for i in range(batch)]
            prompts = prompts_of(rows, tok)
            sampler = training.save_weights_and_get_sampling_client().result()
            futures = [sampler.sample(types.ModelInput.from_ints(p), group, sampling) for p in prompts.token_ids]
            rows = []  # (prompt, tokens, logprobs, reward) of every sample, in prompt order
            for fut, prompt, answer in zip(futures, prompts.token_ids, prompts.answers, strict=True):
                seqs = fut.result().sequences
                texts = [tok.decode(s.tokens, skip_special_tokens=True) for s in seqs]
                rewards = [r or 0.0 for r in task.verify(texts, [answer] * len(texts))]
                rows += [(list(prompt), s.tokens, list(s.logprobs or []), r)
                         for s, r in zip(seqs, rewards, strict=True)]  # fmt: skip
            for part in grpo_minibatches(rows, group, minibatches):
                training.forward_backward([_sdk_datum(d) for d in part], "ppo", CLIP).result()
                training.optim_step(adam).result()
            steps += 1
            if steps % every == 0:
                evaluate()
        elapsed = time.perf_counter() - start - evaluating
        final = curve[-1][1] if curve[-1][0] == steps else evaluate()
        return steps, elapsed, final, (curve, evaluating)
    finally:
        service.close("success").result()


def smollm2(args: argparse.Namespace, tmp: Path) -> None:
    from plexrl.job.load import load_job
    from plexrl.job.spec import prepare_job

    raw = dag_config(args, tmp)
    seconds = 5.0 if args.smoke else args.minutes * 60
    arms = ("dag", "sdk") if args.arm == "both" else (args.arm,)
    dag = run_dag(raw, seconds) if "dag" in arms else None
    loop = None
    if "sdk" in arms:
        spec = prepare_job(load_job(raw))  # its prompts, rewards and model (cached when the DAG run built it)
        srv = server(tmp / "served-loop", Path(spec.model_path), args.driver)
        try:
            loop = run_sdk_loop(srv.url, raw, spec, seconds)
        finally:
            srv.stop(120)
    print(f"each alone for {seconds:.0f} s ({'tiny smoke job' if args.smoke else 'SmolLM2-135M-Instruct, LoRA'})")
    print("| arm | steps | steps/s | held-out accuracy at the end |")
    print("|---|---|---|---|")
    if dag is not None:
        print(f"| DAG job (in-process) | {dag[0]} | {dag[0] / dag[1]:.3f} | {dag[2]} |")
    if loop is not None:
        print(f"| loop through the SDK | {loop[0]} | {loop[0] / loop[1]:.3f} | {loop[2]:.3f} |")
    if dag is not None and loop is not None:
        print(
            f"steps/s loop / DAG: {(loop[0] / loop[1]) / max(dag[0] / dag[1], 1e-9):.2f} (the DAG's clock holds its "
            f"evaluations; the loop's does not: it spent {loop[3][1]:.0f} s more evaluating)"
        )
    dag_at, loop_at = dict(dag[3] if dag else []), dict(loop[3][0] if loop else [])
    print("held-out greedy accuracy after k steps ('-': that arm did not reach or evaluate k)")
    print("| k | DAG job | loop through the SDK |")
    print("|---|---|---|")
    for k in sorted(dag_at if dag is not None else loop_at):
        cells = [("-" if at.get(k) is None else f"{at[k]:.3f}") for at in (dag_at, loop_at)]
        print(f"| {k} | {cells[0]} | {cells[1]} |")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("part", nargs="?", choices=["overhead", "smollm2", "both"], default="both")
    ap.add_argument("--steps", type=int, default=5, help="overhead: loop steps (the first is a warm-up)")
    ap.add_argument("--prompts", type=int, default=4, help="overhead: sample calls per step")
    ap.add_argument("--group", type=int, default=4, help="overhead: samples per call")
    ap.add_argument("--tokens", type=int, default=16, help="overhead: tokens per sample")
    ap.add_argument("--layers", type=int, default=2, help="overhead: layers of the SmolLM2 copy (_smol_short)")
    ap.add_argument("--driver", choices=["local", "dask"], default="local", help="the server's driver")
    ap.add_argument("--minutes", type=float, default=20.0, help="smollm2: minutes for each arm")
    ap.add_argument(
        "--eval-size",
        type=int,
        default=0,
        help="smollm2: held-out prompts per evaluation, both arms (default: the config's)",
    )
    ap.add_argument("--arm", choices=["both", "dag", "sdk"], default="both", help="smollm2: which arms run")
    ap.add_argument("--smoke", action="store_true", help="both parts, tiny (the test suite runs it)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.prompts, args.group, args.tokens = 2, 2, 2, 4
    with tempfile.TemporaryDirectory(prefix="plexrl-service-api-") as name:
        tmp = Path(name)
        if args.part in ("overhead", "both"):
            overhead(args, tmp)
        if args.part in ("smollm2", "both"):
            smollm2(args, tmp)


if __name__ == "__main__":
    main()
