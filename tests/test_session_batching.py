"""Many sessions, one engine call (`plexrl/sessions/sampling.py`, `plexrl/engines/mixed.py`): sample calls of
several LoRA sessions over one base that wait on one service together run as ONE engine call, each row under its
own session's adapter, and each session gets what it gets alone: the same tokens, log-probs equal within float
noise (another batch composition), its own seed and sampling parameters, its own sampler snapshot; a refused
call gets its error while the others run. On a real `Service` (a cohort, `services.batched.run_cohort`), and
end to end through a `Runner` whose planner cohorts queued `sample` nodes (`batch_rollouts`), with the sessions'
calls on a `CallBoard` as the server sends them. Tiny Llama, real SmolLM2 tokenizer, CPU, fp32."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Clock, count_calls
from test_session_engine import call, datum, spec

from plexrl.planner import (
    CallArrived,
    JobPlan,
    JobSubmitted,
    NodeFinished,
    NodePlan,
    Planner,
    RunNode,
    ServiceJoined,
    Tick,
)
from plexrl.services.batched import Member, run_cohort
from plexrl.services.service import Service
from plexrl.sessions import sampling
from plexrl.sessions.calls import ForwardBackward, OptimStep, Sample, Save, unpack

SESSIONS = ("a", "b", "c")
CALLS = {  # a call per session: other prompts, sizes, seeds and sampling parameters
    "a": Sample((1, 2, 3), num_samples=3, max_tokens=7, seed=11, prompt_logprobs=True),
    "b": Sample((5, 9, 2, 8, 13, 4), num_samples=2, max_tokens=5, seed=12, top_k=40, top_p=0.9),
    "c": Sample((7,), num_samples=1, max_tokens=6, seed=13, temperature=0.0),
}


def perturb(svc: Service, job: str, seed: int) -> None:
    """Another adapter per session (a fresh one equals the base: its B is zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in svc.engines[job].trainable().values():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)


