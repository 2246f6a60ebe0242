"""One session's own sample calls sent at once run as ONE engine call (`plexrl/runtime/calls.py` `take`,
`calls.Samples`, `sampling.bundled`): the board hands the waiting sample calls of the same weights to one node,
each call gets its own reply, equal to what it gets alone; a call of other weights, or of another kind, waits
for its own node. Alone on a service, in a cohort beside another session's call, and through a `Runner`. Tiny
Llama, real SmolLM2 tokenizer, CPU, fp32."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import count_calls
from test_session_batching import CALLS, perturb, same
from test_session_engine import call, datum, spec

from plexrl.planner import Planner
from plexrl.runtime.calls import CallBoard
from plexrl.services.batched import Member, run_cohort
from plexrl.services.service import Service
from plexrl.sessions.calls import ForwardBackward, Reply, Sample, Samples, pack, unpack

MINE = (CALLS["a"], CALLS["b"], dataclasses.replace(CALLS["c"], seed=99))  # one session's calls, sent at once


def test_the_board_hands_a_sessions_waiting_sample_calls_to_one_node() -> None:
    board = CallBoard()
    told: list[tuple[str, str]] = []
    board.bind(lambda job, kind: told.append((job, kind)), bundle=True)
    board.open("a")
    got: dict[int, Any] = {}
    snapshot = dataclasses.replace(CALLS["b"], weights="/x.safetensors", weights_id="old")
    calls = [*MINE, snapshot, ForwardBackward((datum([1, 2, 3]),), "cross_entropy")]
    for i, c in enumerate(calls):
        board.put("a", c.kind, c, lambda reply, error, i=i: got.__setitem__(i, (reply, error)))
    assert board.started("a") == "sample"
    found, bundle = board.call_of("a", "sample")
    assert found and bundle == Samples(MINE)  # (the snapshot's call has other weights: not taken along)
    replies = [Reply({"n": k}) for k in range(3)]
    packed = pack(dataclasses.asdict(Reply({"replies": [dataclasses.asdict(r) for r in replies]})))
    assert board.finished("a", packed, None) == "sample"
    board.deliver(lambda job: False)
    assert {i: r["value"]["n"] for i, (r, _) in got.items()} == {0: 0, 1: 1, 2: 2}
    found, alone = board.call_of("a", "sample")
    assert alone is snapshot  # alone: no bundle
    board.finished("a", pack(dataclasses.asdict(Reply({"n": 3}))), None)
    found, fb = board.call_of("a", "forward_backward")
    assert found and fb is calls[4]
    board.finished("a", None, "the node failed")
    board.deliver(lambda job: False)
    assert got[3][0]["value"]["n"] == 3 and got[4] == (None, "the node failed")


def test_a_node_failing_fails_every_call_it_ran() -> None:
    board = CallBoard()
    board.bind(lambda job, kind: None, bundle=True)
    board.open("a")
    got: dict[int, Any] = {}
    for i, c in enumerate(MINE):
        board.put("a", c.kind, c, lambda reply, error, i=i: got.__setitem__(i, (reply, error)))
    board.started("a")
    board.call_of("a", "sample")
    board.finished("a", None, "lost")
    board.deliver(lambda job: False)
    assert got == {i: (None, "lost") for i in range(3)}


def test_without_bundling_each_call_runs_alone() -> None:
    """A board whose runner's planner does not batch rollouts: a session's numbers are exactly those alone."""
    board = CallBoard()
    board.bind(lambda job, kind: None)
    board.open("a")
    for c in MINE:
        board.put("a", c.kind, c, lambda reply, error: None)
    board.started("a")
    assert board.call_of("a", "sample") == (True, MINE[0])


def test_a_servers_runner_bundles_by_default_and_its_section_can_turn_it_off() -> None:
    """`plexrl serve` builds its runner from its `cluster:` section (`build_runner`): a client's sample calls sent
    at once run as one engine call there by default (`bundle_calls`), whether or not rollouts are batched."""
    from plexrl.runtime import InlineExecutor
    from plexrl.runtime.build import build_runner
    from plexrl.runtime.config import RuntimeConfig

    for section, want in ((RuntimeConfig(), Samples(MINE)), (RuntimeConfig(bundle_calls=False), MINE[0])):
        board = CallBoard()
        build_runner(section, [], InlineExecutor(), calls=board)
        board.open("a")
        for c in MINE:
            board.put("a", c.kind, c, lambda reply, error: None)
        board.started("a")
        assert board.call_of("a", "sample") == (True, want)


@pytest.fixture
def service(tmp_path: Path, smol_tiny: Path) -> Any:
    svc = Service("s0", spill_dir=tmp_path / "spill", validate=True)
    for i, j in enumerate(("a", "b")):
        svc.load_job(spec(smol_tiny, j, tmp_path))
        perturb(svc, j, i)
    yield svc
    svc.close()


def test_a_sessions_calls_run_together_equal_each_alone(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    alone = [call(service, "a", k, c)["value"] for k, c in enumerate(MINE)]
    from plexrl.engines import mixed

    engine_calls = count_calls(monkeypatch, mixed, "generate_mixed")
    together = call(service, "a", 5, Samples(MINE))
    assert engine_calls == [3] and together["metrics"]["bundled_calls"] == 3.0
    for got, want in zip(together["value"]["replies"], alone, strict=True):
        assert got["error"] is None and got["metrics"]["call_sessions"] == 1.0
        same(got["value"], want)
    # in a cohort beside b's call: one engine call of four calls, two sessions
    b_alone = call(service, "b", 0, CALLS["b"])["value"]
    members = [Member("a", 6, "sample", {}, Samples(MINE)), Member("b", 1, "sample", {}, CALLS["b"])]
    results = run_cohort(service, members, (), ())
    assert engine_calls == [3, 4]
    a, b = (unpack(r.report.reply) for r in results)
    assert b["metrics"]["call_sessions"] == 2.0
    same(b["value"], b_alone)
    for got, want in zip(a["value"]["replies"], alone, strict=True):
        assert got["metrics"]["call_sessions"] == 2.0
        same(got["value"], want)


def test_through_a_runner_a_clients_sample_calls_sent_at_once_run_as_one_node(
    smol_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plexrl.engines import mixed
    from plexrl.runtime import InlineExecutor, Runner

    engine_calls = count_calls(monkeypatch, mixed, "generate_mixed")

    board = CallBoard()
    executor = InlineExecutor(services=1, validate=True)
    runner = Runner(executor, Planner(clock=executor.clock, validate=True, batch_rollouts=True), calls=board)
    replies: dict[int, Any] = {}
    lock = threading.Lock()

    def done(i: int) -> Any:
        def finish(reply: dict[str, Any] | None, error: str | None) -> None:
            with lock:
                replies[i] = (reply, error)
                if len(replies) == len(MINE):
                    runner.close_session("a")

        return finish

    board.open("a")
    for i, c in enumerate(MINE):
        board.put("a", c.kind, c, done(i))
    (run,) = runner.run([spec(smol_tiny, "a", tmp_path / "runner")])
    assert run.status == "done", run.error
    assert engine_calls == [3]  # one node, one engine call, ran the three calls
    svc = Service("ref", spill_dir=tmp_path / "spill")
    try:
        svc.load_job(spec(smol_tiny, "a", tmp_path / "ref"))
        for i, c in enumerate(MINE):
            reply, error = replies[i]
            assert error is None and reply["error"] is None
            got = unpack(reply)
            assert got["metrics"]["call_sessions"] == 1.0
            same(got["value"], call(svc, "a", i, c)["value"])
    finally:
        svc.close()


def test_a_sample_joins_only_a_sample_of_its_weights() -> None:
    a = Sample((1, 2), num_samples=1, max_tokens=2, seed=1)
    assert a.joins(dataclasses.replace(a, seed=2)) and not a.joins(dataclasses.replace(a, weights_id="x"))
    assert not a.joins(ForwardBackward((datum([1, 2]),), "cross_entropy"))
