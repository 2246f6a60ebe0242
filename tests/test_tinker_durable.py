"""What a Tinker client keeps across a restart of `plexrl serve` (the journal's, as the job API's jobs): calls in
flight answer 410 (Tinker's "promise expired", on which the unmodified SDK sends a sample again and raises
`RetryableException` for a training call) instead of failing."""

from __future__ import annotations

import os
import socket
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


def free_port() -> int:
    with socket.socket() as s:  # one port for both servers: the client keeps its base_url
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(tmp_path: Path, smol_tiny: Path, port: int, **fields: object) -> ServerConfig:
    return ServerConfig(
        port=port, journal=str(tmp_path / "journal.db"), run_dir=str(tmp_path / "runs"),
        cluster={"driver": "local", "services": {"count": 1}}, allowed_roots=[str(tmp_path), str(smol_tiny.parent)],
        mlflow=False, **fields,
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