def same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Same tokens and stop reasons, log-probs within float noise, same prompt log-probs."""
    assert len(got["sequences"]) == len(want["sequences"])
    for g, w in zip(got["sequences"], want["sequences"], strict=True):
        assert g["tokens"].tolist() == w["tokens"].tolist() and g["stop_reason"] == w["stop_reason"]
        assert np.allclose(g["logprobs"], w["logprobs"], atol=1e-4), (g["logprobs"], w["logprobs"])
    if want["prompt_logprobs"] is not None:
        assert np.allclose(got["prompt_logprobs"][1:], want["prompt_logprobs"][1:], atol=1e-5)


@pytest.fixture
def service(tmp_path: Path, smol_tiny: Path) -> Any:
    svc = Service("s0", spill_dir=tmp_path / "spill", validate=True)
    for i, j in enumerate(SESSIONS):
        svc.load_job(spec(smol_tiny, j, tmp_path))
        perturb(svc, j, i)
    yield svc
    svc.close()


def cohort(svc: Service, calls: dict[str, Sample], it: int) -> dict[str, dict[str, Any]]:
    results = run_cohort(svc, [Member(j, it, "sample", {}, c) for j, c in calls.items()], (), ())
    out = {}
    for j, res in zip(calls, results, strict=True):
        assert res.report.ok, res.report.error
        out[j] = unpack(res.report.reply)
    return out


def test_sessions_samples_in_one_engine_call_equal_each_alone(
    service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = {j: call(service, j, 0, c) for j, c in CALLS.items()}
    assert all(r["metrics"]["call_sessions"] == 1.0 for r in alone.values())
    from plexrl.engines import mixed

    engine_calls = count_calls(monkeypatch, mixed, "generate_mixed")
    together = cohort(service, CALLS, 1)
    assert engine_calls == [3]  # ONE engine call served the three sessions
    for j in SESSIONS:
        assert together[j]["error"] is None and together[j]["metrics"]["call_sessions"] == 3.0
        same(together[j]["value"], alone[j]["value"])
    # the adapters differ: the same call under another session's adapter samples something else
    swapped = cohort(service, {"a": CALLS["b"], "b": CALLS["a"]}, 2)
    assert (
        swapped["a"]["value"]["sequences"][0]["logprobs"].tolist()
        != alone["b"]["value"]["sequences"][0]["logprobs"].tolist()
    )


def test_the_stacked_forward_equals_peft_mixed_adapter_forward(service: Service) -> None:
    """`stacked_lora.stacked` (a fixed number of ops per LoRA layer) gives each row what peft's mixed-adapter
    forward gives it (within float noise), rows of the three adapters interleaved; peft's own forwards come back
    afterwards."""
    from plexrl.engines.stacked_lora import stacked

    inner = [service.engines[j].inner for j in SESSIONS]
    model, names = inner[0].shared.model, [e.adapter for e in inner]
    rows = [2, 0, 1, 1, 2]  # the adapter of each row
    ids = torch.tensor([[5, 9, 2], [1, 2, 3], [7, 7, 1], [4, 8, 15], [16, 23, 42]])
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids, adapter_names=[names[r] for r in rows]).logits
        with stacked(model, names) as select:
            assert select is not None
            select(rows)
            got = model(input_ids=ids).logits
        again = model(input_ids=ids, adapter_names=[names[r] for r in rows]).logits
        alone = model(input_ids=ids, adapter_names=[names[0]] * len(rows)).logits
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert torch.equal(again, want)  # (the patched forwards are gone)
    assert not torch.allclose(alone, want, atol=1e-3)  # (the adapters differ: each row's is really used)


def test_a_snapshot_and_a_refused_call_in_one_engine_call(service: Service, tmp_path: Path) -> None:
    snap = call(service, "b", 0, Save(str(tmp_path / "b.safetensors"), "sampler"))["value"]
    then = call(service, "b", 1, CALLS["b"])["value"]
    call(service, "b", 2, ForwardBackward((datum([1, 2, 3, 4, 5]),), "cross_entropy"))
    call(service, "b", 3, OptimStep(learning_rate=0.5))  # the live weights move on
    old = dataclasses.replace(CALLS["b"], weights=snap["path"], weights_id=snap["weights_id"])
    bad = Sample((10**6,), num_samples=1, max_tokens=3, seed=1)
    a_alone = call(service, "a", 4, CALLS["a"])["value"]
    got = cohort(service, {"a": CALLS["a"], "b": old, "c": bad}, 5)
    assert "the prompt must be a non-empty list of token ids" in got["c"]["error"]
    same(got["b"]["value"], then)  # the snapshot's weights served b's rows
    same(got["a"]["value"], a_alone)
    assert got["a"]["metrics"]["call_sessions"] == 2.0
    live = call(service, "b", 6, CALLS["b"])["value"]  # b's live weights are back
    assert live["sequences"][0]["logprobs"].tolist() != then["sequences"][0]["logprobs"].tolist()


def test_a_lora_sessions_plan_marks_its_batched_kinds(smol_tiny: Path, tmp_path: Path) -> None:
    plan = spec(smol_tiny, "a", tmp_path).plan()
    assert sorted(n for n, p in plan.nodes.items() if p.batchable) == ["forward", "forward_backward", "sample"]
    assert plan.batch == sampling.MIXED_SESSIONS and plan.engine is not None
    assert spec(smol_tiny, "f", tmp_path, lora=False).plan().batch == 0  # a full fine-tune samples alone


def test_the_planner_cohorts_sample_calls_queued_together() -> None:
    """Pure: a's forward_backward holds the service; b's and c's sample calls queue; both go in one cohort."""
    nodes = {k: NodePlan("service", batchable=k == "sample") for k in ("forward_backward", "sample")}

    def session() -> JobPlan:
        return JobPlan(nodes, 10**9, tuple(nodes), open=True, engine=("base", 10), batch=8, state_bytes=1)

    p = Planner(clock=Clock(), validate=True, batch_rollouts=True)
    p.handle(ServiceJoined("s0"))
    for j in "abc":
        p.handle(JobSubmitted(j, session()))
    assert [i.job_id for i in p.handle(CallArrived("a", "forward_backward")) if isinstance(i, RunNode)] == ["a"]
    for j in "bc":
        assert not [i for i in p.handle(CallArrived(j, "sample")) if isinstance(i, RunNode)]
    (nxt,) = [i for i in p.handle(NodeFinished("a", 0, "forward_backward", duration=1.0)) if isinstance(i, RunNode)]
    assert {(nxt.job_id, nxt.iteration, nxt.node), *nxt.cohort} == {("b", 0, "sample"), ("c", 0, "sample")}
    assert p.counts()["cohorts_sent"] == 1


