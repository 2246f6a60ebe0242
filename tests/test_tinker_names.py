"""Model names and tokenizers as Tinker users expect them, through the unmodified `tinker` SDK against a real
`plexrl serve`: the shipped SmolLM2 under its Hugging Face name (the short name still works), a local model
under the name its config.json declares, `get_info` with the real architecture and a tokenizer id the client
loads offline, `get_server_capabilities` with every served name and its context length."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402

from plexrl.job.pretrained import place_tokenizer, pretrained_path  # noqa: E402
from plexrl.server.api import start_server  # noqa: E402
from plexrl.server.config import ServerConfig  # noqa: E402
from plexrl.server.tinker import catalog  # noqa: E402

HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
DECLARED = "plexrl-tests/smol-tiny"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, read offline, for this process (what a fresh client machine has)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def named_tiny(tmp_path: Path, smol_tiny: Path) -> Path:
    """The tiny model in a directory whose config.json declares a Hugging Face name."""
    out = tmp_path / "named-tiny"
    shutil.copytree(smol_tiny, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["_name_or_path"] = DECLARED
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_names_resolve_to_one_entry_and_a_declared_name_must_be_a_hub_id(tmp_path: Path, named_tiny: Path) -> None:
    models = ["smollm2-135m-instruct", str(named_tiny)]
    assert catalog.entry_of(models, HUB) == catalog.entry_of(models, "smollm2-135m-instruct") == models[0]
    assert catalog.entry_of(models, DECLARED) == catalog.entry_of(models, str(named_tiny)) == models[1]
    assert catalog.entry_of(models, "plexrl-tests/other") is None and catalog.entry_of(models, 3) is None
    assert catalog.tokenizer_id(models, "smollm2-135m-instruct") == HUB
    assert catalog.tokenizer_id(models, str(named_tiny)) == DECLARED
    assert catalog.tokenizer_id(models, "/elsewhere/model") == "/elsewhere/model"
    for bad in ("../etc/passwd", "a/b/c", "Smollm2 135M 8k Lc100K Mix1 Ep2", "/abs/path"):
        cfg = json.loads((named_tiny / "config.json").read_text())
        (named_tiny / "config.json").write_text(json.dumps({**cfg, "_name_or_path": bad}))
        assert catalog.declared_name(named_tiny) is None, bad
    assert catalog.facts(named_tiny) == catalog.ModelFacts("llama", 512)
    assert catalog.facts(tmp_path) == catalog.ModelFacts(None, None)


def test_plexrl_pretrained_places_the_tokenizer_where_transformers_finds_it_offline(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    made = subprocess.run([sys.executable, "-m", "plexrl.cli", "pretrained", HUB], env=env, capture_output=True,
                          text=True, timeout=300, check=True)  # fmt: skip
    assert Path(made.stdout.strip()) == pretrained_path("smollm2-135m-instruct")
    code = (
        "from transformers import AutoTokenizer\n"
        f"for n in ({HUB!r}, 'smollm2-135m-instruct'):\n"
        "    t = AutoTokenizer.from_pretrained(n)\n"
        "    print(len(t), t.eos_token_id, t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)"
        "[:20].replace(chr(10), ' '))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.splitlines() == ["49152 2 <|im_start|>system Y"] * 2
    assert not (tmp_path / "hf" / "hub" / f"models--{HUB.replace('/', '--')}" / "blobs").exists()  # no weights


def test_a_cache_that_holds_the_name_is_left_alone(tmp_path: Path, smol_tiny: Path) -> None:
    first = place_tokenizer(smol_tiny, DECLARED, tmp_path)
    assert first is not None and (first / "tokenizer.json").is_file() and not (first / "model.safetensors").exists()
    (first / "tokenizer.json").write_text("{}")
    assert place_tokenizer(smol_tiny, DECLARED, tmp_path) is None
    assert (first / "tokenizer.json").read_text() == "{}"


def test_the_sdk_trains_and_samples_under_hugging_face_names_and_loads_their_tokenizers(
    tmp_path: Path, smol_tiny: Path, named_tiny: Path, hub_cache: Path
) -> None:
    cfg = ServerConfig(
        port=0, journal=str(tmp_path / "journal.db"), run_dir=str(tmp_path / "runs"),
        cluster={"driver": "local", "services": {"count": 1}, "max_load": 4.0},  # (all sessions on the one service)
        allowed_roots=[str(tmp_path), str(smol_tiny.parent)], mlflow=False,
        tinker={"models": ["smollm2-135m-instruct", str(named_tiny)]},
    )  # fmt: skip
    place_tokenizer(named_tiny, DECLARED, hub_cache)  # (what the client machine's set-up does for its own model)
    srv = start_server(cfg)
    try:
        service = tinker.ServiceClient(base_url=srv.url, api_key="tml-ann")
        rest = tinker.RestClient(base_url=srv.url, api_key="tml-ann")
        listed = {m.model_name: m.max_context_length for m in rest.get_server_capabilities().result().supported_models}
        assert listed == {HUB: 8192, "smollm2-135m-instruct": 8192, DECLARED: 512, str(named_tiny): 512}

        training = service.create_lora_training_client(base_model=HUB, rank=1, seed=3).result()
        info = training.get_info()
        assert (info.model_data.arch, info.model_data.model_name, info.model_data.tokenizer_id) == ("llama", HUB, HUB)
        tok = training.get_tokenizer()
        assert (len(tok), tok.eos_token_id) == (49152, 2)
        sampler = service.create_sampling_client(base_model=HUB).result()
        assert len(sampler.get_tokenizer()) == 49152
        prompt = types.ModelInput.from_ints(tok.encode("Hi"))
        out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, temperature=0.0)).result()
        assert len(out.sequences[0].tokens) in (1, 2)

        tiny = service.create_lora_training_client(base_model=DECLARED, rank=1).result()
        assert tiny.get_info().model_data.tokenizer_id == DECLARED and len(tiny.get_tokenizer()) == 49152
        datum = types.Datum(model_input=types.ModelInput.from_ints([1, 4, 9]),
                            loss_fn_inputs={"target_tokens": [4, 9, 16]})  # fmt: skip
        assert tiny.forward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
        with pytest.raises(tinker.BadRequestError, match="unknown base_model 'plexrl-tests/other'.*" + DECLARED):
            service.create_lora_training_client(base_model="plexrl-tests/other", rank=1).result()
        service.close("success").result()
    finally:
        srv.stop(120)
