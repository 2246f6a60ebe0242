"""Many sessions, one engine call, through the real server: four LoRA sessions over one base, each driven by the
unmodified `tinker` SDK from its own thread, sample at once against `plexrl serve` (`cluster: {batch_rollouts:
true}`, in-process services, the tiny model with the real SmolLM2 tokenizer). Their sample calls reach the idle
service a few milliseconds apart; the first waits (at most `batch_window_s`) for the sessions of its base that
sit idle, and the calls run as one engine call: the journal's rows show `sample/call_sessions` > 1. Then all
send a forward_backward at once: ONE training pass (`forward_backward/call_sessions`). Each session's samples
equal what the same call samples alone (same seed), taken afterwards: tokens exactly, log-probs within float
noise (another batch composition)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")  # (the SDK would post its telemetry to our server)
tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402
from tinker.types.tensor_data import TensorData  # noqa: E402

from plexrl.server.api import start_server  # noqa: E402
from plexrl.server.config import ServerConfig  # noqa: E402
from plexrl.sessions import training  # noqa: E402

SESSIONS = 4
PROMPTS = [[1, 504, 2330, 314], [1, 9, 77], [1, 2330, 30, 2, 11, 5], [1, 42]]  # one per session


def params(i: int) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=5, temperature=1.0, seed=50 + i)


def sampled(result: Any) -> list[tuple[list[int], list[float]]]:
    return [(list(s.tokens), list(s.logprobs or [])) for s in result.sequences]


def test_sessions_sampling_at_once_through_the_sdk_share_one_engine_call(
    tmp_path: Path, smol_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one training pass on this CPU too (by default it is for accelerators: `training.ONE_PASS_DEVICES`)
    monkeypatch.setattr(training, "ONE_PASS_DEVICES", training.ONE_PASS_DEVICES | {"cpu"})
    cfg = ServerConfig(
        port=0, journal=str(tmp_path / "journal.db"), run_dir=str(tmp_path / "runs"), mlflow=False,
        cluster={"driver": "local", "services": {"count": 1}, "validate_state": True, "max_load": 16.0,
                 "batch_rollouts": True, "batch_window_s": 2.0},  # (a loaded test machine: a generous window)
        allowed_roots=[str(tmp_path), str(smol_tiny.parent)], tinker={"engine": "torch"},
    )  # fmt: skip
    srv = start_server(cfg)
    ready = threading.Barrier(SESSIONS, timeout=300)
    samplers: dict[int, Any] = {}
    together: dict[int, Any] = {}
    losses: dict[int, float] = {}
    errors: list[BaseException] = []

    def session(i: int, service: Any) -> None:
        try:
            training = service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=i).result()
            samplers[i] = training.save_weights_and_get_sampling_client().result()
            ready.wait()  # every session idle on the service: now all sample at once
            prompt = types.ModelInput.from_ints(PROMPTS[i])
            together[i] = sampled(samplers[i].sample(prompt, 2, params(i)).result(timeout=300))
            ready.wait()  # then every session's forward_backward at once
            tokens = PROMPTS[i] + together[i][0][0]
            target = TensorData.from_numpy(np.array([*tokens[1:], 0], dtype=np.int64))
            model_input = types.ModelInput.from_ints(tokens)
            datum = types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": target})
            losses[i] = training.forward_backward([datum], "cross_entropy").result(timeout=300).metrics["loss:sum"]
        except BaseException as exc:  # (reported below; a broken barrier frees the others)
            errors.append(exc)
            ready.abort()

    clients = [tinker.ServiceClient(base_url=srv.url, api_key="tml-ann") for _ in range(SESSIONS)]
    try:
        threads = [threading.Thread(target=session, args=(i, clients[i])) for i in range(SESSIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors, errors
        cohorts = srv.controller.runner.planner.counts()["cohorts_sent"]
        # each call again, alone (the others idle: it waits out the window, then runs by itself)
        alone = {}
        for i in range(SESSIONS):
            prompt = types.ModelInput.from_ints(PROMPTS[i])
            alone[i] = sampled(samplers[i].sample(prompt, 2, params(i)).result(timeout=300))
        ids = [e.job_id for e in srv.journal.jobs() if e.config.get("kind") == "session"]

        def rows() -> list[list[float]]:
            return [
                [e.data["metrics"]["sample/call_sessions"] for e in srv.journal.events(job_id)
                 if e.kind == "iteration" and "sample/call_sessions" in e.data["metrics"]]
                for job_id in ids
            ]  # fmt: skip

        # a call's reply goes out before its row is journalled: wait (with a deadline) for the last alone call's
        deadline = time.monotonic() + 60
        while any(len(r) < 2 for r in rows()) and time.monotonic() < deadline:
            threading.Event().wait(0.05)
        shared = rows()
        trained = [
            [e.data["metrics"]["forward_backward/call_sessions"] for e in srv.journal.events(job_id)
             if e.kind == "iteration" and "forward_backward/call_sessions" in e.data["metrics"]]
            for job_id in ids
        ]  # fmt: skip
    finally:
        for c in clients:
            c.close("success").result()
        srv.stop(120)

    assert len(ids) == SESSIONS and all(len(rows) == 2 for rows in shared), shared  # (together, then alone)
    assert cohorts == 2, "the four sessions' sample calls, then their forward_backward calls, did not share one call"
    assert trained == [[SESSIONS]] * SESSIONS, trained  # ONE training pass for the four forward_backward calls
    assert len(losses) == SESSIONS and all(v > 0 for v in losses.values()), losses
    assert all(rows[0] == SESSIONS for rows in shared), shared  # the calls at once: ONE engine call for all
    assert all(rows[1] == 1.0 for rows in shared), shared  # the calls alone: by themselves
    for i in range(SESSIONS):
        assert len(together[i]) == 2
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(together[i], alone[i], strict=True):
            assert tokens == want_tokens and len(tokens) == 5
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
