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
from test_lora_vllm import smol32  # noqa: F401 (a fixture)
from test_session_batching import CALLS, perturb, same
from test_session_engine import call, datum, spec

from plexrl.planner import Planner
from plexrl.runtime.calls import BUNDLE, BUNDLE_ROWS, CallBoard
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


def test_a_bursting_sessions_first_call_waits_the_window_so_its_burst_runs_as_one_node() -> None:
    """A client that sent calls at once before (its last node ran several) gets its next burst's first call
    announced only after the window, with the calls sent with it behind it: one node for the burst. A session
    never seen bursting is announced at once; a wait that gathered nothing stops the waiting; a session that ends
    during a wait is never announced."""
    timers: list[tuple[float, Any]] = []
    board = CallBoard(timer=lambda seconds, fn: timers.append((seconds, fn)))
    told: list[tuple[str, str]] = []
    board.bind(lambda job, kind: told.append((job, kind)), bundle=True, window=0.02)
    ignore = lambda reply, error: None  # noqa: E731

    def burst(job: str, calls: tuple[Sample, ...]) -> None:
        for c in calls:
            board.put(job, c.kind, c, ignore)

    def run(job: str) -> Any:
        found, call = board.call_of(job, "sample")
        assert found
        board.finished(job, None, "(not looked at)")
        return call

    for job in ("a", "b"):
        board.open(job)
        assert board.started(job) is None
    board.put("b", "sample", CALLS["b"], ignore)
    assert told == [("b", "sample")] and not timers  # b never sent calls at once: at once
    assert run("b") is CALLS["b"]
    burst("a", MINE[:1])  # a's first burst reaches the board over a few ms: the first call announced and run
    assert told[-1] == ("a", "sample") and not timers and run("a") is MINE[0]  # alone, before the rest came
    burst("a", MINE[1:])
    assert run("a") == Samples(MINE[1:]) and len(told) == 3 and not timers
    burst("a", MINE)  # a ran calls together: its next first call waits
    assert len(told) == 3 and [s for s, _ in timers] == [0.02]
    timers.pop()[1]()
    assert told[-1] == ("a", "sample") and len(told) == 4
    assert run("a") == Samples(MINE)  # the whole burst, one node
    board.put("a", "sample", MINE[0], ignore)  # waits, and gathers nothing
    timers.pop()[1]()
    assert run("a") is MINE[0]
    board.put("a", "sample", MINE[1], ignore)  # so the next call goes at once
    assert not timers and len(told) == 6 and run("a") is MINE[1]
    burst("a", MINE[:2])  # bursting again: together (announced at once, both waiting), then waits again
    assert run("a") == Samples(MINE[:2]) and len(told) == 7
    board.put("a", "sample", MINE[2], ignore)
    board.drop("a", "the session ended")
    timers.pop()[1]()
    assert len(told) == 7  # never announced
    # a call that comes while a call it would have joined runs was sent with it: the next burst waits; a call of
    # a kind that never runs together (forward_backward) never waits
    board.open("c")
    board.started("c")
    board.put("c", "sample", MINE[0], ignore)
    assert board.call_of("c", "sample") == (True, MINE[0])  # running, not finished yet
    board.put("c", "sample", MINE[1], ignore)  # a moment late
    board.finished("c", None, "(not looked at)")
    assert run("c") is MINE[1] and not timers
    fb = ForwardBackward((datum([1, 2, 3]),), "cross_entropy")
    board.put("c", fb.kind, fb, ignore)
    assert not timers and told[-1] == ("c", "forward_backward")
    assert board.call_of("c", fb.kind) == (True, fb)
    board.finished("c", None, "(not looked at)")
    board.put("c", "sample", MINE[2], ignore)
    assert [s for s, _ in timers] == [0.02]


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