def sessions_planner(window: float, bases: dict[str, str]) -> tuple[Planner, Clock]:
    """A planner with `batch_window` and one LoRA session per job of `bases` (job -> its base), all placed on s0
    and idle (no call yet)."""
    nodes = {k: NodePlan("service", batchable=k == "sample") for k in ("forward_backward", "sample")}
    clock = Clock()
    p = Planner(clock=clock, validate=True, batch_rollouts=True, batch_window=window)
    p.handle(ServiceJoined("s0"))
    for j, base in bases.items():
        plan = JobPlan(nodes, 10**9, tuple(nodes), open=True, engine=(base, 10), batch=8, state_bytes=1)
        p.handle(JobSubmitted(j, plan))
    return p, clock


def sent(instructions: list[Any]) -> set[tuple[str, int, str]]:
    """The nodes the instructions run (each RunNode's and its cohort's)."""
    return {k for i in instructions if isinstance(i, RunNode) for k in ((i.job_id, i.iteration, i.node), *i.cohort)}


def test_a_sample_call_alone_on_its_base_never_waits() -> None:
    p, _ = sessions_planner(0.5, {"a": "base", "f": "other base"})  # (f: an idle session of another base)
    assert sent(p.handle(CallArrived("a", "sample"))) == {("a", 0, "sample")}
    assert p.wake_at is None and p.counts()["partner_waits"] == 0


def test_a_sample_call_waits_for_idle_partners_until_they_all_came() -> None:
    """On an idle service a's sample call waits (the window) while b and c, of its base, sit idle between calls;
    once both sent theirs, the three run as ONE cohort at once, before the window ends."""
    p, clock = sessions_planner(0.5, {"a": "base", "b": "base", "c": "base"})
    assert not sent(p.handle(CallArrived("a", "sample")))
    assert p.wake_at == 0.5  # a's ready time + the window
    clock.t = 0.1
    assert not sent(p.handle(CallArrived("b", "sample")))  # c is still idle: a and b wait on
    assert p.wake_at == 0.5  # (from the first member's ready time, not pushed back)
    clock.t = 0.2
    assert sent(p.handle(CallArrived("c", "sample"))) == {(j, 0, "sample") for j in "abc"}
    assert p.wake_at is None
    assert p.counts()["partner_waits"] == 1 and p.counts()["cohorts_sent"] == 1


def test_the_wait_for_partners_is_bounded_by_the_window() -> None:
    """b never sends a call: a's sample runs alone when the window ends (the planner's Tick), not before."""
    p, clock = sessions_planner(0.5, {"a": "base", "b": "base"})
    assert not sent(p.handle(CallArrived("a", "sample")))
    clock.t = 0.3
    assert not sent(p.handle(Tick()))
    clock.t = 0.5
    assert sent(p.handle(Tick())) == {("a", 0, "sample")}
    assert p.wake_at is None and p.counts()["cohorts_sent"] == 0


