"""tinker-cookbook's own trainers, unchanged, against a real `plexrl serve`: `supervised/train.py` on a few rows
of local chat jsonl and `rl/train.py` on a small addition environment defined here, each `main` run with its
`Config` (`renderer_name="role_colon"`, `base_url` the server, the key from `TINKER_API_KEY`). The model is a tiny
random Llama with the real SmolLM2 tokenizer, served under the Hugging Face name its config.json declares, whose
tokenizer the cookbook loads offline by that name.

Checked on the server's side, not only in the cookbook's logs: the cookbook's checkpoints are the ones the
RestClient lists, and the final state it saved computes another loss than the untrained model (the steps it
logged changed the weights). The provenance spans the RL trainer attaches to every datum are taken (not checked:
only stable_reinforce, not served, reads them) and change nothing in the call."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import tinker_server_config

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
chz = pytest.importorskip("chz", reason="tinker-cookbook is installed by `make setup` (Makefile)")
pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is installed by `make setup` (Makefile)")

from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker_cookbook import renderers  # noqa: E402
from tinker_cookbook.completers import StopCondition  # noqa: E402
from tinker_cookbook.rl import train as rl_train  # noqa: E402
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult  # noqa: E402
from tinker_cookbook.supervised import train as sl_train  # noqa: E402
from tinker_cookbook.supervised.data import FromConversationFileBuilder  # noqa: E402
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig  # noqa: E402
from tinker_cookbook.tokenizer_utils import get_tokenizer  # noqa: E402

from plexrl.job.pretrained import place_tokenizer  # noqa: E402
from plexrl.server.api import RunningServer, start_server  # noqa: E402
from plexrl.server.tinker import decode, proto  # noqa: E402
from plexrl.server.tinker.config import TinkerConfig  # noqa: E402

NAME = "plexrl-tests/cookbook-tiny"  # the Hugging Face name the tiny model's config.json declares
KEY = "tml-ann"
CHATS = [
    [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": f"{a + b}"}]
    for a, b in [(2, 3), (4, 4), (10, 7), (12, 30), (5, 9), (8, 1)]
]


@pytest.fixture
def served(tmp_path: Path, smol_tiny: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunningServer]:
    """`plexrl serve` with the tiny model under its declared name; the key in the environment; the tokenizer
    placed in an offline Hugging Face cache under that name (what `plexrl pretrained` does for a served model)."""
    from huggingface_hub import constants

    model = tmp_path / "cookbook-tiny"
    shutil.copytree(smol_tiny, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "_name_or_path": NAME}))
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    place_tokenizer(model, NAME, cache)
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    server = tinker_server_config(tmp_path, smol_tiny, cluster={"max_load": 4.0}, tinker={"models": [str(model)]})
    srv = start_server(server)
    try:
        yield srv
    finally:
        srv.stop(120)


def metrics_rows(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def checkpoint_rows(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]


def on_the_server(srv: RunningServer, state_path: str) -> tuple[set[str], float, float]:
    """Every checkpoint path the RestClient lists for the user, and the loss of one chat under the state at
    `state_path` and under the untrained model."""
    service = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
    try:
        rest = tinker.RestClient(base_url=srv.url, api_key=KEY)
        listed = {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
        tok = get_tokenizer(NAME)
        ids = tok.encode("User: What is 2 + 3?\n\nAssistant: 5\n\n", add_special_tokens=False)
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
        trained = service.create_training_client_from_state(state_path).result()
        fresh = service.create_lora_training_client(base_model=NAME, rank=8).result()
        losses = [c.forward([datum], "cross_entropy").result().metrics["loss:sum"] for c in (trained, fresh)]
        service.close("success").result()
    except BaseException:
        service.close("errored").result()
        raise
    return listed, losses[0], losses[1]


def test_the_cookbooks_supervised_trainer_runs_unchanged(tmp_path: Path, served: RunningServer) -> None:
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    log_path = tmp_path / "sl"
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=NAME, renderer_name="role_colon",
                                            max_length=64, batch_size=2)  # fmt: skip
    config = sl_train.Config(
        log_path=str(log_path), model_name=NAME, recipe_name="plexrl-test", renderer_name="role_colon",
        dataset_builder=FromConversationFileBuilder(file_path=str(data), test_size=2, common_config=common),
        learning_rate=0.05, lora_rank=8, base_url=served.url, eval_every=1, save_every=1, max_steps=2,
    )  # fmt: skip
    asyncio.run(sl_train.main(config))

    rows = metrics_rows(log_path)
    assert [r["step"] for r in rows if "train_mean_nll" in r] == [0, 1]
    assert all(r["num_sequences"] == 2 and r["train_mean_nll"] > 0 for r in rows if "train_mean_nll" in r)
    assert any("test/nll" in r for r in rows)  # the held-out rows: save_weights_and_get_sampling_client + logprobs
    saved = checkpoint_rows(log_path)
    final = next(r for r in saved if r["name"] == "final")
    listed, trained, untrained = on_the_server(served, final["state_path"])
    assert {p for r in saved for k, p in r.items() if k.endswith("_path")} <= listed
    assert trained != pytest.approx(untrained, rel=1e-4)


class SumEnv(Env):
    """Two-digit addition, scored on the last integer of the answer: 1 when it is the sum. A random model never
    gets there, so its score also gives half a point when the first sampled token id is even (it does half the
    time): a group's rewards differ, its advantages are not zero, and the step changes the weights."""

    def __init__(self, a: int, b: int, renderer: renderers.Renderer) -> None:
        self.a, self.b, self.renderer = a, b, renderer

    async def initial_observation(self) -> tuple[types.ModelInput, StopCondition]:
        prompt = self.renderer.build_generation_prompt([{"role": "user", "content": f"What is {self.a} + {self.b}?"}])
        return prompt, self.renderer.get_stop_sequences()

    async def step(self, action: list[int], *, extra: Any = None) -> StepResult:
        message, _ = self.renderer.parse_response(action)
        found = re.findall(r"-?\d+", renderers.get_text_content(message))
        correct = float(bool(found) and int(found[-1]) == self.a + self.b)
        even = float(bool(action) and action[0] % 2 == 0)
        return StepResult(
            reward=correct + 0.5 * even, episode_done=True, next_observation=types.ModelInput.empty(),
            next_stop_condition=self.renderer.get_stop_sequences(), metrics={"correct": correct, "even": even},
        )  # fmt: skip


