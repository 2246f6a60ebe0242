"""A session's life on `plexrl serve`, through the unmodified `tinker` SDK: the journal records it, so a restarted
server resumes it from its latest checkpoint and the same client goes on where it was; a session whose client
went silent past `tinker.session_timeout_s` is ended, its state saved where its owner can load it."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import httpx
import pytest
from conftest import wait_for

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402

from plexrl.server.api import start_server  # noqa: E402
from plexrl.server.config import ServerConfig  # noqa: E402
from plexrl.server.tinker.futures import Futures  # noqa: E402
from plexrl.server.tinker.records import FORGET_S  # noqa: E402

DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([1, 4, 9, 16]),
    loss_fn_inputs={"target_tokens": [4, 9, 16, 25], "weights": [1.0, 1.0, 1.0, 1.0]},
)


def config(tmp_path: Path, smol_tiny: Path, port: int = 0, **fields: object) -> ServerConfig:
    return ServerConfig(
        port=port, journal=str(tmp_path / "journal.db"), run_dir=str(tmp_path / "runs"),
        cluster={"driver": "local", "services": {"count": 1}}, allowed_roots=[str(tmp_path), str(smol_tiny.parent)],
        mlflow=False, **fields,
    )  # fmt: skip


def step(training: object) -> float:
    fwd = training.forward_backward([DATUM], "cross_entropy")  # type: ignore[attr-defined]
    training.optim_step(types.AdamParams(learning_rate=0.05)).result()  # type: ignore[attr-defined]
    return float(fwd.result().metrics["loss:sum"])


def loss(training: object) -> float:
    return float(training.forward([DATUM], "cross_entropy").result().metrics["loss:sum"])  # type: ignore[attr-defined]


def test_a_client_waiting_on_its_call_is_not_silent() -> None:
    """A session's call still running (a model loading on a busy machine, a long sample), or one completed or
    fetched within the timeout, keeps its session from the sweep; an old one does not."""
    futures = Futures()
    running = futures.new("ann", "create_model", session="s1")
    futures.new("ann", "forward")  # (no session: never counted)
    assert futures.busy(1.0) == {"s1"}
    futures.complete(running.request_id, "json", {})
    assert futures.busy(1.0) == {"s1"}  # completed just now: its client is about to fetch it
    running.done_at -= 5.0  # type: ignore[operator]  # (as if it completed five seconds ago, never fetched)
    assert futures.busy(1.0) == set() and futures.busy(10.0) == {"s1"}
    running.fetched_at = running.done_at + 4.5  # type: ignore[operator]  # fetched half a second ago
    assert futures.busy(1.0) == {"s1"}


@pytest.mark.slow
def test_a_restarted_server_resumes_a_session_and_its_client_goes_on(tmp_path: Path, smol_tiny: Path) -> None:
    with socket.socket() as s:  # one port for both servers: the client keeps its base_url
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config(tmp_path, smol_tiny, port, checkpoint_every=1)  # a checkpoint after every optim_step
    srv = start_server(cfg)
    service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key="tml-ann")
    try:
        training = service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=5).result()
        step(training)
        step(training)
        expected = loss(training)  # what the state after two steps computes
        job = next(e for e in srv.journal.jobs() if e.config.get("kind") == "session").job_id
        wait_for(lambda: srv.journal.get(job).checkpoint_iteration == 3, "the checkpoint after the second step")
    finally:
        srv.stop(120)
    srv = start_server(cfg)  # the same journal: the session job is queued again, from its checkpoint
    try:
        assert loss(training) == expected  # the same client, the same model id, the state it had
        entry = srv.journal.get(job)
        assert entry.attempt == 2 and entry.status == "running"
        step(training)  # and it trains on
        assert loss(training) != expected
    finally:
        service.close("success").result()
        srv.stop(120)


def test_a_silent_session_is_ended_and_its_state_saved_for_its_owner(tmp_path: Path, smol_tiny: Path) -> None:
    srv = start_server(config(tmp_path, smol_tiny, tinker={"session_timeout_s": 1.0}))
    try:
        service = tinker.ServiceClient(base_url=srv.url, api_key="tml-ann")
        training = service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=5).result()
        step(training)
        expected = loss(training)
        model = srv.sessions.models[training.model_id]
        # no call and (under 10 s, the SDK's period) no heartbeat for a second: the sweep ends it (not before:
        # while a call of its runs, e.g. its model loading on a busy machine, its client polls for it)
        wait_for(lambda: model.status == "ended", "the silent session to end", 60)
        assert model.saved is not None and model.saved.startswith(f"tinker://{training.model_id}/weights/ended-")
        # (the registry hears of the end from the runner's hooks, just before the journal records it)
        wait_for(lambda: srv.journal.get(model.job_id).status == "done", "the journal to record the end", 60)
        with pytest.raises(tinker.APIStatusError, match="410"):
            training.forward([DATUM], "cross_entropy").result()
        service.close("success").result()  # (its session ended: the SDK's heartbeat would go on otherwise)
        srv.sessions.cfg.session_timeout_s = 600.0  # (the clients below: no sweep while a slow machine loads them)
        again = tinker.ServiceClient(base_url=srv.url, api_key="tml-ann")
        resumed = again.create_training_client_from_state_with_optimizer(model.saved).result()
        assert loss(resumed) == expected
        again.close("success").result()
        other = tinker.ServiceClient(base_url=srv.url, api_key="tml-bob")  # (no tokens: the key names the user)
        with pytest.raises(tinker.NotFoundError):
            other.create_training_client_from_state(model.saved).result()
        other.close("success").result()
        # an hour on, the ended session's records are gone (a long-running server keeps no record of every client)
        reg, real = srv.sessions, srv.sessions.clock
        reg.clock = lambda: real() + FORGET_S + 60
        try:
            reg.sweep()
        finally:
            reg.clock = real
        assert training.model_id not in reg.models and model.session_id not in reg.sessions
        assert not [r for r in reg.samplers.values() if r.session_id == model.session_id]
        asked = httpx.post(f"{srv.url}/api/v1/get_info", json={"model_id": training.model_id},
                           headers={"X-API-Key": "tml-ann"}, timeout=60)  # fmt: skip
        assert asked.status_code == 404  # (no longer known: 404, where it was 410)
        last = tinker.ServiceClient(base_url=srv.url, api_key="tml-ann")  # its saved state still loads by path
        assert loss(last.create_training_client_from_state_with_optimizer(model.saved).result()) == expected
        last.close("success").result()
    finally:
        srv.stop(120)


def test_a_full_fine_tuning_session_through_the_sdks_own_options(tmp_path: Path, smol_tiny: Path) -> None:
    """The PlexRL extension: `user_metadata={"plexrl.full_finetune": "true"}` trains every weight; a server
    may refuse it."""
    srv = start_server(config(tmp_path, smol_tiny))
    try:
        service = tinker.ServiceClient(base_url=srv.url, api_key="tml-ann")
        full = service.create_lora_training_client(
            base_model=str(smol_tiny), user_metadata={"plexrl.full_finetune": "true"}
        ).result()
        assert full.get_info().is_lora is False
        before = loss(full)
        step(full)
        assert loss(full) < before  # cross-entropy on the datum it trained on went down
        service.close("success").result()
    finally:
        srv.stop(120)
    srv = start_server(config(tmp_path / "no", smol_tiny, tinker={"full_finetuning": False}))
    try:
        service = tinker.ServiceClient(base_url=srv.url, api_key="tml-ann")
        with pytest.raises(tinker.BadRequestError, match="does not allow full fine-tuning"):
            service.create_lora_training_client(
                base_model=str(smol_tiny), user_metadata={"plexrl.full_finetune": "true"}
            ).result()
        service.close("success").result()
    finally:
        srv.stop(120)
