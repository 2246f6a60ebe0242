"""The Tinker API end to end: the unmodified `tinker` SDK drives a real `plexrl serve` (in-process, a real HTTP
server, journal and MLflow; services in-process, `driver: local`). A GRPO loop written against the SDK in the
style of the cookbook's `rl_loop.py` (local prompts, a local reward) trains a LoRA adapter on a tiny model with
the real SmolLM2 tokenizer, beside a DAG GRPO job on the same service: each learns exactly what it learns
alone, and the planner interleaved their nodes."""

from __future__ import annotations

import copy
import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import TINY, stable, wait_for

os.environ.setdefault("TINKER_TELEMETRY", "0")  # (the SDK would post its telemetry to our server)
tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402
from tinker.types.tensor_data import TensorData  # noqa: E402

from plexrl.server.api import RunningServer, start_server  # noqa: E402
from plexrl.server.client import Client  # noqa: E402
from plexrl.server.config import ServerConfig  # noqa: E402

PROMPTS = ["What is 2 + 3?", "Name a prime.", "Count to three.", "Say hello."]  # the loop's local data


def reward(tokens: list[int]) -> float:
    """A verifiable reward a random model can learn: its first token is even."""
    return 1.0 if tokens and tokens[0] % 2 == 0 else 0.0


def grpo_loop(url: str, base_model: str, steps: int = 3, group: int = 4, started: Any = None) -> list[dict[str, float]]:
    """A GRPO loop against the SDK, as the cookbook's `rl_loop.py` writes it: per step, fresh sampler weights,
    `group` samples per prompt, group-centred rewards as advantages, importance_sampling, one Adam step.
    `started()`: called once the training client is there."""
    service = tinker.ServiceClient(base_url=url, api_key="tml-ann")
    training = service.create_lora_training_client(base_model=base_model, rank=4, seed=7).result()
    if started is not None:
        started()
    tokenizer = training.get_tokenizer()
    adam = types.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8)
    history = []
    for step in range(steps):
        sampler = training.save_weights_and_get_sampling_client().result()
        prompts = [types.ModelInput.from_ints(tokenizer.encode(p)) for p in PROMPTS]
        # (seeded: without a seed each sample draws a fresh one, and two runs would differ)
        params = [types.SamplingParams(max_tokens=4, temperature=1.0, stop=[tokenizer.eos_token_id],
                                       seed=100 * step + i) for i in range(len(prompts))]  # fmt: skip
        futures = [
            sampler.sample(prompt=p, num_samples=group, sampling_params=params[i]) for i, p in enumerate(prompts)
        ]
        datums, rewards = [], []
        for future, prompt in zip(futures, prompts, strict=True):
            result = future.result()
            group_rewards = [reward(s.tokens) for s in result.sequences]
            mean = sum(group_rewards) / len(group_rewards)
            rewards.append(mean)
            for seq, r in zip(result.sequences, group_rewards, strict=True):
                ob = prompt.length - 1
                model_input = prompt.append(types.EncodedTextChunk(tokens=seq.tokens[:-1]))
                n = model_input.length
                inputs = {
                    "target_tokens": TensorData.from_numpy(np.array([0] * ob + seq.tokens)),
                    "logprobs": TensorData.from_numpy(np.array([0.0] * ob + list(seq.logprobs or []), "f4")),
                    "advantages": TensorData.from_numpy(np.array([0.0] * ob + [r - mean] * (n - ob), "f4")),
                }
                datums.append(types.Datum(model_input=model_input, loss_fn_inputs=inputs))
        fwd = training.forward_backward(datums, loss_fn="importance_sampling")
        opt = training.optim_step(adam)
        loss = fwd.result().metrics["loss:sum"]
        grad = opt.result().metrics["grad_norm"]  # type: ignore[index]
        history.append({"reward": sum(rewards) / len(rewards), "loss": loss, "grad_norm": grad})
    service.close("success").result()
    return history


def dag_job(tmp_path: Path, name: str) -> Path:
    cfg = copy.deepcopy(TINY)
    cfg.update(name=name, iterations=3, run_dir=str(tmp_path / "runs"))
    cfg["tracking"] = {"progress": False, "log_model": False}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def served(tmp_path: Path, smol_tiny: Path) -> RunningServer:
    cfg = ServerConfig(
        port=0, journal=str(tmp_path / "journal.db"), run_dir=str(tmp_path / "runs"),
        allowed_roots=[str(tmp_path), str(smol_tiny.parent)],
        cluster={"driver": "local", "services": {"count": 1}, "validate_state": True,
                 "max_load": 4.0,  # both jobs on the one service, whatever their predicted loads
                 # each sample call alone: bundled calls (the default) get the tokens they get alone, their
                 # log-probs only up to the float noise of a batch composition that depends on arrival times
                 "bundle_calls": False},
    )  # fmt: skip
    return start_server(cfg)


