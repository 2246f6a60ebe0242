"""A hostile client of the Tinker API on a real `plexrl serve` with per-user tokens: every bad request gets a clear
4xx (or a failed future) naming the problem, and changes nothing: the victim's model computes what it computed
before, the journal holds no new job, no call was queued. The SDK where it sends the request itself, raw HTTP
where a hostile client would not use the SDK (oversized or malformed bodies, another user's ids)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.types.tensor_data import TensorData  # noqa: E402

from plexrl.server.api import RunningServer, start_server  # noqa: E402
from plexrl.server.config import ServerConfig  # noqa: E402

ANN, BOB = "ann-token-0123456789", "bob-token-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smol_tiny: Path) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("hostile")
    cfg = ServerConfig(
        port=0, journal=str(tmp / "journal.db"), run_dir=str(tmp / "runs"), mlflow=False,
        cluster={"driver": "local", "services": {"count": 1}}, users={"ann": ANN, "bob": BOB},
        allowed_roots=[str(tmp), str(smol_tiny.parent)],
        tinker={"max_datums": 4, "max_body_bytes": 1 << 16, "max_samples": 8, "max_sample_tokens": 16,
                "max_lora_rank": 8},
    )  # fmt: skip
    srv = start_server(cfg)
    yield srv
    srv.stop(120)


def datum(tokens: list[int]) -> types.Datum:
    n = len(tokens) - 1
    inputs = {"target_tokens": TensorData.from_numpy(np.array(tokens[1:])),
              "weights": TensorData.from_numpy(np.ones(n, "f4"))}  # fmt: skip
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def proto_body(model_id: str, data: list[types.Datum], loss: str = "cross_entropy", seq: int = 1) -> Any:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss), model_id=model_id, seq_id=seq
    )
    return forward_backward_request_to_proto(req)


def post(srv: RunningServer, path: str, key: str, body: Any, proto: bool = False) -> httpx.Response:
    headers = {"X-API-Key": f"tml-{key}"}
    if proto:
        headers["Content-Type"] = "application/x-protobuf"
        return httpx.post(f"{srv.url}/api/v1{path}", content=body, headers=headers, timeout=60)
    return httpx.post(f"{srv.url}/api/v1{path}", json=body, headers=headers, timeout=60)


def test_a_hostile_client_gets_4xx_and_changes_nothing(server: RunningServer, smol_tiny: Path) -> None:
    srv = server
    ann = tinker.ServiceClient(base_url=srv.url, api_key=f"tml-{ANN}")
    training = ann.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=1).result()
    probe = [datum([1, 5, 9, 13, 17, 21])]
    before = training.forward(probe, "cross_entropy").result().metrics["loss:sum"]
    state = training.save_state("mine").result().path
    jobs_before = [e.job_id for e in srv.journal.jobs()]
    model = training.model_id

    # no key, a wrong key: 401, nothing done
    assert httpx.post(f"{srv.url}/api/v1/create_session", json={}).status_code == 401
    assert post(srv, "/create_session", "not-a-token-at-all", {}).status_code == 401
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=srv.url, api_key="tml-wrong-token-000000").create_lora_training_client(
            base_model=str(smol_tiny), rank=4
        ).result()

    # unknown models, paths outside the allowed roots (the same answer whether they exist or not), ranks
    for name in ("gpt-5", "/etc", "/root", "/nonexistent/model", "../../etc/passwd"):
        with pytest.raises(tinker.BadRequestError, match="unknown base_model"):
            ann.create_lora_training_client(base_model=name, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match=r"rank must be 1\.\.8"):
        ann.create_lora_training_client(base_model=str(smol_tiny), rank=64).result()

    # what PlexRL does not serve is refused, saying so
    with pytest.raises(tinker.BadRequestError, match="'stable_reinforce' is not served"):
        training.forward_backward(probe, "stable_reinforce").result()
    sampler = training.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="top_k must be -1"):
        sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2, top_k=-5)).result()
    with pytest.raises(tinker.APIStatusError, match=r"413 .*num_samples must be 1\.\.8"):
        sampler.sample(types.ModelInput.from_ints([1, 2]), 9, types.SamplingParams(max_tokens=2)).result()

    # oversized and malformed bodies (raw: the SDK would split the batch itself)
    seq = 1000  # (the SDK's next seq ids stay free: refused requests take none)
    too_many = proto_body(model, [datum([1, 2, 3])] * 5, seq=seq).SerializeToString()
    assert post(srv, "/forward_backward", ANN, too_many, proto=True).status_code == 413
    assert post(srv, "/forward_backward", ANN, b"\x00" * (1 << 17), proto=True).status_code == 413
    assert post(srv, "/forward_backward", ANN, b"\x0a\xff\xff\xff\x0f", proto=True).status_code == 400
    bad = proto_body(model, probe, seq=seq)
    bad.data[0].loss_fn_inputs["weights"].dense = b"\x00\x00\x80"  # 3 bytes for 5 floats
    r = post(srv, "/forward_backward", ANN, bad.SerializeToString(), proto=True)
    assert r.status_code == 400 and "bytes do not hold shape" in r.json()["detail"]
    nan = datum([1, 5, 9, 13])
    nan.loss_fn_inputs["weights"] = TensorData(data=[1.0, float("nan"), 1.0], dtype="float32", shape=[3])
    r = post(srv, "/forward_backward", ANN, proto_body(model, [nan], seq=seq).SerializeToString(), proto=True)
    assert r.status_code == 400 and "NaN" in r.json()["detail"]
    big = datum([1, 10**6, 5])  # a token id beyond the vocabulary (in the model input and the targets)
    r = post(srv, "/forward_backward", ANN, proto_body(model, [big], seq=seq).SerializeToString(), proto=True)
    assert r.status_code == 400 and "input token ids must lie in [0, 49152)" in r.json()["detail"]
    r = httpx.post(f"{srv.url}/api/v1/forward_backward", json={}, headers={"X-API-Key": f"tml-{ANN}"})
    assert r.status_code == 415 and "protobuf" in r.json()["detail"]

    # another user's model, futures and saved weights: 404, as if they did not exist
    bob = tinker.ServiceClient(base_url=srv.url, api_key=f"tml-{BOB}")
    assert post(srv, "/get_info", BOB, {"model_id": model}).status_code == 404
    r = post(srv, "/forward_backward", BOB, proto_body(model, probe, seq=seq).SerializeToString(), proto=True)
    assert r.status_code == 404
    assert post(srv, "/optim_step", BOB, {"model_id": model, "seq_id": seq, "adam_params": {}}).status_code == 404
    unknown = post(srv, "/asample", ANN, {"sampling_session_id": "x", "prompt": {"chunks": []}, "sampling_params": {}})
    assert unknown.status_code == 404
    sid = sampler._sampling_session_id  # (the SDK's own id of its sampling session)
    asked = {"sampling_session_id": sid, "seq_id": 0, "num_samples": 1, "prompt": {"chunks": [{"tokens": [1, 2]}]},
             "sampling_params": {"max_tokens": 2}}  # fmt: skip
    assert post(srv, "/asample", BOB, asked).status_code == 404
    rid = post(srv, "/asample", ANN, asked).json()["request_id"]
    stolen = post(srv, "/retrieve_future", BOB, {"request_id": rid})
    assert stolen.status_code == 410 and "unknown request" in stolen.json()["detail"]
    assert post(srv, "/retrieve_future", ANN, {"request_id": rid}).status_code == 200
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(state).result()

    # nothing changed: ann's model computes what it did, no job was added, nothing waits in the board
    after = training.forward(probe, "cross_entropy").result().metrics["loss:sum"]
    assert after == before
    assert [e.job_id for e in srv.journal.jobs()] == jobs_before
    ann.close("success").result()
    bob.close("success").result()
