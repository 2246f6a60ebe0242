"""What a Tinker client keeps across a restart of `plexrl serve` (the journal's, as the job API's jobs): calls in
flight answer 410 (Tinker's "promise expired", on which the unmodified SDK sends a sample again and raises
`RetryableException` for a training call) instead of failing; an acknowledged `optim_step` is journalled before
its answer, so the session resumes at it; a model with no step yet, a session with no model and a sampling
client on a base model resume too; a LoRA session keeps the alpha it was created with on a server restarted with
another `tinker.lora_alpha` (resumed, loaded from its saved state, exported)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import tinker_server_config, wait_for

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402
from tinker.lib.api_future_impl import _APIFuture  # noqa: E402
from tinker.lib.retryable_exception import RetryableException  # noqa: E402

from plexrl.server.api import RunningServer, start_server  # noqa: E402
from plexrl.server.config import ServerConfig  # noqa: E402
from plexrl.server.tinker.exports import export_dir  # noqa: E402

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


class Restartable:
    """A server on a port kept across its restarts (a client keeps its base_url), and the SDK clients made for
    it: `restart()` stops it and starts it again on the same journal; at the end (the `restartable` fixture)
    the clients are closed while it still runs, then it stops."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg, self.url = cfg, f"http://127.0.0.1:{cfg.port}"
        self.clients: list[Any] = []
        self.srv: RunningServer | None = start_server(cfg)

    @property
    def running(self) -> RunningServer:
        assert self.srv is not None, "the server is stopped"
        return self.srv

    def client(self) -> Any:
        client = tinker.ServiceClient(base_url=self.url, api_key="tml-ann")
        self.clients.append(client)
        return client

    def stop(self) -> None:
        if self.srv is not None:
            srv, self.srv = self.srv, None
            srv.stop(120)

    def restart(self) -> RunningServer:
        self.stop()
        self.srv = start_server(self.cfg)
        return self.srv

    def close(self) -> None:
        try:
            if self.srv is not None:  # (a client's close is a call to the server)
                for client in self.clients:
                    client.close("success").result()
        finally:
            self.stop()


@pytest.fixture
def restartable(tmp_path: Path, smol_tiny: Path) -> Iterator[Callable[..., Restartable]]:
    """Starts a `Restartable` server (one service in this process, on a free port) with `max_load` (64: every
    session on the one service at once, whatever its predicted load; None: the default) and more `fields`."""
    made: list[Restartable] = []

    def start(max_load: float | None = 64, **fields: object) -> Restartable:
        cluster = {} if max_load is None else {"max_load": max_load}
        cfg = tinker_server_config(tmp_path, smol_tiny, port=free_port(), cluster=cluster, **fields)
        made.append(Restartable(cfg))
        return made[-1]

    yield start
    for server in made:
        server.close()


def post(srv: RunningServer, path: str, body: object, user: str = "ann") -> httpx.Response:
    return httpx.post(f"{srv.url}/api/v1{path}", json=body, headers={"X-API-Key": f"tml-{user}"}, timeout=60)


def test_calls_in_flight_at_a_restart_answer_410_and_the_sdk_sends_them_again(
    restartable: Callable[..., Restartable], smol_tiny: Path
) -> None:
    server = restartable(checkpoint_every=1)
    sampler = server.client().create_sampling_client(base_model=str(smol_tiny)).result()
    asked = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 7, "num_samples": 1,
             "prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": {"max_tokens": 2}}  # fmt: skip
    in_flight = post(server.running, "/asample", asked).json()["request_id"]  # (sent; its result never fetched)
    srv = server.restart()
    gone = post(srv, "/retrieve_future", {"request_id": in_flight})
    assert gone.status_code == 410 and "restarted" in gone.json()["detail"]
    assert post(srv, "/retrieve_future", {"request_id": in_flight}, "bob").status_code == 410  # (one answer)
    # the SDK's future on it raises what its sampling client's retry loop sends the request again on
    untyped = types.UntypedAPIFuture(request_id=in_flight, model_id=None)
    future = _APIFuture(types.SampleResponse, sampler.holder, untyped, time.time(), "Sample")
    with pytest.raises(RetryableException):
        future.result(timeout=60)


def test_what_a_client_was_told_resumes_after_a_restart(
    restartable: Callable[..., Restartable], smol_tiny: Path
) -> None:
    server = restartable(checkpoint_every=1)
    srv = server.running
    service, empty = server.client(), server.client()
    gate = threading.Event()
    try:
        trained = service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=5).result()
        fresh = service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=7).result()
        sampler = service.create_sampling_client(base_model=str(smol_tiny)).result()
        shared = service.create_sampling_client(base_model=str(smol_tiny)).result()  # (served by sampler's job)
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
    server.restart()  # (at once: nothing waits for a checkpoint here)
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
    also = shared.sample(PROMPT, 1, types.SamplingParams(max_tokens=3, seed=1)).result(timeout=120)
    assert also.sequences[0].tokens == out.sequences[0].tokens  # one job, one base, one seed