def finished(srv: RunningServer, job_id: str) -> Any:
    return wait_for(lambda: (e := srv.journal.get(job_id)) is not None and e.finished and e, f"{job_id} to end", 600)


def metrics(srv: RunningServer, job_id: str) -> list[dict[str, float]]:
    return [e.data["metrics"] for e in srv.journal.events(job_id) if e.kind == "iteration"]


@pytest.mark.slow
def test_a_grpo_loop_through_the_sdk_learns_what_it_learns_alone_beside_a_dag_job(
    tmp_path: Path, smol_tiny: Path
) -> None:
    srv = served(tmp_path, smol_tiny)
    try:
        client = Client(srv.url)
        alone = client.submit(dag_job(tmp_path, "dag"), [], user="bob")["job_id"]
        assert finished(srv, alone).status == "done"
        loop_alone = grpo_loop(srv.url, str(smol_tiny))

        submitted: list[str] = []

        def start_dag() -> None:  # once the session is on the service, so that their work overlaps
            submitted.append(client.submit(dag_job(tmp_path, "dag"), [], user="bob")["job_id"])
            wait_for(lambda: srv.journal.get(submitted[0]).status == "running", "the DAG job to be placed", 300)

        loop_together = grpo_loop(srv.url, str(smol_tiny), started=start_dag)
        together = submitted[0]
        assert finished(srv, together).status == "done"
        cluster = client.request("GET", "/cluster")
        dag_alone, dag_together = metrics(srv, alone), metrics(srv, together)
        ids = [e.job_id for e in srv.journal.jobs() if e.config.get("kind") == "session"]
        sessions = [finished(srv, job_id) for job_id in ids]  # (closed by their clients: done once idle)
    finally:
        srv.stop(120)

    assert loop_together == loop_alone  # exactly: the same samples, losses and gradient norms
    assert len(loop_alone) == 3 and all(row["grad_norm"] > 0 for row in loop_alone)
    assert stable(dag_together) == stable(dag_alone) and len(dag_alone) == 4  # (the baseline evaluation, 3 iterations)

    # the planner interleaved them on the one service: the job running there changed at least twice
    assert [e.status for e in sessions] == ["done", "done"]
    second = sessions[1].job_id
    order = [s["job"] for s in sorted(cluster["spans"], key=lambda s: s["start"])
             if s["kind"] == "node" and s["job"] in (second, together)]  # fmt: skip
    switches = sum(a != b for a, b in itertools.pairwise(order))
    assert switches >= 2, f"the session and the DAG job did not interleave: {order}"

    # MLflow has a run per session, a row per call (calls keep their order: forward_backward then optim_step)
    from mlflow.tracking import MlflowClient

    tracking = sessions[1].tracking
    history = MlflowClient(tracking["uri"]).get_metric_history(tracking["run_id"], "forward_backward/loss")
    assert [m.value for m in history] == pytest.approx([row["loss"] for row in loop_together], rel=1e-6)


def a_few_calls(url: str, base_model: str) -> dict[str, Any]:
    service = tinker.ServiceClient(base_url=url, api_key="tml-ann")
    try:
        training = service.create_lora_training_client(base_model=base_model, rank=4, seed=3).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        got = sampler.sample(
            types.ModelInput.from_ints([1, 2, 3]), 2, types.SamplingParams(max_tokens=4, seed=11)
        ).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})  # fmt: skip
        fwd = training.forward_backward([datum], "cross_entropy").result()
        step = training.optim_step(types.AdamParams(learning_rate=0.01)).result()
        return {"tokens": [s.tokens for s in got.sequences], "logprobs": [s.logprobs for s in got.sequences],
                "loss": fwd.metrics["loss:sum"], "grad_norm": step.metrics}  # fmt: skip
    finally:
        service.close("success").result()


@pytest.mark.slow
def test_sessions_run_on_dask_workers_and_compute_what_they_compute_in_process(tmp_path: Path, smol_tiny: Path) -> None:
    """`driver: dask`, the server's default: a call rides with its node to the service worker and its reply comes
    back in the node's report (msgpack); the numbers equal the in-process driver's."""
    results = []
    for driver in ("local", "dask"):
        cfg = ServerConfig(
            port=0, journal=str(tmp_path / driver / "journal.db"), run_dir=str(tmp_path / driver / "runs"),
            cluster={"driver": driver, "services": {"count": 1}}, allowed_roots=[str(tmp_path), str(smol_tiny.parent)],
            mlflow=False,
        )  # fmt: skip
        srv = start_server(cfg)
        try:
            results.append(a_few_calls(srv.url, str(smol_tiny)))
        finally:
            srv.stop(120)
    assert results[0] == results[1]
