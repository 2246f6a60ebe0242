"""A hostile second user and a clumsy first one against a real two-user `plexrl serve`, through the unmodified
`tinker` SDK, and raw HTTP where the SDK would not send the request: a refused or failed call never ends its
session or blocks the calls after it; another user's ids, paths and futures reveal nothing and change nothing;
bad input gets a 400 naming the field; every per-user bound answers with a 4xx naming its limit."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import wait_for

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402

from plexrl.server.api import RunningServer, start_server  # noqa: E402
from plexrl.server.config import ServerConfig  # noqa: E402

ANN, BOB = "ann-token-0123456789", "bob-token-0123456789"
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([1, 4, 9, 16]),
    loss_fn_inputs={"target_tokens": [4, 9, 16, 25], "weights": [1.0, 1.0, 1.0, 1.0]},
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smol_tiny: Path) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("redteam")
    cfg = ServerConfig(
        port=0, journal=str(tmp / "journal.db"), run_dir=str(tmp / "runs"), mlflow=False,
        cluster={"driver": "local", "services": {"count": 1}}, users={"ann": ANN, "bob": BOB},
        allowed_roots=[str(tmp), str(smol_tiny.parent)],
        tinker={"max_datums": 4, "max_body_bytes": 1 << 16, "max_samples": 8, "max_sample_tokens": 16,
                "max_lora_rank": 8, "poll_s": 1, "max_requests_per_user": 16, "max_open_sessions_per_user": 8},
    )  # fmt: skip
    srv = start_server(cfg)
    yield srv
    srv.stop(120)


def post(srv: RunningServer, path: str, key: str, body: Any = None, raw: bytes | None = None) -> httpx.Response:
    headers = {"X-API-Key": f"tml-{key}"}
    if raw is not None:
        headers["Content-Type"] = "application/x-protobuf"
        return httpx.post(f"{srv.url}/api/v1{path}", content=raw, headers=headers, timeout=60)
    return httpx.post(f"{srv.url}/api/v1{path}", json=body if body is not None else {}, headers=headers, timeout=60)


def result(srv: RunningServer, key: str, rid: str, deadline_s: float = 60.0) -> Any:
    """A request's result, polled with `retrieve_future` (try_again repeats) until `deadline_s`."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        r = post(srv, "/retrieve_future", key, {"request_id": rid})
        assert r.status_code == 200, r.text
        if r.headers.get("content-type", "").startswith("application/x-protobuf"):
            return r.content
        got = r.json()
        if got.get("type") != "try_again":
            return got
    raise AssertionError(f"request {rid} got no answer in {deadline_s} s")


def raw_model(srv: RunningServer, key: str, smol_tiny: Path) -> tuple[str, str]:
    """A fresh LoRA model by raw HTTP (its first training request is seq 1): (session id, model id) once ready."""
    sid = post(srv, "/create_session", key).json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": str(smol_tiny), "lora_config": {"rank": 2}}
    r = post(srv, "/create_model", key, body)
    assert r.status_code == 200, r.text
    assert result(srv, key, r.json()["request_id"])["model_id"] == r.json()["model_id"]
    return sid, str(r.json()["model_id"])


def fb_body(model_id: str, seq: int, tokens: list[int]) -> bytes:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    d = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[d], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq,
    )  # fmt: skip
    return bytes(forward_backward_request_to_proto(req).SerializeToString())


def test_a_refused_request_uses_its_turn_whenever_it_comes(server: RunningServer, smol_tiny: Path) -> None:
    srv = server
    session, model = raw_model(srv, ANN, smol_tiny)
    # seq 2 comes before seq 1 and is refused (a token id beyond the vocabulary): 3 and 4 must still run
    r = post(srv, "/forward_backward", ANN, raw=fb_body(model, 2, [1, 10**6, 3]))
    assert r.status_code == 400 and "token ids must lie in" in r.json()["detail"]
    first = post(srv, "/forward_backward", ANN, raw=fb_body(model, 1, [1, 5, 9])).json()["request_id"]
    step = post(srv, "/optim_step", ANN, {"model_id": model, "seq_id": 3, "adam_params": {"learning_rate": 0.01}})
    later = post(srv, "/forward_backward", ANN, raw=fb_body(model, 4, [1, 5, 9])).json()["request_id"]
    assert isinstance(result(srv, ANN, first), bytes)
    assert "metrics" in result(srv, ANN, step.json()["request_id"])
    assert isinstance(result(srv, ANN, later), bytes)
    # the refused turn stays used: a request sent again with seq 2 is refused, saying why
    again = post(srv, "/forward_backward", ANN, raw=fb_body(model, 2, [1, 5, 9]))
    assert again.status_code == 400 and "out of order" in again.json()["detail"]
    # a refused load_state (a path that is not hers) uses its turn too; the next call runs
    bad = {"model_id": model, "seq_id": 6, "path": f"tinker://{model}/weights/none", "optimizer": False}
    assert post(srv, "/load_weights", ANN, bad).status_code == 404
    assert post(srv, "/load_weights", ANN, {**bad, "seq_id": 5}).status_code == 404
    after = post(srv, "/forward_backward", ANN, raw=fb_body(model, 7, [1, 5, 9])).json()["request_id"]
    assert isinstance(result(srv, ANN, after), bytes)
    assert post(srv, f"/sessions/{session}/finish", ANN, {"reason": {"type": "success"}}).status_code == 200