def test_other_work_ends_the_wait_for_partners() -> None:
    """a's sample waits for idle b; b's forward_backward comes instead: the service runs one of them at once (it
    never idles while other work could run). If that was b's, a waits on for b, the window from when the service
    freed."""
    p, clock = sessions_planner(0.5, {"a": "base", "b": "base"})
    assert not sent(p.handle(CallArrived("a", "sample")))
    clock.t = 0.1
    first = sent(p.handle(CallArrived("b", "forward_backward")))
    assert len(first) == 1 and p.wake_at is None
    clock.t = 0.2
    if first == {("a", 0, "sample")}:  # the ordering took a's sample: b's forward_backward follows
        assert sent(p.handle(NodeFinished("a", 0, "sample", duration=0.1))) == {("b", 0, "forward_backward")}
    else:  # it took b's: b is idle again, so a's sample waits on, until the service freed + the window
        assert not sent(p.handle(NodeFinished("b", 0, "forward_backward", duration=0.1)))
        assert p.wake_at == 0.7
        clock.t = 0.7
        assert sent(p.handle(Tick())) == {("a", 0, "sample")}


def test_the_wait_for_partners_counts_from_when_the_service_freed() -> None:
    """a's sample call queues behind b's forward_backward; when that ends, b is idle and may sample next: a waits
    the window from then (a call that waited behind other work is no reason to start without its partners)."""
    p, clock = sessions_planner(0.5, {"a": "base", "b": "base"})
    assert sent(p.handle(CallArrived("b", "forward_backward"))) == {("b", 0, "forward_backward")}
    clock.t = 0.1
    assert not sent(p.handle(CallArrived("a", "sample")))
    clock.t = 1.0
    assert not sent(p.handle(NodeFinished("b", 0, "forward_backward", duration=1.0)))
    assert p.wake_at == 1.5
    assert sent(p.handle(CallArrived("b", "sample"))) == {("a", 0, "sample"), ("b", 1, "sample")}


def test_a_partner_whose_client_never_samples_next_is_not_waited_for() -> None:
    """b's client has sent forward_backward after forward_backward only: idle after one, b is not waited for.
    Once it was seen to sample after a forward_backward, it is."""
    p, clock = sessions_planner(0.5, {"a": "base", "b": "base"})
    for it, kind in enumerate(("forward_backward", "forward_backward")):
        p.handle(CallArrived("b", kind))
        p.handle(NodeFinished("b", it, kind, duration=0.1))
    assert sent(p.handle(CallArrived("a", "sample"))) == {("a", 0, "sample")}  # at once: no wait
    p.handle(NodeFinished("a", 0, "sample", duration=0.1))
    assert not sent(p.handle(CallArrived("b", "sample")))  # b samples after a forward_backward (a: no history yet)
    clock.t = 0.5
    assert sent(p.handle(Tick())) == {("b", 2, "sample")}
    p.handle(NodeFinished("b", 2, "sample", duration=0.1))
    p.handle(CallArrived("b", "forward_backward"))
    p.handle(NodeFinished("b", 3, "forward_backward", duration=0.1))
    clock.t = 1.0
    assert not sent(p.handle(CallArrived("a", "sample")))  # b may sample next: a waits (bounded)
    assert p.wake_at == 1.5


