"""Several LoRA sessions' forward_backward calls in ONE training pass (`plexrl/sessions/training.py`,
`stacked_lora.grouped`): on a real `Service` (a cohort, `services.batched.run_cohort`), each session's
accumulated LoRA gradients, its datums' log-probs and its loss sum equal those of its call alone (float
tolerance), for cross_entropy and importance_sampling, with sessions of other ranks and target modules; a
refused call gets its error while the others run; `forward` adds no gradient; the planner cohorts a session's
calls with calls of their own kind only. Tiny Llama, real SmolLM2 tokenizer, CPU, fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Clock, count_calls
from test_session_engine import call

from plexrl.planner import CallArrived, JobPlan, JobSubmitted, NodeFinished, NodePlan, Planner, RunNode, ServiceJoined
from plexrl.services.batched import Member, run_cohort
from plexrl.services.service import Service
from plexrl.sessions import training
from plexrl.sessions.calls import Datum, ForwardBackward, OptimStep, unpack
from plexrl.sessions.spec import SessionConfig, prepare_session

# per session its LoRA (other ranks, other target modules: a layer without c's adapter, one without a's)
LORAS = {
    "a": {"r": 4, "target_modules": ["q_proj", "v_proj", "lm_head"]},
    "b": {"r": 4, "target_modules": ["q_proj", "v_proj", "lm_head"]},
    "c": {"r": 8, "target_modules": ["q_proj", "k_proj", "up_proj"]},
}


ON_ACCELERATORS = training.ONE_PASS_DEVICES  # (the default: one pass only where it pays)


@pytest.fixture(autouse=True)
def one_pass_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass itself is what these tests check, so it runs on this CPU too."""
    monkeypatch.setattr(training, "ONE_PASS_DEVICES", ON_ACCELERATORS | {"cpu"})


def spec(model_dir: Path, name: str, tmp: Path) -> Any:
    model = {"path": str(model_dir), "lora": LORAS[name]}
    tracking = {"mlflow": False, "progress": False, "log_model": False}
    cfg = SessionConfig(name=name, seed=3, run_dir=str(tmp), model=model, tracking=tracking)  # type: ignore[arg-type]
    return prepare_session(cfg)


@pytest.fixture
def service(tmp_path: Path, smol_tiny: Path) -> Any:
    svc = Service("s0", spill_dir=tmp_path / "spill", validate=True)
    for i, j in enumerate(LORAS):
        svc.load_job(spec(smol_tiny, j, tmp_path))
        gen = torch.Generator().manual_seed(i)  # another adapter per session (a fresh one's B is zero)
        with torch.no_grad():
            for p in svc.engines[j].trainable().values():
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    yield svc
    svc.close()


def datum(rng: np.random.Generator, n: int, loss: str) -> Datum:
    tokens = rng.integers(1, 40000, n).astype(np.int64)
    target = np.roll(tokens, -1)
    if loss == "cross_entropy":
        return Datum(tokens, {"target_tokens": target, "weights": rng.uniform(0, 1, n).astype("f4")})
    return Datum(tokens, {"target_tokens": target, "logprobs": rng.uniform(-12, -9, n).astype("f4"),
                          "advantages": rng.normal(0, 1, n).astype("f4")})  # fmt: skip


def calls(loss: str, seed: int, backward: bool = True) -> dict[str, ForwardBackward]:
    """A call per session: other datum counts and lengths."""
    rng = np.random.default_rng(seed)
    sizes = {"a": [5, 9, 3], "b": [7], "c": [4, 12]}
    return {j: ForwardBackward(tuple(datum(rng, n, loss) for n in ns), loss, backward=backward)
            for j, ns in sizes.items()}  # fmt: skip


def cohort(svc: Service, todo: dict[str, Any], it: int) -> dict[str, dict[str, Any]]:
    kind = next(iter(todo.values())).kind
    results = run_cohort(svc, [Member(j, it, kind, {}, c) for j, c in todo.items()], (), ())
    out = {}
    for j, res in zip(todo, results, strict=True):
        assert res.report.ok, res.report.error
        out[j] = unpack(res.report.reply)
    return out


def grads(svc: Service, job: str) -> dict[str, torch.Tensor]:
    """The session's accumulated gradients, taken (cleared on the session)."""
    se = svc.engines[job]
    got = {n: g.clone() for n, g in se.grads.items()}
    se.grads = {}
    return got


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal within float noise relative to the tensor's scale (another summation order)."""
    return float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()) + 1e-7


def same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want) and want
    for n in want:
        assert close(got[n], want[n]), (n, (got[n] - want[n]).abs().max(), want[n].abs().max())


