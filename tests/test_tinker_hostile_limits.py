"""Tinker sessions and DAG jobs under one set of limits on a real two-user `plexrl serve`: a session is an open job
for `limits.max_open_jobs` (checked when its model is created, journalled in the same step as `POST /jobs`), its
base model is checked against `limits.max_parameters`, and each user's share of the open jobs is kept for them,
so one user's sessions cannot lock the other user's DAG jobs out (nor the other way round); a session's state
counts in `limits.max_open_bytes` as a job's does; forward_backward bodies decode at most `tinker.max_body_bytes`
of them at once, however many come. Raw HTTP for the sessions (a refusal comes before any model is placed:
nothing waits for a service)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import TINY, wait_for

from plexrl.server.api import RunningServer, start_server
from plexrl.server.client import Client, ServerError
from plexrl.server.config import ServerConfig
from plexrl.server.limits import session_bytes
from plexrl.server.tinker import proto, routes
from plexrl.server.tinker.handlers import FULL_FINETUNE
from plexrl.sizes import model_bytes

ANN, BOB = "ann-token-0123456789", "bob-token-0123456789"


def server(tmp_path: Path, smol_tiny: Path, **limits: Any) -> RunningServer:
    return start_server(ServerConfig(
        port=0, journal=str(tmp_path / "journal.db"), run_dir=str(tmp_path / "runs"), mlflow=False,
        cluster={"driver": "local", "services": {"count": 1}}, users={"ann": ANN, "bob": BOB},
        allowed_roots=[str(tmp_path), str(smol_tiny.parent)], limits=limits,
    ))  # fmt: skip


def create_model(srv: RunningServer, smol_tiny: Path, key: str, full: bool = False) -> httpx.Response:
    headers = {"X-API-Key": f"tml-{key}"}
    sid = httpx.post(f"{srv.url}/api/v1/create_session", json={}, headers=headers, timeout=30).json()["session_id"]
    body: dict[str, Any] = {"session_id": sid, "model_seq_id": 0, "base_model": str(smol_tiny)}
    body.update({"user_metadata": {FULL_FINETUNE: "true"}} if full else {"lora_config": {"rank": 4}})
    return httpx.post(f"{srv.url}/api/v1/create_model", json=body, headers=headers, timeout=60)


def test_sessions_and_dag_jobs_share_one_admission_and_neither_user_locks_the_other_out(
    tmp_path: Path, smol_tiny: Path
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**TINY, "iterations": 10**5}))  # (stays open for the test)
    srv = server(tmp_path, smol_tiny, max_open_jobs=2)  # (two users: one place of the two kept for each)
    try:
        assert create_model(srv, smol_tiny, ANN).status_code == 200  # ann's session: an open job
        second = create_model(srv, smol_tiny, ANN)  # her second would take bob's share
        assert second.status_code == 400 and "limits.max_open_jobs" in second.text, second.text
        assert "kept for the other users' shares" in second.text
        bob = Client(srv.url, BOB)
        bob.submit(job)  # ann's session does not lock bob's DAG job out
        with pytest.raises(ServerError) as err:
            bob.submit(job)  # the server is full now: bob's second, and anything more, is refused
        assert err.value.status == 400 and "limits.max_open_jobs" in str(err.value)
        assert create_model(srv, smol_tiny, ANN).status_code == 400
        assert len(srv.sessions.models) == 1  # the refused models left nothing behind
    finally:
        srv.stop(120)


def test_a_sessions_base_model_is_checked_against_max_parameters(tmp_path: Path, smol_tiny: Path) -> None:
    srv = server(tmp_path, smol_tiny, max_parameters=1000)  # (the tiny model has about 1.6 M)
    try:
        refused = create_model(srv, smol_tiny, ANN)
        assert refused.status_code == 400 and "limits.max_parameters" in refused.text, refused.text
        assert [e.job_id for e in srv.journal.jobs()] == []  # refused before its job was journalled
    finally:
        srv.stop(120)


def test_a_sessions_state_counts_in_max_open_bytes_as_a_jobs_does(tmp_path: Path, smol_tiny: Path) -> None:
    base = model_bytes(smol_tiny)  # (fp32: a LoRA session holds its base and a small adapter; a full one 3 copies)
    srv = server(tmp_path, smol_tiny, max_open_bytes=int(1.5 * base))
    try:
        full = create_model(srv, smol_tiny, ANN, full=True)  # weights + 2 AdamW moments: 3 x base, over the limit
        assert full.status_code == 400 and "limits.max_open_bytes" in full.text, full.text
        assert "raise it" in full.text and "close a ServiceClient" in full.text
        assert create_model(srv, smol_tiny, ANN).status_code == 200  # one LoRA session fits
        [entry] = srv.journal.jobs()
        assert base < session_bytes(entry.config) < 1.5 * base  # counted: its base and its adapter's state
        second = create_model(srv, smol_tiny, BOB)  # two do not: the first one's bytes are counted
        assert second.status_code == 400 and "limits.max_open_bytes" in second.text, second.text
        assert len(srv.sessions.models) == 1 and len(srv.journal.jobs()) == 1
    finally:
        srv.stop(120)


def recorded_budgets(monkeypatch: pytest.MonkeyPatch) -> list[routes.DecodeBudget]:
    """The decode budgets the next server makes (one: its routes'), to look at while requests wait on them."""
    budgets: list[routes.DecodeBudget] = []
    made = routes.DecodeBudget

    def budget(limit: int) -> routes.DecodeBudget:
        budgets.append(made(limit))
        return budgets[-1]

    monkeypatch.setattr(routes, "DecodeBudget", budget)
    return budgets


@contextlib.contextmanager
def posted_at_once(url: str, body: bytes, headers: dict[str, str], gate: threading.Event) -> Iterator[list[int]]:
    """Four clients POST `body` to `url` at once; yields the list their status codes go into (all four once the
    block is left: `gate` is opened and the clients joined on the way out)."""
    answers: list[int] = []

    def send() -> None:
        answers.append(httpx.post(url, content=body, headers=headers, timeout=120).status_code)

    senders = [threading.Thread(target=send) for _ in range(4)]
    try:
        for t in senders:
            t.start()
        yield answers
    finally:
        gate.set()
        for t in senders:
            t.join(120)


def test_large_bodies_decode_one_at_a_time_the_others_waiting_their_turn(
    tmp_path: Path, smol_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four 5 MiB forward_backward bodies at once (`max_body_bytes` 8 MiB): one decodes, three wait (holding no
    thread), so the decodes' memory together stays that of one body; each is answered as alone afterwards."""
    budgets = recorded_budgets(monkeypatch)
    decode, inside, gate = proto.decode_forward_backward, [], threading.Event()

    def held(body: bytes, max_datums: int) -> Any:
        inside.append(len(body))
        assert gate.wait(60), "the test never opened the gate"
        return decode(body, max_datums)

    monkeypatch.setattr(proto, "decode_forward_backward", held)
    srv = server(tmp_path, smol_tiny)
    body = b"\x1a\x00" * (5 << 19)  # 5 MiB of empty datums
    headers = {"X-API-Key": f"tml-{ANN}", "Content-Type": "application/x-protobuf"}
    try:
        with posted_at_once(f"{srv.url}/api/v1/forward_backward", body, headers, gate) as answers:
            wait_for(lambda: len(inside) == 1 and len(budgets[0].waiting) == 3, "one body decoding, three waiting")
            assert budgets[0].limit == 8 << 20 and budgets[0].used == 5 << 20
    finally:
        srv.stop(120)
    assert answers == [413] * 4 and inside == [5 << 20] * 4  # (past max_datums: refused before the parse)
    assert budgets[0].peak == 5 << 20 and budgets[0].used == 0 and not budgets[0].waiting


def test_large_json_bodies_parse_off_the_event_loop_within_the_same_budget(
    tmp_path: Path, smol_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python's JSON objects take ~20x the bytes of a body of empty arrays: four 5 MiB JSON bodies at once parse
    one at a time in a thread, the others waiting without one; a small body parses at once on the event loop
    meanwhile (the server stays responsive); each large one is then answered as alone."""
    budgets = recorded_budgets(monkeypatch)
    parse, inside, gate = routes.parse_json, [], threading.Event()

    def held(raw: bytes) -> Any:
        if len(raw) > routes.INLINE_JSON:
            inside.append(len(raw))
            assert gate.wait(60), "the test never opened the gate"
        return parse(raw)

    monkeypatch.setattr(routes, "parse_json", held)
    srv = server(tmp_path, smol_tiny)
    pad = b"[]," * ((5 << 20) // 3)
    body = b'{"model_id": "nobody", "pad": [' + pad + b"[]]}"
    headers = {"X-API-Key": f"tml-{ANN}", "Content-Type": "application/json"}
    try:
        with posted_at_once(f"{srv.url}/api/v1/get_info", body, headers, gate) as answers:
            wait_for(lambda: len(inside) == 1 and len(budgets[0].waiting) == 3, "one body parsing, three waiting")
            assert budgets[0].used == len(body)
            small = httpx.post(f"{srv.url}/api/v1/get_info", json={"model_id": "nobody"}, headers=headers,
                               timeout=30)  # fmt: skip
            assert small.status_code == 404 and len(inside) == 1  # answered while the large ones wait
    finally:
        srv.stop(120)
    assert answers == [small.status_code] * 4 and inside == [len(body)] * 4
    assert budgets[0].peak == len(body) and budgets[0].used == 0 and not budgets[0].waiting
