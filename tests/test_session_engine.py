"""A session's engine on its service (`plexrl/sessions/engine.py`), on a real `Service` with a tiny Llama and the
real SmolLM2 tokenizer: gradients outlive a call and move with the state between tiers; a batch split into
forward passes has the whole batch's gradients; a snapshot samples what was sampled when it was saved; a
saved state loads into another session; a refused call changes nothing; full fine-tuning works the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from plexrl.planner.state import Move
from plexrl.services.service import Service
from plexrl.sessions import engine as session_engine
from plexrl.sessions.calls import Datum, ForwardBackward, Load, OptimStep, Sample, Save, unpack
from plexrl.sessions.spec import SessionConfig, prepare_session


def spec(model_dir: Path, name: str, tmp: Path, lora: bool = True) -> Any:
    model: dict[str, Any] = {"path": str(model_dir)}
    if lora:
        model["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj", "lm_head"]}
    tracking = {"mlflow": False, "progress": False, "log_model": False}
    return prepare_session(SessionConfig(name=name, seed=3, run_dir=str(tmp), model=model, tracking=tracking))  # type: ignore[arg-type]


def datum(tokens: list[int], weight: float = 1.0) -> Datum:
    targets = np.array([*tokens[1:], tokens[0]], dtype=np.int64)
    return Datum(
        np.array(tokens, dtype=np.int64), {"target_tokens": targets, "weights": np.full(len(tokens), weight, "f4")}
    )


def call(svc: Service, job: str, it: int, c: Any) -> dict[str, Any]:
    res = svc.run_node(job, it, c.kind, {}, call=c)
    assert res.report.ok, res.report.error
    assert res.report.reply is not None
    # what a Dask worker's event carries: msgpack (numpy arrays would not pass; lists may come back as tuples)
    carried = msgpack.unpackb(msgpack.packb(res.report.reply), use_list=False)
    reply: dict[str, Any] = unpack(carried)
    return reply


@pytest.fixture
def service(tmp_path: Path) -> Any:
    svc = Service("s0", spill_dir=tmp_path / "spill", validate=True)
    yield svc
    svc.close()


def test_gradients_outlive_a_call_and_move_with_the_state(service: Service, smol_tiny: Path, tmp_path: Path) -> None:
    a, b = spec(smol_tiny, "a", tmp_path), spec(smol_tiny, "b", tmp_path)
    for s in (a, b):
        service.load_job(s)
    data = (datum([1, 5, 9, 13]), datum([2, 4, 6]))
    # a: one call; b: the same data in two calls, its state moved to disk and back between them
    call(service, "a", 0, ForwardBackward(data, "cross_entropy"))
    call(service, "b", 0, ForwardBackward(data[:1], "cross_entropy"))
    service.apply([Move("b", "device", "host", 0), Move("b", "host", "disk", 0)])
    assert any(k.startswith("session_grad.") for k in service.engines["b"].state_tensors())
    service.apply([Move("b", "disk", "host", 0), Move("b", "host", "device", 0)])
    call(service, "b", 1, ForwardBackward(data[1:], "cross_entropy"))
    norms = [call(service, j, 2, OptimStep(learning_rate=0.05))["value"]["metrics"]["grad_norm"] for j in "ab"]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    after = [call(service, j, 3, ForwardBackward(data, "cross_entropy", backward=False)) for j in "ab"]
    assert after[0]["value"]["metrics"]["loss:sum"] == pytest.approx(after[1]["value"]["metrics"]["loss:sum"], rel=1e-5)


def test_a_batch_in_several_forward_passes_has_the_gradients_of_one(
    service: Service, smol_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service.load_job(spec(smol_tiny, "a", tmp_path))
    engine = service.engines["a"]
    data = tuple(datum([1 + i, 7, 9 + i, 11, 3]) for i in range(4))
    whole = call(service, "a", 0, ForwardBackward(data, "cross_entropy"))
    grads = {k: g.clone() for k, g in engine.grads.items()}
    engine.grads = {}
    monkeypatch.setattr(session_engine, "MAX_FORWARD_TOKENS", 10)  # two datums a pass
    split = call(service, "a", 1, ForwardBackward(data, "cross_entropy"))
    assert split["value"]["metrics"]["loss:sum"] == pytest.approx(whole["value"]["metrics"]["loss:sum"], rel=1e-6)
    for k, g in grads.items():
        assert torch.allclose(engine.grads[k], g, rtol=1e-4, atol=1e-5)  # (only the order of the sums differs)
    lps = [o["logprobs"] for o in split["value"]["outputs"]]
    assert all(
        np.allclose(a, b, atol=1e-6)
        for a, b in zip(lps, [o["logprobs"] for o in whole["value"]["outputs"]], strict=True)
    )


def test_a_refused_call_changes_nothing(service: Service, smol_tiny: Path, tmp_path: Path) -> None:
    service.load_job(spec(smol_tiny, "a", tmp_path))
    before = {k: t.clone() for k, t in service.engines["a"].state_tensors().items()}
    reply = call(service, "a", 0, OptimStep(learning_rate=1.0))
    assert "no gradient to apply" in reply["error"]
    bad = Datum(np.array([1, 2], np.int64), {"target_tokens": np.array([1, 10**6], np.int64)})
    assert "target_tokens must be token ids" in call(service, "a", 1, ForwardBackward((bad,), "cross_entropy"))["error"]
    now = service.engines["a"].state_tensors()
    assert set(now) == set(before) and all(torch.equal(now[k], before[k]) for k in before)


def test_a_snapshot_samples_what_was_sampled_when_it_was_saved(
    service: Service, smol_tiny: Path, tmp_path: Path
) -> None:
    service.load_job(spec(smol_tiny, "a", tmp_path))
    snap = call(service, "a", 0, Save(str(tmp_path / "snap.safetensors"), "sampler"))["value"]
    ask = Sample((1, 2, 3), num_samples=3, max_tokens=6, seed=11, prompt_logprobs=True)
    then = call(service, "a", 1, ask)["value"]
    call(service, "a", 2, ForwardBackward((datum([1, 2, 3, 4, 5]),), "cross_entropy"))
    call(service, "a", 3, OptimStep(learning_rate=0.5))
    live = call(service, "a", 4, ask)["value"]
    old = call(service, "a", 5, _with(ask, snap))["value"]
    assert [s["tokens"].tolist() for s in old["sequences"]] == [s["tokens"].tolist() for s in then["sequences"]]
    assert np.allclose(old["prompt_logprobs"][1:], then["prompt_logprobs"][1:])
    assert not np.allclose(live["prompt_logprobs"][1:], then["prompt_logprobs"][1:])
    again = call(service, "a", 6, ask)["value"]  # the live weights are back
    assert np.allclose(again["prompt_logprobs"][1:], live["prompt_logprobs"][1:])


def _with(ask: Sample, snap: dict[str, Any]) -> Sample:
    import dataclasses

    return dataclasses.replace(ask, weights=snap["path"], weights_id=snap["weights_id"])


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_saved_state_loads_into_another_session(
    service: Service, smol_tiny: Path, tmp_path: Path, lora: bool
) -> None:
    a, b = spec(smol_tiny, "a", tmp_path, lora), spec(smol_tiny, "b", tmp_path, lora)
    service.load_job(a)
    data = (datum([3, 1, 4, 1, 5]),)
    call(service, "a", 0, ForwardBackward(data, "cross_entropy"))
    call(service, "a", 1, OptimStep(learning_rate=0.01))
    call(service, "a", 2, Save(str(tmp_path / "a.pt"), "state"))
    service.load_job(b)
    call(service, "b", 0, Load(str(tmp_path / "a.pt"), optimizer=True))
    for j in "ab":  # the same next step: weights and Adam moments both came over
        call(service, j, 3, ForwardBackward(data, "cross_entropy"))
    steps = [call(service, j, 4, OptimStep(learning_rate=0.01))["value"]["metrics"]["grad_norm"] for j in "ab"]
    assert steps[0] == pytest.approx(steps[1], rel=1e-6)
    losses = [call(service, j, 5, ForwardBackward(data, "cross_entropy", backward=False)) for j in "ab"]
    assert losses[0]["value"]["metrics"] == losses[1]["value"]["metrics"]