@dataclass(frozen=True)
class SumGroup(EnvGroupBuilder):
    a: int
    b: int
    renderer: renderers.Renderer
    size: int

    async def make_envs(self) -> Sequence[Env]:
        return [SumEnv(self.a, self.b, self.renderer) for _ in range(self.size)]


class SumDataset(RLDataset):
    def __init__(self, renderer: renderers.Renderer, batch_size: int, group_size: int, batches: int) -> None:
        self.renderer, self.batch_size, self.group_size, self.batches = renderer, batch_size, group_size, batches

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        pairs = [(10 + (7 * index + 3 * i) % 90, 10 + (5 * index + 11 * i) % 90) for i in range(self.batch_size)]
        return [SumGroup(a, b, self.renderer, self.group_size) for a, b in pairs]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class SumDatasetBuilder(RLDatasetBuilder):
    batch_size: int = 2
    group_size: int = 4
    batches: int = 2

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        renderer = renderers.get_renderer("role_colon", tokenizer=get_tokenizer(NAME))
        return SumDataset(renderer, self.batch_size, self.group_size, self.batches), None


def test_the_cookbooks_rl_trainer_runs_unchanged(tmp_path: Path, served: RunningServer) -> None:
    log_path = tmp_path / "rl"
    config = rl_train.Config(
        learning_rate=0.05, dataset_builder=SumDatasetBuilder(), model_name=NAME, recipe_name="plexrl-test",
        max_tokens=6, log_path=str(log_path), renderer_name="role_colon", lora_rank=8, base_url=served.url,
        eval_every=0, save_every=1,
    )  # fmt: skip
    asyncio.run(rl_train.main(config))

    rows = [r for r in metrics_rows(log_path) if "env/all/reward/total" in r]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["env/all/total_episodes"] == 8 and 0 <= r["env/all/reward/total"] <= 1.5 for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)  # (the server's optim_step reports it)
    saved = checkpoint_rows(log_path)
    assert [r["name"] for r in saved] == ["000001", "000002", "final"]
    final = next(r for r in saved if r["name"] == "final")
    listed, trained, untrained = on_the_server(served, final["state_path"])
    assert {p for r in saved for k, p in r.items() if k.endswith("_path")} <= listed
    assert trained != pytest.approx(untrained, rel=1e-4)


def test_provenance_spans_which_the_rl_trainer_attaches_are_taken_and_change_nothing() -> None:
    plain = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [0.0, -1.0, -2.0], "advantages": [0.0, 0.5, 0.5]},
    )
    spanned = plain.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="q", length=2),
                     types.SampledProvenanceSpan(sequence_id="q", length=1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="q", offset=1, length=1),
                        types.SampledProvenanceSpan(sequence_id="q", length=2)],
    )  # fmt: skip
    calls = []
    for datum in (plain, spanned):
        req = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="importance_sampling"),
            model_id="s0123456789abcdef:train:0", seq_id=1,
        )  # fmt: skip
        wire = proto.decode_forward_backward(forward_backward_request_to_proto(req).SerializeToString())
        assert wire.data[0].spans is (datum is spanned)
        calls.append(decode.forward_backward(wire, decode.ModelLimits(vocab=50, context=8), TinkerConfig()))
    assert repr(calls[0]) == repr(calls[1])