@pytest.mark.parametrize("loss", ["cross_entropy", "importance_sampling"])
def test_sessions_forward_backward_in_one_pass_equal_each_alone(
    service: Service, loss: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    todo = calls(loss, 7)
    alone = {j: call(service, j, 0, c) for j, c in todo.items()}
    alone_grads = {j: grads(service, j) for j in todo}
    passes = count_calls(monkeypatch, training, "_together")
    together = cohort(service, todo, 1)
    assert passes == [3]  # ONE pass served the three sessions
    for j in todo:
        got, want = together[j], alone[j]
        assert got["error"] is None and got["metrics"]["call_sessions"] == 3.0
        assert np.isclose(got["value"]["metrics"]["loss:sum"], want["value"]["metrics"]["loss:sum"], rtol=1e-5)
        for g, w in zip(got["value"]["outputs"], want["value"]["outputs"], strict=True):
            assert np.allclose(g["logprobs"], w["logprobs"], atol=1e-5)
        same_grads(grads(service, j), alone_grads[j])
    # the adapters differ: a's call under b's adapter gives other log-probs and another loss
    swapped = cohort(service, {"a": todo["b"], "b": todo["a"]}, 2)
    assert not np.isclose(swapped["b"]["value"]["metrics"]["loss:sum"], alone["a"]["value"]["metrics"]["loss:sum"])


def test_a_pass_adds_to_accumulated_gradients_and_leaves_the_adapters_as_they_were(service: Service) -> None:
    """Gradients accumulate across a call alone and a pass as across two calls alone; afterwards only the active
    adapter is trainable again (peft's rule) and each session's optim_step applies its own gradients."""
    first, second = calls("cross_entropy", 1), calls("cross_entropy", 2)
    for j in first:
        call(service, j, 0, first[j])
        call(service, j, 1, second[j])
    want = {j: grads(service, j) for j in first}
    flags = {j: [p.requires_grad for p in service.engines[j].trainable().values()] for j in first}
    for j in first:
        call(service, j, 2, first[j])
    cohort(service, second, 3)
    assert {j: [p.requires_grad for p in service.engines[j].trainable().values()] for j in first} == flags
    for j in first:
        assert all(p.grad is None for p in service.engines[j].trainable().values())
        assert service.engines[j].grads and all(close(service.engines[j].grads[n], g) for n, g in want[j].items())
        before = {n: p.detach().clone() for n, p in service.engines[j].trainable().items()}
        assert call(service, j, 4, OptimStep(learning_rate=0.1))["error"] is None
        after = service.engines[j].trainable()
        assert all(not torch.equal(before[n], after[n]) for n in want[j])


def test_a_refused_call_and_forward_only_calls(service: Service) -> None:
    todo = calls("importance_sampling", 3)
    bad = ForwardBackward((Datum(np.array([1, 10**6]), {"target_tokens": np.array([1, 2])}),), "cross_entropy")
    alone_b = call(service, "b", 0, todo["b"])
    b_grads = grads(service, "b")
    got = cohort(service, {"a": bad, "b": todo["b"], "c": todo["c"]}, 1)
    assert "datum 0" in got["a"]["error"] and not service.engines["a"].grads
    assert got["b"]["metrics"]["call_sessions"] == 2.0
    assert np.isclose(got["b"]["value"]["metrics"]["loss:sum"], alone_b["value"]["metrics"]["loss:sum"], rtol=1e-5)
    same_grads(grads(service, "b"), b_grads)
    grads(service, "c")
    forward = calls("cross_entropy", 4, backward=False)
    alone = {j: call(service, j, 2, c) for j, c in forward.items()}
    both = cohort(service, forward, 3)
    for j in forward:
        assert not service.engines[j].grads and both[j]["metrics"]["call_sessions"] == 3.0
        for g, w in zip(both[j]["value"]["outputs"], alone[j]["value"]["outputs"], strict=True):
            assert np.allclose(g["logprobs"], w["logprobs"], atol=1e-5)


def test_on_a_cpu_a_cohorts_calls_run_one_after_another_each_as_alone(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default one pass is for accelerators only (on a CPU it cost each session more than its call alone):
    here the cohort's calls run each alone, with the results and gradients of each call alone."""
    assert "cpu" not in ON_ACCELERATORS and "cuda" in ON_ACCELERATORS
    monkeypatch.setattr(training, "ONE_PASS_DEVICES", ON_ACCELERATORS)
    todo = calls("importance_sampling", 5)
    alone = {j: call(service, j, 0, c) for j, c in todo.items()}
    alone_grads = {j: grads(service, j) for j in todo}
    passes = count_calls(monkeypatch, training, "_together")
    together = cohort(service, todo, 1)
    assert passes == []
    for j in todo:
        assert together[j]["error"] is None and together[j]["metrics"].get("call_sessions", 1.0) == 1.0
        assert together[j]["value"]["metrics"]["loss:sum"] == alone[j]["value"]["metrics"]["loss:sum"]
        same_grads(grads(service, j), alone_grads[j])


def test_the_planner_cohorts_a_sessions_calls_with_calls_of_their_kind_only() -> None:
    """Pure: a's optim_step holds the service; b's and c's forward_backward and d's and e's sample calls queue;
    they go as two cohorts, one per kind."""
    kinds = ("forward_backward", "sample", "optim_step")
    nodes = {k: NodePlan("service", batchable=k != "optim_step") for k in kinds}
    p = Planner(clock=Clock(), validate=True, batch_rollouts=True)
    p.handle(ServiceJoined("s0"))
    for j in "abcde":
        p.handle(JobSubmitted(j, JobPlan(nodes, 10**9, kinds, open=True, engine=("base", 10), batch=8, state_bytes=1)))
    assert [i.job_id for i in p.handle(CallArrived("a", "optim_step")) if isinstance(i, RunNode)] == ["a"]
    for j, kind in zip("bdce", ("forward_backward", "sample", "forward_backward", "sample"), strict=True):
        assert not [i for i in p.handle(CallArrived(j, kind)) if isinstance(i, RunNode)]
    (first,) = [i for i in p.handle(NodeFinished("a", 0, "optim_step", duration=1.0)) if isinstance(i, RunNode)]
    members = {(first.job_id, first.node), *((k[0], k[2]) for k in first.cohort)}
    assert members == {("b", "forward_backward"), ("c", "forward_backward")}
    assert not [i for i in p.handle(NodeFinished("b", 0, "forward_backward", duration=0.5)) if isinstance(i, RunNode)]
    (second,) = [i for i in p.handle(NodeFinished("c", 0, "forward_backward", duration=0.5)) if isinstance(i, RunNode)]
    assert {(second.job_id, second.node), *((k[0], k[2]) for k in second.cohort)} == {("d", "sample"), ("e", "sample")}
    assert p.counts()["cohorts_sent"] == 2
