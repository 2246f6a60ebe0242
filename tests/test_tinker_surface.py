"""The rest of the Tinker surface through the unmodified `tinker` SDK against a real `plexrl serve` (torch engine,
the tiny model with the real SmolLM2 tokenizer): the losses `cispo` and `dro` (values checked against the
documented definitions on the log-probs the server returns), sampling with `top_k`, and `topk_prompt_logprobs`
(checked against the model run directly with transformers), with the cap on K; the RestClient's routes; and
`unload_model` (no SDK method sends it: posted raw, its future read through the SDK's own future)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import tinker_served, wait_for

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402
from tinker.types.tensor_data import TensorData  # noqa: E402

from plexrl.server.api import RunningServer  # noqa: E402
from plexrl.server.tinker.decode import MAX_TOPK_LOGPROBS  # noqa: E402

PROMPT = [1, 504, 2330, 314, 253, 1345, 30, 2]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smol_tiny: Path) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("surface")
    with tinker_served(tmp, smol_tiny, cluster={"max_load": 4.0}, tinker={"engine": "torch"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: RunningServer) -> Iterator[Any]:
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-ann")
    yield client
    client.close("success").result()


def rl_datum(seed: int) -> tuple[types.Datum, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    sampled = (rng.normal(size=len(PROMPT)) * 0.5 - 11).astype("f4")  # near the tiny model's ~ -10.8
    adv = rng.normal(size=len(PROMPT)).astype("f4")
    targets = np.array([*PROMPT[1:], PROMPT[0]])
    inputs = {"target_tokens": TensorData.from_numpy(targets), "logprobs": TensorData.from_numpy(sampled),
              "advantages": TensorData.from_numpy(adv)}  # fmt: skip
    return types.Datum(model_input=types.ModelInput.from_ints(PROMPT), loss_fn_inputs=inputs), sampled, adv


def test_cispo_and_dro_compute_the_documented_loss(service: Any, smol_tiny: Path) -> None:
    training = service.create_lora_training_client(base_model=str(smol_tiny), rank=2, seed=1).result()
    datum, sampled, adv = rl_datum(0)
    out = training.forward([datum], "importance_sampling").result()
    lp = np.asarray(out.loss_fn_outputs[0]["logprobs"].to_numpy(), dtype=np.float64)
    ratio = np.exp(lp - sampled)
    assert out.metrics["loss:sum"] == pytest.approx(-(ratio * adv).sum(), rel=1e-4)
    cispo = training.forward([datum], "cispo").result().metrics["loss:sum"]
    assert cispo == pytest.approx(-(np.clip(ratio, 0.8, 1.2) * lp * adv).sum(), rel=1e-4)
    wide = training.forward([datum], "cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}).result()
    assert wide.metrics["loss:sum"] == pytest.approx(-(np.clip(ratio, 0.0, 4.0) * lp * adv).sum(), rel=1e-4)
    dro = training.forward([datum], "dro", {"beta": 0.5}).result().metrics["loss:sum"]
    assert dro == pytest.approx(-(lp * adv - 0.25 * (lp - sampled) ** 2).sum(), rel=1e-4)
    with pytest.raises(tinker.BadRequestError, match="needs loss_fn_config beta"):
        training.forward([datum], "dro").result()
    fb = training.forward_backward([datum], "cispo").result()  # and it trains
    assert fb.metrics["loss:sum"] == pytest.approx(cispo, rel=1e-4)
    assert training.optim_step(types.AdamParams(learning_rate=0.01)).result().metrics["grad_norm"] > 0  # type: ignore[index]


def test_top_k_and_topk_prompt_logprobs_match_the_model_run_directly(service: Any, smol_tiny: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    sampler = service.create_sampling_client(base_model=str(smol_tiny)).result()  # the base itself (zero adapter)
    prompt = types.ModelInput.from_ints(PROMPT)
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, seed=5)).result()
    top1 = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, temperature=1.0, top_k=1, seed=5)).result()
    for seq in top1.sequences:  # one candidate: the greedy tokens, each with probability 1
        assert seq.tokens == greedy.sequences[0].tokens
        assert np.allclose(seq.logprobs, 0.0, atol=1e-5)
    wide = sampler.sample(prompt, 4, types.SamplingParams(max_tokens=6, temperature=1.0, top_k=-1, seed=5)).result()
    assert len({tuple(s.tokens) for s in wide.sequences}) > 1  # (without top_k the random model's samples differ)

    k = 4
    res = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                         topk_prompt_logprobs=k).result()  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(smol_tiny), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), -1).topk(k, -1)
    topk = res.topk_prompt_logprobs
    assert topk is not None and len(topk) == len(PROMPT) and topk[0] is None
    for i in range(1, len(PROMPT)):
        assert [t for t, _ in topk[i]] == ref.indices[i - 1].tolist()
        assert [lp for _, lp in topk[i]] == pytest.approx(ref.values[i - 1].tolist(), abs=1e-4)
        assert res.prompt_logprobs is not None and res.prompt_logprobs[i] <= topk[i][0][1] + 1e-5

    last = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                          topk_prompt_logprobs=2, prompt_logprobs_last_n=3).result()  # fmt: skip
    assert last.topk_prompt_logprobs is not None
    assert [row is None for row in last.topk_prompt_logprobs] == [True] * (len(PROMPT) - 3) + [False] * 3
    with pytest.raises(tinker.BadRequestError, match=f"topk_prompt_logprobs must be 0..{MAX_TOPK_LOGPROBS}"):
        too_many = MAX_TOPK_LOGPROBS + 1
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), topk_prompt_logprobs=too_many).result()


def test_the_rest_client_lists_reads_and_changes_only_its_own_runs_and_checkpoints(
    server: RunningServer, service: Any, smol_tiny: Path
) -> None:
    from plexrl.server.tinker.rest import Runs

    training = service.create_lora_training_client(base_model=str(smol_tiny), rank=2, seed=2).result()
    state = training.save_state("first").result().path
    sampler = training.save_weights_for_sampler("s1").result().path
    rest = tinker.RestClient(base_url=server.url, api_key="tml-ann")
    run_id = training.model_id
    run = rest.get_training_run(run_id).result()
    assert (run.base_model, run.is_lora, run.lora_rank, run.model_owner) == (str(smol_tiny), True, 2, "ann")
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
    assert run_id in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
    listed = {c.tinker_path: c for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert set(listed) >= {state, sampler} and listed[state].checkpoint_type == "training"
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.is_lora, info.lora_rank, info.train_attn, info.train_mlp) == (True, 2, True, True)
    rest.publish_checkpoint_from_tinker_path(state).result()
    rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result()
    now = {c.tinker_path: c for c in rest.list_user_checkpoints().result().checkpoints}[state]
    assert now.public and now.expires_at is not None
    rest.unpublish_checkpoint_from_tinker_path(state).result()

    bob = tinker.RestClient(base_url=server.url, api_key="tml-bob")  # another user: the same 404 as none
    for call in (lambda: bob.get_training_run(run_id), lambda: bob.list_checkpoints(run_id),
                 lambda: bob.delete_checkpoint_from_tinker_path(state),
                 lambda: bob.get_training_run("s0000000000000000:train:1")):  # fmt: skip
        with pytest.raises(tinker.NotFoundError):
            call().result()
    assert run_id not in [r.training_run_id for r in bob.list_training_runs().result().training_runs]

    rest.delete_checkpoint_from_tinker_path(sampler).result()
    assert sampler not in {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    later = Runs(server.sessions, clock=lambda: 4e9)  # past the TTL: the checkpoint is gone when next listed
    assert state not in {c["tinker_path"] for c in later.checkpoints("ann", run_id)["checkpoints"]}


def unload(server: RunningServer, model_id: str, user: str = "ann") -> httpx.Response:
    body = types.UnloadModelRequest(model_id=model_id).model_dump()  # {"model_id", "type": "unload_model"}
    return httpx.post(f"{server.url}/api/v1/unload_model", json=body, headers={"X-API-Key": f"tml-{user}"}, timeout=60)


def unloaded(client: Any, answer: httpx.Response) -> types.UnloadModelResponse:
    """The unload's future, retrieved as the SDK retrieves every future (`retrieve_future`, try_again and all)."""
    from tinker.lib.api_future_impl import _APIFuture

    assert answer.status_code == 200, answer.text
    future = types.UntypedAPIFuture.model_validate(answer.json())
    return _APIFuture(types.UnloadModelResponse, client.holder, future, request_start_time=time.time(),
                      request_type="UnloadModel").result(timeout=60)  # fmt: skip