def test_a_request_refused_before_its_seq_id_was_read_does_not_hold_the_next_ones(
    server: RunningServer, smol_tiny: Path
) -> None:
    """seq 1 never reaches the model (a body over the server's limit is refused before it is read); 2 and 3 wait
    for it, `turn_wait_s`, then get their turn (the registry's tick); 1 coming after that is out of order."""
    srv = server
    session, model = raw_model(srv, ANN, smol_tiny)
    reg, wait = srv.sessions, srv.sessions.cfg.turn_wait_s
    huge = b"\0" * (reg.cfg.max_body_bytes + 1)
    assert post(srv, "/forward_backward", ANN, raw=huge).status_code == 413  # (seq 1: never read)
    second = post(srv, "/forward_backward", ANN, raw=fb_body(model, 2, [1, 5, 9])).json()["request_id"]
    third = post(srv, "/optim_step", ANN, {"model_id": model, "seq_id": 3, "adam_params": {"learning_rate": 0.01}})
    assert reg.futures._items[second].kind is None  # held: 1 has not come
    reg.tick()
    assert reg.futures._items[second].kind is None  # (not yet `turn_wait_s`)
    reg.cfg.turn_wait_s = 0.0
    try:
        reg.tick()
    finally:
        reg.cfg.turn_wait_s = wait
    assert isinstance(result(srv, ANN, second), bytes)
    assert "metrics" in result(srv, ANN, third.json()["request_id"])
    late = post(srv, "/forward_backward", ANN, raw=fb_body(model, 1, [1, 5, 9]))
    assert late.status_code == 400 and "out of order" in late.json()["detail"]
    assert post(srv, f"/sessions/{session}/finish", ANN, {"reason": {"type": "success"}}).status_code == 200


def test_a_users_inputs_waiting_to_run_are_bounded_in_bytes(server: RunningServer, smol_tiny: Path) -> None:
    """Past `tinker.max_queued_bytes_per_user` a forward_backward gets 429 (the SDK sends it again with the same
    seq id, which is then served); a call held for its turn counts until it runs, and nothing stays counted."""
    srv = server
    session, model = raw_model(srv, ANN, smol_tiny)
    futures, user = srv.sessions.futures, srv.sessions.models[model].user
    limit, futures.max_bytes = futures.max_bytes, 1
    try:
        r = post(srv, "/forward_backward", ANN, raw=fb_body(model, 1, [1, 5, 9]))
        assert r.status_code == 429 and "max_queued_bytes_per_user" in r.json()["detail"], r.text
    finally:
        futures.max_bytes = limit
    first = post(srv, "/forward_backward", ANN, raw=fb_body(model, 1, [1, 5, 9])).json()["request_id"]
    assert isinstance(result(srv, ANN, first), bytes)
    third = post(srv, "/forward_backward", ANN, raw=fb_body(model, 3, [1, 5, 9])).json()["request_id"]
    assert futures.waiting_bytes(user) == 2 * 8 + 2 * 8 + 2 * 4  # (held for seq 2: 2 tokens, targets, weights)
    second = post(srv, "/forward_backward", ANN, raw=fb_body(model, 2, [1, 5, 9])).json()["request_id"]
    assert isinstance(result(srv, ANN, second), bytes) and isinstance(result(srv, ANN, third), bytes)
    assert futures.waiting_bytes(user) == 0
    assert post(srv, f"/sessions/{session}/finish", ANN, {"reason": {"type": "success"}}).status_code == 200