def test_a_new_session_gets_the_one_service_after_a_restart_at_the_default_max_load(
    restartable: Callable[..., Restartable], smol_tiny: Path
) -> None:
    # the default placement, spread+backfill at max_load 1.0, on one service: the resumed sessions' clients stay
    # quiet, and a new session must still get the service (their predicted loads fall while they stay idle)
    server = restartable(max_load=None, checkpoint_every=1)
    assert server.cfg.cluster.placement == "spread+backfill" and server.cfg.cluster.max_load == 1.0
    service = server.client()
    kept = [
        service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=seed).result(timeout=90)
        for seed in (5, 7)
    ]
    for training in kept:
        step(training)
    server.restart()
    late = service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=9).result(timeout=90)
    step(late)
    assert [loss(training) > 0 for training in (*kept, late)] == [True] * 3  # all three served, on the one


def test_a_snapshot_sampling_client_samples_again_after_a_restart(
    restartable: Callable[..., Restartable], smol_tiny: Path
) -> None:
    server = restartable(checkpoint_every=1)
    service = server.client()
    params = types.SamplingParams(max_tokens=4, seed=3)
    training = service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=5).result(timeout=90)
    step(training)
    sampler = training.save_weights_and_get_sampling_client().result(timeout=120)
    before = sampler.sample(PROMPT, 1, params).result(timeout=120)
    step(training)  # the live weights move on; the snapshot stays what it was
    srv = server.restart()
    after = sampler.sample(PROMPT, 1, params).result(timeout=120)  # (the same SDK object: its id is known)
    assert after.sequences[0].tokens == before.sequences[0].tokens  # the snapshot's weights, the same seed
    assert after.sequences[0].logprobs == pytest.approx(before.sequences[0].logprobs, abs=1e-4)
    sid = sampler._sampling_session_id  # recovered for its owner only: to another user, an unknown sampler
    assert httpx.get(f"{srv.url}/api/v1/samplers/{sid}", headers={"X-API-Key": "tml-bob"}).status_code == 404
    assert httpx.get(f"{srv.url}/api/v1/samplers/{sid}", headers={"X-API-Key": "tml-ann"}).status_code == 200
    again = training.save_weights_and_get_sampling_client().result(timeout=120)  # a new one beside it
    assert again._sampling_session_id != sid


def test_a_session_that_ends_while_its_model_opens_leaves_no_job_behind(
    restartable: Callable[..., Restartable], smol_tiny: Path
) -> None:
    # create_model submits the model's job outside the registry's lock; the client's finish comes in between
    srv = restartable().running
    reg = srv.sessions
    entered, gate, real_open = threading.Event(), threading.Event(), reg.backend.open

    def slow_open(*args: object) -> str:
        entered.set()
        assert gate.wait(60), "the test never opened the gate"
        return real_open(*args)  # type: ignore[arg-type]

    reg.backend.open = slow_open  # type: ignore[method-assign]
    answers: list[httpx.Response] = []
    try:
        sid = post(srv, "/create_session", {}).json()["session_id"]
        body = {"session_id": sid, "model_seq_id": 0, "base_model": str(smol_tiny), "lora_config": {"rank": 4}}
        creating = threading.Thread(target=lambda: answers.append(post(srv, "/create_model", body)))
        creating.start()
        assert entered.wait(60), "create_model never reached the job's submission"
        assert post(srv, f"/sessions/{sid}/finish", {}).status_code == 200
        gate.set()
        creating.join(60)
        assert answers and answers[0].status_code == 200, answers
        rid, model_id = answers[0].json()["request_id"], answers[0].json()["model_id"]
        job = reg.models[model_id].job_id
        wait_for(lambda: srv.journal.get(job).finished, f"job {job} of an ended session to end")
        result = post(srv, "/retrieve_future", {"request_id": rid}).json()
        assert "error" in result and "closed" in result["error"], result
    finally:
        gate.set()


def test_a_session_keeps_its_lora_alpha_on_a_server_restarted_with_another(
    restartable: Callable[..., Restartable], smol_tiny: Path
) -> None:
    server = restartable(checkpoint_every=1, tinker={"lora_alpha": 8.0})
    service = server.client()
    trained = service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=5).result()
    step(trained)  # (its adapter's B no longer zero: the alpha scales what it adds)
    expected = loss(trained)
    state = trained.save_state("kept").result(timeout=120).path
    cfg = server.cfg
    server.cfg = cfg.model_copy(update={"tinker": cfg.tinker.model_copy(update={"lora_alpha": 64.0})})
    srv = server.restart()
    assert srv.sessions.cfg.lora_alpha == 64.0
    assert loss(trained) == pytest.approx(expected, rel=1e-6)  # the session resumed from the journal: its alpha
    loaded = service.create_training_client_from_state(state).result()  # a new model from its saved state
    assert loss(loaded) == pytest.approx(expected, rel=1e-6)
    for client, name in ((trained, "resumed"), (loaded, "loaded")):  # their adapters say theirs too
        client.save_weights_external(name).result(timeout=120)
        config = json.loads((export_dir(srv.sessions.root, client.model_id, name) / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"]) == (4, 8.0), config
    owner = json.loads((srv.sessions.root / loaded.model_id.replace(":", "-") / "owner.json").read_text())
    assert owner["lora_alpha"] == 8.0