def test_a_bundle_stops_at_its_samples_in_all_so_a_flood_of_big_calls_runs_one_per_node() -> None:
    """A bundle is one call another user's call waits for whole: it takes calls while their samples stay within
    `BUNDLE_ROWS` (a loop's eight 8-sample calls: one node), so calls that each fill a batch run one per node."""
    board = CallBoard()
    board.bind(lambda job, kind: None, bundle=True)
    board.open("a")
    small = [dataclasses.replace(CALLS["a"], num_samples=BUNDLE_ROWS // BUNDLE, seed=i) for i in range(BUNDLE)]
    big = [dataclasses.replace(CALLS["a"], num_samples=BUNDLE_ROWS, seed=i) for i in range(3)]
    half = [dataclasses.replace(CALLS["a"], num_samples=BUNDLE_ROWS // 2 + 1, seed=i) for i in range(2)]
    for c in (*small, *big, *half):
        board.put("a", c.kind, c, lambda reply, error: None)
    board.started("a")
    taken = []
    for _ in range(6):
        found, got = board.call_of("a", "sample")
        assert found
        taken.append(got.calls if isinstance(got, Samples) else (got,))
        board.finished("a", {"value": {}}, None)
    assert taken == [tuple(small), (big[0],), (big[1],), (big[2],), (half[0],), (half[1],)]


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


def test_a_full_fine_tuning_sessions_calls_sent_at_once_are_one_decode_loop_each_as_alone(
    smol_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full fine-tuning session on torch (no shared base): its calls sent at once run as one decode loop over its
    own model (they ran one after another), each reply what the call gets alone."""
    from plexrl.engines import mixed

    svc = Service("s0", spill_dir=tmp_path / "spill", validate=True)
    try:
        svc.load_job(spec(smol_tiny, "f", tmp_path, lora=False))
        alone = [call(svc, "f", k, c)["value"] for k, c in enumerate(MINE)]
        engine_calls = count_calls(monkeypatch, mixed, "generate_mixed")
        together = call(svc, "f", 5, Samples(MINE))
        assert engine_calls == [3] and together["metrics"]["bundled_calls"] == 3.0
        for got, want in zip(together["value"]["replies"], alone, strict=True):
            assert got["error"] is None
            same(got["value"], want)
    finally:
        svc.close()


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


def test_on_vllm_a_sessions_calls_sent_at_once_are_one_vllm_call_each_as_alone(
    smol32: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A LoRA session on vLLM: its calls sent at once run as ONE `generate` of the shared engine (they ran one by
    one before), each reply what the call gets alone; in a cohort beside another session's call, one call too."""
    from plexrl.engines import vllm_engine
    from plexrl.sessions.spec import SessionConfig, prepare_session

    def vllm_spec(name: str) -> Any:
        model = {"path": str(smol32), "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}
        tracking = {"mlflow": False, "progress": False, "log_model": False}
        cfg = SessionConfig(name=name, seed=3, run_dir=str(tmp_path), model=model, tracking=tracking, engine="vllm")  # type: ignore[arg-type]
        return prepare_session(cfg)

    svc = Service("s0", spill_dir=tmp_path / "spill", validate=True)
    try:
        for i, j in enumerate(("a", "b")):
            svc.load_job(vllm_spec(j))
            perturb(svc, j, i)
        sizes: list[int] = []  # the calls each vLLM `generate` served
        real = vllm_engine.SharedLLM.generate_calls

        def counted(llm: Any, calls: Any, loras: Any = None) -> Any:
            sizes.append(len(calls))
            return real(llm, calls, loras)

        monkeypatch.setattr(vllm_engine.SharedLLM, "generate_calls", counted)
        alone = [call(svc, "a", k, c)["value"] for k, c in enumerate(MINE)]
        b_alone = call(svc, "b", 0, CALLS["b"])["value"]
        assert sizes == [1, 1, 1, 1]
        together = call(svc, "a", 5, Samples(MINE))
        assert sizes[4:] == [3] and together["metrics"]["bundled_calls"] == 3.0
        for got, want in zip(together["value"]["replies"], alone, strict=True):
            assert got["error"] is None and got["metrics"]["call_sessions"] == 1.0
            same(got["value"], want)
        members = [Member("a", 6, "sample", {}, Samples(MINE)), Member("b", 1, "sample", {}, CALLS["b"])]
        a, b = (unpack(r.report.reply) for r in run_cohort(svc, members, (), ()))
        assert sizes[5:] == [4]  # a's three calls and b's in one vLLM call
        same(b["value"], b_alone)
        for got, want in zip(a["value"]["replies"], alone, strict=True):
            assert got["metrics"]["call_sessions"] == 2.0
            same(got["value"], want)
    finally:
        svc.close()