def loops(phase_window: float, rounds: int = 6, users: str = "", both: bool = False, first: str = "sss") -> list[int]:
    """Pure: three LoRA sessions of one base, each a client loop sample -> forward_backward -> sample ...
    sending its next call the moment the last one ends; a sample call (alone or as a cohort) takes 0.1 s, a
    forward_backward 1.0 s, the ordering is the server's (HRRS: short calls go first). `users`: the sessions'
    users, one letter each ("": all one user's). `both`: forward_backward calls cohort too (one after another
    inside, 1.0 s each, all replied at the cohort's end: a CPU's). `first`: each session's first call (s: sample,
    f: forward_backward). The sizes of the sample cohorts sent, in order."""
    from plexrl.planner.policies import Hrrs

    nodes = {k: NodePlan("service", batchable=both or k == "sample") for k in ("forward_backward", "sample")}
    clock = Clock()
    p = Planner(clock=clock, ordering=Hrrs(), validate=True, batch_rollouts=True, batch_window=0.05,
                phase_window=phase_window)  # fmt: skip
    p.handle(ServiceJoined("s0"))
    for i, j in enumerate("abc"):
        p.handle(JobSubmitted(j, JobPlan(nodes, 10**9, tuple(nodes), open=True, engine=("base", 10), batch=8,
                                         state_bytes=1, user=users[i] if users else "")))  # fmt: skip
    ends: list[tuple[float, str, int, str]] = []  # (when, job, iteration, node) of what runs
    sizes: list[int] = []

    def take(instructions: list[Any]) -> None:
        for i in instructions:
            if isinstance(i, RunNode):
                members = [(i.job_id, i.iteration, i.node), *i.cohort]
                sizes.extend([len(members)] if i.node == "sample" else [])
                end = clock.t + (0.1 if i.node == "sample" else 1.0 * len(members))
                ends.extend((end, *m) for m in members)

    for j, kind in zip("abc", first, strict=True):
        take(p.handle(CallArrived(j, "sample" if kind == "s" else "forward_backward")))
    while len(sizes) < rounds * 3 and (ends or p.wake_at is not None):
        if not ends:  # the service waits for partners: the window's end
            clock.t = p.wake_at
            take(p.handle(Tick()))
            continue
        ends.sort()
        when, job, it, node = ends.pop(0)
        clock.t = when
        take(p.handle(NodeFinished(job, it, node, duration=1.0 if node == "forward_backward" else 0.1)))
        take(p.handle(CallArrived(job, "sample" if node == "forward_backward" else "forward_backward")))
    return sizes


def test_sessions_keep_in_phase_so_their_samples_stay_one_cohort() -> None:
    """The three sample together first. Without keeping phase they drift apart: the first whose forward_backward
    ends samples at once (a short call goes first), before the others trained, and from then on each samples
    alone. With it, one that comes back first lets its partners' queued forward_backward calls run first (once
    they were seen to sample after one: from the second round), and every later round's three samples run as
    ONE cohort."""
    drift = loops(phase_window=0.0)
    assert drift[0] == 3 and drift.count(1) > len(drift) // 2, drift
    kept = loops(phase_window=10.0)
    assert kept[0] == 3 and kept[2:] == [3] * len(kept[2:]), kept


def test_loops_out_of_step_are_brought_together_when_training_calls_cohort_too() -> None:
    """As on a server (a LoRA session's forward_backward calls cohort too): loops that start in step stay so on
    their own, as a forward_backward cohort replies to all at once; loops that start apart (b samples first, a
    and c train) stay apart without keeping phase, and are brought into one cohort with it: each kind's calls
    wait while partners are busy with the other, and when both kinds are held the ordering's pick goes."""
    assert loops(phase_window=0.0, both=True) == [3] * 18
    apart = loops(phase_window=0.0, both=True, first="fsf")
    assert apart == [1] * len(apart), apart
    kept = loops(phase_window=10.0, both=True, first="fsf")
    assert kept[2:] == [3] * len(kept[2:]), kept


def test_another_users_busy_sessions_never_hold_a_sample_call() -> None:
    """The same loops, each session another user's: no one's busy sessions hold anyone's sample call (a user
    flooding training calls cannot stall another's sampling), so they run as with phase not kept."""
    assert loops(phase_window=10.0, users="xyz") == loops(phase_window=0.0)
    assert loops(phase_window=10.0, users="xxy") != loops(phase_window=0.0)  # (x's two keep phase together)