def test_unload_model_ends_one_models_job_and_the_rest_of_its_session_goes_on(
    server: RunningServer, service: Any, smol_tiny: Path
) -> None:
    one = service.create_lora_training_client(base_model=str(smol_tiny), rank=2, seed=3).result()
    two = service.create_lora_training_client(base_model=str(smol_tiny), rank=2, seed=4).result()
    sampler = service.create_sampling_client(base_model=str(smol_tiny)).result()  # served by a job that only samples
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT),
                        loss_fn_inputs={"target_tokens": [*PROMPT[1:], PROMPT[0]]})  # fmt: skip
    kept = one.save_state("kept").result().path

    assert unload(server, one.model_id, "bob").status_code == 404  # another user's: the answer of none
    assert unload(server, "s0000000000000000:train:9").status_code == 404
    assert one.forward([datum], "cross_entropy").result().metrics["loss:sum"] > 0  # (bob's changed nothing)

    model = server.sessions.models[one.model_id]
    sent = len(model.seen)
    pending = one.forward([datum], "cross_entropy")
    wait_for(lambda: len(model.seen) > sent, "the forward to be passed on to the model's idle job")
    answer = unloaded(one, unload(server, one.model_id))
    assert (answer.model_id, answer.type) == (one.model_id, "unload_model")
    assert model.status == "ended" and "unloaded by its client" in model.reason  # answered once its job ended
    assert pending.result().metrics["loss:sum"] > 0  # (announced before the unload: its job ran it first)
    again = unloaded(one, unload(server, one.model_id))  # ended already: answered at once
    assert (again.model_id, again.type) == (one.model_id, "unload_model")
    with pytest.raises(tinker.APIStatusError, match="410"):  # as any ended model's
        one.forward([datum], "cross_entropy").result()

    step = two.forward_backward([datum], "cross_entropy").result()  # its session's other model trains on
    assert step.metrics["loss:sum"] > 0
    assert two.optim_step(types.AdamParams(learning_rate=0.01)).result().metrics["grad_norm"] > 0  # type: ignore[index]
    rest = tinker.RestClient(base_url=server.url, api_key="tml-ann")  # the unloaded model's checkpoints stay
    assert kept in {c.tinker_path for c in rest.list_checkpoints(one.model_id).result().checkpoints}
    reloaded = service.create_training_client_from_state(kept).result()
    assert reloaded.forward([datum], "cross_entropy").result().metrics["loss:sum"] > 0

    sid = server.sessions.samplers[sampler._sampling_session_id].model_id  # (the session's base-model job)
    done = unloaded(sampler, unload(server, sid))
    assert (done.model_id, done.type) == (sid, "unload_model")
    with pytest.raises(tinker.APIStatusError, match="410"):
        sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2)).result()