def test_a_failed_sample_leaves_its_training_session_alive(server: RunningServer, smol_tiny: Path) -> None:
    ann = tinker.ServiceClient(base_url=server.url, api_key=f"tml-{ANN}")
    training = ann.create_lora_training_client(base_model=str(smol_tiny), rank=2, seed=3).result()
    training.forward_backward([DATUM], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=0.05)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    # a temperature whose division overflows is served as greedy decoding (documented), like temperature 0
    tiny = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=1e-300)).result()
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert tiny.sequences[0].tokens == greedy.sequences[0].tokens
    # a sample that fails on its service (its snapshot, no longer the live weights, unreadable) fails alone
    training.forward_backward([DATUM], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=0.05)).result()
    before = training.forward([DATUM], "cross_entropy").result().metrics["loss:sum"]
    snapshots = list(server.sessions.root.rglob("snapshots/*.safetensors"))
    assert snapshots
    for f in snapshots:
        f.write_bytes(b"not a safetensors file")
    with pytest.raises(tinker.RequestFailedError, match="sample call failed on its service") as failed:
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4)).result()
    assert str(server.sessions.root) not in str(failed.value)  # (the server's paths are not shown)
    # more snapshots than a model keeps: the oldest sampler is refused up front, naming the remedy
    for _ in range(9):
        training.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="snapshot was dropped"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4)).result()
    session = sampler._sampling_session_id.split(":")[0]  # (only the kept snapshots' clients come back at a restart)
    assert len(list((server.sessions.root / "clients" / session).glob("*.json"))) == 8
    assert training.forward([DATUM], "cross_entropy").result().metrics["loss:sum"] == before
    ann.close("success").result()


def test_another_users_files_sessions_and_futures_reveal_nothing(server: RunningServer, smol_tiny: Path) -> None:
    import shutil

    srv = server
    users = Path(srv.sessions.run_dir) / "users"
    private = users / "ann" / "jobs" / "annjob-1" / "model"
    shutil.copytree(smol_tiny, private, dirs_exist_ok=True)  # ann's finished job's model, private to her
    bob = tinker.ServiceClient(base_url=srv.url, api_key=f"tml-{BOB}")
    answers = []
    for name in (private, private.parent / "missing", users / "ann"):
        with pytest.raises(tinker.BadRequestError, match="unknown base_model") as refused:
            bob.create_lora_training_client(base_model=str(name), rank=2).result()
        answers.append(str(refused.value).replace(str(name), "NAME"))
    assert len(set(answers)) == 1  # one answer whether the foreign path exists or not
    ann = tinker.ServiceClient(base_url=srv.url, api_key=f"tml-{ANN}")
    mine = ann.create_lora_training_client(base_model=str(private), rank=2).result()  # her own: allowed
    session = mine.model_id.split(":")[0]

    # ann's session jobs appear nowhere bob reads; ann sees them
    assert session in post_get(srv, "/jobs", ANN)
    for path in ("/jobs", "/cluster", "/metrics"):
        assert session not in post_get(srv, path, BOB), path
    job = next(e.job_id for e in srv.journal.jobs() if e.job_id.startswith(session))
    assert httpx.get(f"{srv.url}/jobs/{job}", headers=bearer(BOB)).status_code == 404
    cancel = httpx.post(f"{srv.url}/jobs/{job}/cancel", headers=bearer(BOB), json={})
    assert cancel.status_code == 404, cancel.text

    # futures: random ids; bob's read of ann's pending id answers at once, of her finished one changes nothing
    held = post(srv, "/forward_backward", ANN, raw=fb_body(mine.model_id, 50, [1, 5, 9])).json()["request_id"]
    sampler = mine.save_weights_and_get_sampling_client().result()
    asked = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 7, "num_samples": 1,
             "prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": {"max_tokens": 2}}  # fmt: skip
    finished = post(srv, "/asample", ANN, asked).json()["request_id"]
    wait_for(lambda: srv.sessions.futures.get(finished).kind is not None, "ann's sample to finish")
    for rid in (held, finished):
        assert re.fullmatch(r"r[0-9a-f]{24}", rid)
        start = time.monotonic()
        stolen = post(srv, "/retrieve_future", BOB, {"request_id": rid})
        assert stolen.status_code == 410 and "unknown request" in stolen.json()["detail"]
        assert time.monotonic() - start < 0.5
    assert srv.sessions.futures.get(finished).fetched_at is None  # (no expiry started by bob's read)
    got = post(srv, "/retrieve_future", ANN, {"request_id": finished})
    assert got.headers["content-type"].startswith("application/x-protobuf")  # her samples, still there
    ann.close("success").result()
    bob.close("success").result()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post_get(srv: RunningServer, path: str, key: str) -> str:
    r = httpx.get(f"{srv.url}{path}", headers=bearer(key), timeout=30)
    assert r.status_code == 200, r.text
    return r.text


