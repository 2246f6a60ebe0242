"""What a Tinker client keeps across a restart of `plexrl serve` (the journal's, as the job API's jobs): calls in
flight answer 410 (Tinker's "promise expired", on which the unmodified SDK sends a sample again and raises
`RetryableException` for a training call) instead of failing; an acknowledged `optim_step` is journalled before
its answer, so the session resumes at it; a model with no step yet, a session with no model and a sampling
client on a base model resume too."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402
from tinker.lib.api_future_impl import _APIFuture  # noqa: E402
from tinker.lib.retryable_exception import RetryableException  # noqa: E402

from plexrl.server.api import RunningServer, start_server  # noqa: E402
from plexrl.server.config import ServerConfig  # noqa: E402

PROMPT = types.ModelInput.from_ints([1, 4, 9, 16])
DATUM = types.Datum(
    model_input=PROMPT, loss_fn_inputs={"target_tokens": [4, 9, 16, 25], "weights": [1.0, 1.0, 1.0, 1.0]}
)


def step(training: object) -> None:
    training.forward_backward([DATUM], "cross_entropy")  # type: ignore[attr-defined]
    training.optim_step(types.AdamParams(learning_rate=0.05)).result(timeout=120)  # type: ignore[attr-defined]


def loss(training: object) -> float:
    out = training.forward([DATUM], "cross_entropy").result(timeout=120)  # type: ignore[attr-defined]
    return float(out.metrics["loss:sum"])


def free_port() -> int:
    with socket.socket() as s:  # one port for both servers: the client keeps its base_url
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(tmp_path: Path, smol_tiny: Path, port: int, **fields: object) -> ServerConfig:
    # (max_load: after a restart the resumed sessions' learned loads would leave a new one waiting on 1 service)
    return ServerConfig(
        port=port, journal=str(tmp_path / "journal.db"), run_dir=str(tmp_path / "runs"),
        cluster={"driver": "local", "services": {"count": 1}, "max_load": 64},
        allowed_roots=[str(tmp_path), str(smol_tiny.parent)], mlflow=False, **fields,
    )  # fmt: skip


def post(srv: RunningServer, path: str, body: object, user: str = "ann") -> httpx.Response:
    return httpx.post(f"{srv.url}/api/v1{path}", json=body, headers={"X-API-Key": f"tml-{user}"}, timeout=60)


def test_calls_in_flight_at_a_restart_answer_410_and_the_sdk_sends_them_again(tmp_path: Path, smol_tiny: Path) -> None:
    port = free_port()
    cfg = config(tmp_path, smol_tiny, port, checkpoint_every=1)
    srv = start_server(cfg)
    service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key="tml-ann")
    try:
        sampler = service.create_sampling_client(base_model=str(smol_tiny)).result()
        asked = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 7, "num_samples": 1,
                 "prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": {"max_tokens": 2}}  # fmt: skip
        in_flight = post(srv, "/asample", asked).json()["request_id"]  # (sent; its result never fetched)
    finally:
        srv.stop(120)
    srv = start_server(cfg)
    try:
        gone = post(srv, "/retrieve_future", {"request_id": in_flight})
        assert gone.status_code == 410 and "restarted" in gone.json()["detail"]
        assert post(srv, "/retrieve_future", {"request_id": in_flight}, "bob").status_code == 410  # (one answer)
        # the SDK's future on it raises what its sampling client's retry loop sends the request again on
        untyped = types.UntypedAPIFuture(request_id=in_flight, model_id=None)
        future = _APIFuture(types.SampleResponse, sampler.holder, untyped, time.time(), "Sample")
        with pytest.raises(RetryableException):
            future.result(timeout=60)
    finally:
        service.close("success").result()
        srv.stop(120)


def test_what_a_client_was_told_resumes_after_a_restart(tmp_path: Path, smol_tiny: Path) -> None:
    port = free_port()
    cfg = config(tmp_path, smol_tiny, port, checkpoint_every=1)
    srv = start_server(cfg)
    url = f"http://127.0.0.1:{port}"
    service, empty = (
        tinker.ServiceClient(base_url=url, api_key="tml-ann"),
        tinker.ServiceClient(base_url=url, api_key="tml-ann"),
    )
    gate = threading.Event()
    try:
        trained = service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=5).result()
        fresh = service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=7).result()
        sampler = service.create_sampling_client(base_model=str(smol_tiny)).result()
        job = srv.sessions.models[trained.model_id].job_id
        # the first step's checkpoint is held at its journal write: its optim_step is not answered meanwhile
        entered, write = threading.Event(), srv.journal.checkpoint

        def gated(*args: object, **kwargs: object) -> None:
            entered.set()
            assert gate.wait(60), "the test never opened the gate"
            write(*args, **kwargs)  # type: ignore[arg-type]

        srv.journal.checkpoint = gated  # type: ignore[method-assign]
        trained.forward_backward([DATUM], "cross_entropy")
        first = trained.optim_step(types.AdamParams(learning_rate=0.05))
        assert entered.wait(60), "the checkpoint after the optim_step never started"
        (future,) = [f for f in srv.sessions.futures._items.values() if f.what == "optim_step"]
        assert future.kind is None  # not answered before its checkpoint is journalled
        gate.set()
        first.result(timeout=120)
        srv.journal.checkpoint = write  # type: ignore[method-assign]
        assert srv.journal.get(job).checkpoint_iteration == 1
        step(trained)  # calls 2 (forward_backward), 3 (optim_step): journalled before the answer
        assert srv.journal.get(job).checkpoint_iteration == 3
    finally:
        gate.set()  # (a failed assertion above leaves no checkpoint waiting)
        srv.stop(120)  # (at once: nothing waits for a checkpoint here)
    srv = start_server(cfg)
    try:
        resumed = loss(trained)  # the state after both acknowledged steps
        again = service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=5).result()
        step(again)
        step(again)
        assert loss(again) == resumed
        before = loss(fresh)  # no step yet: resumed from its seed, where a new model of that seed starts
        assert before == loss(service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=7).result())
        step(fresh)
        assert loss(fresh) < before
        late = empty.create_lora_training_client(base_model=str(smol_tiny), rank=4).result()  # its session resumed
        assert late.get_info().is_lora
        out = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=3, seed=1)).result(timeout=120)
        assert len(out.sequences) == 1 and 1 <= len(out.sequences[0].tokens) <= 3
    finally:
        service.close("success").result()
        empty.close("success").result()
        srv.stop(120)
