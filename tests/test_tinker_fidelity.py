"""Calls of the Tinker API that behave as Tinker documents them, through the unmodified `tinker` SDK on a real
`plexrl serve`: `cancel_future` (the SDK's own request) takes back a sample still queued, and `seed=None` samples
with a fresh seed while an explicit seed samples the same tokens every time."""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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

        board = server.sessions.backend.board  # the runner takes the first call only once the gate opens
        gate, take = threading.Event(), board.take

        def gated(*args: Any) -> Any:
            assert gate.wait(60), "the test never opened the gate"
            return take(*args)

        board.take = gated
        try:
            first = post(server, "/asample", asked(1, 2, 8)).json()["request_id"]
            queued = post(server, "/asample", asked(2, 1, 4)).json()["request_id"]  # (waits behind the first)
            holder = sampler.holder  # the SDK's own cancel request, as it sends it for an abandoned sample
            holder.run_coroutine_threadsafe(holder._send_cancel_request(queued)).result(timeout=60)
        finally:
            gate.set()
            board.take = take
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


def test_one_sessions_sampling_clients_on_a_base_share_one_job(
    server: RunningServer, smol_tiny: Path, tmp_path: Path
) -> None:
    """A loop that makes a sampling client of the base model again and again (more than the 8 open models a
    user may have) is served by ONE job: each client samples, with its own seed; and each is recorded so that
    it comes back with that job after a restart (its weights: the job's own)."""
    from plexrl.server.tinker import durable

    service = tinker.ServiceClient(base_url=server.url, api_key="tml-ann")
    try:
        samplers = [service.create_sampling_client(base_model=str(smol_tiny)).result() for _ in range(10)]
        outs = [s.sample(PROMPT, 1, types.SamplingParams(max_tokens=6, seed=4)).result(timeout=120) for s in samplers]
        assert all(o.sequences[0].tokens == outs[0].sequences[0].tokens for o in outs)  # one base, one seed
        reg = server.sessions
        ids = {reg.samplers[s._sampling_session_id].model_id for s in samplers}
        assert len(ids) == 1 and reg.models[ids.pop()].sampler_only
        session = samplers[0]._sampling_session_id.split(":")[0]
        kept = durable.kept_samplers(reg.root, session, "ann")
        assert len(kept) == 9 and all(r.weights is None for r in kept)  # (the first is its job's own model)
    finally:
        service.close("success").result()


def test_a_models_metadata_seed_and_optimizer_are_as_the_client_asked(server: RunningServer, smol_tiny: Path) -> None:
    """`user_metadata` given at creation comes back on the model's training run (the cookbook reads its renderer
    name there); no seed is a random one, recorded (each unseeded model another); a client made from saved
    state with another optimizer than AdamW is refused, as one made fresh is; a full disk refuses new
    sampling clients and models made from saved state, as it refuses fresh ones."""
    service = tinker.ServiceClient(base_url=server.url, api_key="tml-ann")
    rest = tinker.RestClient(base_url=server.url, api_key="tml-ann")
    reg = server.sessions
    try:
        meta = {"renderer_name": "role_colon", "project": "x"}
        named = service.create_lora_training_client(base_model=str(smol_tiny), rank=2, user_metadata=meta).result()
        assert rest.get_training_run(named.model_id).result().user_metadata == meta
        unseeded = [service.create_lora_training_client(base_model=str(smol_tiny), rank=2).result() for _ in range(2)]
        seeded = service.create_lora_training_client(base_model=str(smol_tiny), rank=2, seed=77).result()
        seeds = [reg.models[c.model_id].seed for c in (*unseeded, seeded)]
        assert seeds[0] != seeds[1] and seeds[2] == 77, seeds
        assert all(
            seed != int(c.model_id.split(":")[2]) for seed, c in zip(seeds, unseeded, strict=False)
        )  # (not the seq id)
        kept = seeded.save_state("kept").result().path
        with pytest.raises(tinker.APIStatusError, match="AdamW"):
            service.create_training_client_from_state(kept, optimizer=types.DimuonOptimizerConfig()).result()
        session = named.model_id.split(":")[0]
        reg.disk = lambda: "the disk is full (test)"
        try:
            asked = {
                "/load_weights": {"path": kept, "model_seq_id": 90},
                "/create_sampling_session": {"base_model": str(smol_tiny), "sampling_session_seq_id": 91},
            }
            for path, body in asked.items():
                answer = post(server, path, {**body, "session_id": session})
                assert answer.status_code == 503 and "full" in answer.json()["detail"], answer.text
        finally:
            reg.disk = None
    finally:
        service.close("success").result()


def test_saved_names_are_not_overwritten_silently_and_keep_their_ttl_and_metadata(
    server: RunningServer, smol_tiny: Path
) -> None:
    service = tinker.ServiceClient(base_url=server.url, api_key="tml-ann")
    rest = tinker.RestClient(base_url=server.url, api_key="tml-ann")
    try:
        training = service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=5).result()
        start = dt.datetime.now(dt.UTC)
        training.save_weights_for_sampler("pick", ttl_seconds=7200, user_metadata={"tag": "a"}).result()
        with pytest.raises(tinker.BadRequestError, match="sampler weights 'pick' exist; save under another name"):
            training.save_weights_for_sampler("pick").result()
        training.save_state("state", user_metadata={"step": "0"}).result()
        listed = rest.list_checkpoints(training.model_id).result().checkpoints
        by_id = {c.checkpoint_id: c for c in listed}
        pick, state = by_id["sampler_weights/pick"], by_id["weights/state"]
        assert pick.user_metadata == {"tag": "a"} and state.user_metadata == {"step": "0"}
        assert pick.expires_at is not None and state.expires_at is None
        assert dt.timedelta(seconds=7190) < pick.expires_at - start < dt.timedelta(seconds=7300)
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds must be"):
            training.save_state("late", ttl_seconds=0).result()
    finally:
        rest.holder.close()
        service.close("success").result()
