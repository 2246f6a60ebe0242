"""Calls of the Tinker API that behave as Tinker documents them, through the unmodified `tinker` SDK on a real
`plexrl serve`: `cancel_future` (the SDK's own request) takes back a sample still queued, and `seed=None` samples
with a fresh seed while an explicit seed samples the same tokens every time."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402

from plexrl.server.api import RunningServer, start_server  # noqa: E402
from plexrl.server.config import ServerConfig  # noqa: E402

PROMPT = types.ModelInput.from_ints([1, 4, 9, 16])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smol_tiny: Path) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("fidelity")
    cfg = ServerConfig(
        port=0, journal=str(tmp / "journal.db"), run_dir=str(tmp / "runs"), mlflow=False,
        cluster={"driver": "local", "services": {"count": 1}, "max_load": 64},
        allowed_roots=[str(tmp), str(smol_tiny.parent)],
    )  # fmt: skip
    srv = start_server(cfg)
    yield srv
    srv.stop(120)


def post(srv: RunningServer, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{srv.url}/api/v1{path}", json=body, headers={"X-API-Key": "tml-ann"}, timeout=60)


def test_cancel_future_takes_back_a_queued_sample(server: RunningServer, smol_tiny: Path) -> None:
    service = tinker.ServiceClient(base_url=server.url, api_key="tml-ann")
    try:
        sampler = service.create_sampling_client(base_model=str(smol_tiny)).result()
        sid = sampler._sampling_session_id

        def asked(seq: int, n: int, tokens: int) -> dict[str, object]:
            return {"sampling_session_id": sid, "seq_id": seq, "num_samples": n,
                    "prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": {"max_tokens": tokens}}  # fmt: skip

        first = post(server, "/asample", asked(1, 16, 400)).json()["request_id"]  # (runs a while: the next waits)
        queued = post(server, "/asample", asked(2, 1, 4)).json()["request_id"]
        holder = sampler.holder  # the SDK's own cancel request, as it sends it for an abandoned sample
        holder.run_coroutine_threadsafe(holder._send_cancel_request(queued)).result(timeout=60)
        cancelled = post(server, "/retrieve_future", {"request_id": queued}).json()
        assert cancelled == {"error": "cancelled by its client before it ran", "category": "user"}
        ran = post(server, "/retrieve_future", {"request_id": first})
        assert ran.status_code == 200 and ran.headers["content-type"].startswith("application/x-protobuf")
        holder.run_coroutine_threadsafe(holder._send_cancel_request(first)).result(timeout=60)  # (done: a no-op)
        assert post(server, "/retrieve_future", {"request_id": first}).status_code == 200
        after = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=3, seed=1)).result(timeout=120)
        assert len(after.sequences) == 1  # the session goes on
    finally:
        service.close("success").result()


def test_no_seed_samples_afresh_and_a_seed_repeats(server: RunningServer, smol_tiny: Path) -> None:
    services = [tinker.ServiceClient(base_url=server.url, api_key="tml-ann") for _ in range(2)]
    try:
        # the same program twice (each its first sampling client, its first request): Tinker draws a fresh seed
        unseeded = []
        for service in services:
            sampler = service.create_sampling_client(base_model=str(smol_tiny)).result()
            out = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=16)).result(timeout=120)
            unseeded.append(out.sequences[0].tokens)
        assert unseeded[0] != unseeded[1]
        seeded = [
            sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=16, seed=3)).result(timeout=120).sequences[0]
            for _ in range(2)
        ]
        assert seeded[0].tokens == seeded[1].tokens and seeded[0].logprobs == seeded[1].logprobs
    finally:
        for service in services:
            service.close("success").result()