def test_bad_input_gets_400_naming_the_field(server: RunningServer, smol_tiny: Path, caplog: Any) -> None:
    srv = server
    deep = b"[" * 30_000 + b"]" * 30_000  # (under this server's 64 KiB body limit)
    for path in ("/create_session", "/optim_step"):
        r = httpx.post(f"{srv.url}/api/v1{path}", content=deep, timeout=30,
                       headers={"X-API-Key": f"tml-{ANN}", "Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 400 and "nested too deep" in r.json()["detail"], r.text
    sid = post(srv, "/create_session", ANN).json()["session_id"]
    for base in (f"{smol_tiny}\0", f"{smol_tiny.parent}/{'a' * 300}", "x" * 5000):
        body = {"session_id": sid, "model_seq_id": 0, "base_model": base, "lora_config": {"rank": 2}}
        r = post(srv, "/create_model", ANN, body)
        assert r.status_code == 400 and "base_model" in r.json()["detail"], r.text
    r = post(srv, "/load_weights", ANN, {"session_id": sid, "model_seq_id": 1,
                                         "path": f"tinker://{sid}:train:\u00b2/weights/x"})  # fmt: skip
    assert (r.status_code in (400, 404) and "tinker://" in r.text) or "no model" in r.text, r.text
    assert "Traceback" not in caplog.text


def test_every_per_user_bound_answers_with_its_limit(server: RunningServer, smol_tiny: Path) -> None:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    srv = server
    ann = tinker.ServiceClient(base_url=srv.url, api_key=f"tml-{ANN}")
    training = ann.create_lora_training_client(base_model=str(smol_tiny), rank=2).result()
    model = training.model_id
    # datums past max_datums: refused while decoding (nothing built for the rest), 413
    flood = fb_body(model, 900, [1, 5, 9]) + b"\x1a\x00" * 20_000
    r = post(srv, "/forward_backward", ANN, raw=flood)
    assert r.status_code == 413 and "max_datums (4)" in r.json()["detail"] and "body too large" in r.text, r.text

    # a wide sparse target: a few bytes on the wire, 262144 values decoded per datum: over the per-call budget
    def empty(dtype: str) -> types.TensorData:  # (one stored value: an empty CSR's parts are not serialized)
        return types.TensorData(data=[1], dtype=dtype, shape=[1, 262144], sparse_crow_indices=[0, 1],
                                sparse_col_indices=[3])  # fmt: skip

    d = types.Datum(
        model_input=types.ModelInput.from_ints([1]),
        loss_fn_inputs={"target_tokens": empty("int64"), "weights": empty("float32")},
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[d] * 4, loss_fn="cross_entropy"),
        model_id=model, seq_id=901,
    )  # fmt: skip
    wire = forward_backward_request_to_proto(req)
    r = post(srv, "/forward_backward", ANN, raw=bytes(wire.SerializeToString()))
    assert r.status_code == 413 and "values per token" in r.json()["detail"], r.text

    # bob floods samples he never retrieves: his 17th is refused (429 naming the limit); ann is served
    bob = tinker.ServiceClient(base_url=srv.url, api_key=f"tml-{BOB}")
    bobs = bob.create_lora_training_client(base_model=str(smol_tiny), rank=2).result()
    sampler = bobs.save_weights_and_get_sampling_client().result()
    asked = {"sampling_session_id": sampler._sampling_session_id, "num_samples": 1,
             "prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": {"max_tokens": 2}}  # fmt: skip
    codes = [post(srv, "/asample", BOB, {**asked, "seq_id": 100 + i}).status_code for i in range(18)]
    assert codes.count(429) >= 1 and codes[:10] == [200] * 10, codes
    refused = post(srv, "/asample", BOB, {**asked, "seq_id": 200})
    assert refused.status_code == 429 and "max_requests_per_user" in refused.json()["detail"]
    assert training.forward([DATUM], "cross_entropy").result().metrics["loss:sum"] > 0

    # sessions per user; a finish reason's size
    sessions = [post(srv, "/create_session", BOB) for _ in range(10)]
    assert [r.status_code for r in sessions].count(429) >= 1
    assert "max_open_sessions_per_user" in next(r for r in sessions if r.status_code == 429).json()["detail"]
    sid = post(srv, "/create_session", ANN).json()["session_id"]
    assert post(srv, f"/sessions/{sid}/finish", ANN, {"reason": {"type": "x" * 60_000}}).status_code == 200
    gone = post(srv, "/session_heartbeat", ANN, {"session_id": sid})
    assert gone.status_code == 410 and len(gone.text) < 400, len(gone.text)

    # writes: a full disk refuses them like POST /jobs (503), a refusal the SDK retries with the same seq id, so
    # its turn waits: once the disk has room the retry is served; saved bytes per user (413, not retried)
    full = ["the disk is full (test)"]
    srv.sessions.disk = lambda: full.pop() if full else None
    try:
        assert training.save_state("full").result().path.endswith("/weights/full")
        assert full == []  # (refused once, then served on the SDK's retry)
    finally:
        srv.sessions.disk = None
    srv.sessions.cfg.max_saved_bytes_per_user = 1
    try:
        with pytest.raises(tinker.APIStatusError, match="max_saved_bytes_per_user"):
            training.save_state("one").result()
            training.save_state("two").result()
    finally:
        srv.sessions.cfg.max_saved_bytes_per_user = 10 << 30
    assert training.forward([DATUM], "cross_entropy").result().metrics["loss:sum"] > 0
    ann.close("success").result()
    bob.close("success").result()