def test_keeping_phase_is_bounded_by_its_window() -> None:
    """b and d have forward_backward calls queued when c's ends; a's sample call is held, b's runs (1 s), c's
    sample queues. At its end a's and c's have waited past the window (0.5 s): they go, though d's
    forward_backward is still queued and b's client is about to sample."""
    from plexrl.planner.policies import Hrrs

    nodes = {k: NodePlan("service", batchable=k == "sample") for k in ("forward_backward", "sample")}
    clock = Clock()
    p = Planner(clock=clock, ordering=Hrrs(), validate=True, batch_rollouts=True, phase_window=0.5)
    p.handle(ServiceJoined("s0"))
    for j in "abcd":
        p.handle(JobSubmitted(j, JobPlan(nodes, 10**9, tuple(nodes), open=True, engine=("base", 10), batch=8,
                                         state_bytes=1)))  # fmt: skip
    for it, kind in enumerate(("sample", "forward_backward", "sample")):  # each alone: seen to sample after training
        for j in "abcd":
            p.handle(CallArrived(j, kind))
            p.handle(NodeFinished(j, it, kind, duration=1.0 if kind == "forward_backward" else 0.1))
    assert sent(p.handle(CallArrived("c", "forward_backward"))) == {("c", 3, "forward_backward")}
    clock.t = 0.9
    for j in "abd":
        p.handle(CallArrived(j, "sample" if j == "a" else "forward_backward"))
    clock.t = 1.0
    assert sent(p.handle(NodeFinished("c", 3, "forward_backward", duration=1.0))) == {("b", 3, "forward_backward")}
    assert p.counts()["phase_defers"] == 1  # a's sample (b comes back to sampling after its call)
    assert not sent(p.handle(CallArrived("c", "sample")))  # (the service runs b's call)
    clock.t = 2.0  # past the window for a's and c's: they go, though d (which samples next too) has its call queued
    assert sent(p.handle(NodeFinished("b", 3, "forward_backward", duration=1.0))) == {
        ("a", 3, "sample"),
        ("c", 4, "sample"),
    }
    assert ("d", 3) in {(q.job_id, q.iteration) for q in p.services["s0"].queue}


def test_through_a_runner_queued_sample_calls_share_one_engine_call(smol_tiny: Path, tmp_path: Path) -> None:
    """Four sessions on one service; a's forward_backward comes first, b's c's and d's samples queue behind it
    and run as a cohort: each reply equals that call's reply alone on a plain service."""
    from plexrl.runtime import InlineExecutor, Runner
    from plexrl.runtime.calls import CallBoard

    jobs = ("a", "b", "c", "d")
    calls: dict[str, Any] = {"a": ForwardBackward((datum([1, 2, 3, 4]),), "cross_entropy")}
    calls.update({j: dataclasses.replace(CALLS["b"], seed=20 + i) for i, j in enumerate(jobs[1:])})
    board = CallBoard()
    executor = InlineExecutor(services=1, validate=True)
    runner = Runner(executor, Planner(clock=executor.clock, validate=True, batch_rollouts=True), calls=board)
    replies: dict[str, dict[str, Any]] = {}
    errors: dict[str, str | None] = {}
    lock = threading.Lock()

    def done(job: str) -> Any:
        def finish(reply: dict[str, Any] | None, error: str | None) -> None:
            with lock:
                if reply is None:
                    errors[job] = error
                else:
                    replies[job] = unpack(reply)
            runner.close_session(job)

        return finish

    for j in jobs:
        board.open(j)
        board.put(j, calls[j].kind, calls[j], done(j))
    runs = runner.run([spec(smol_tiny, j, tmp_path / "runner") for j in jobs])
    assert [r.status for r in runs] == ["done"] * 4, [r.error for r in runs]
    assert not errors and set(replies) == set(jobs), errors
    assert runner.planner.counts()["cohorts_sent"] >= 1
    shared = [j for j in jobs[1:] if replies[j]["metrics"]["call_sessions"] > 1]
    assert len(shared) >= 2, {j: replies[j]["metrics"] for j in jobs}
    svc = Service("ref", spill_dir=tmp_path / "spill")
    try:
        for j in jobs[1:]:
            svc.load_job(spec(smol_tiny, j, tmp_path / "ref"))
            same(replies[j]["value"], call(svc, j, 0, calls[j])["value"])
    finally:
        svc.close()
