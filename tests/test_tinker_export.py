"""External weights through the unmodified `tinker` SDK and tinker-cookbook's own `weights.download`, against a
real `plexrl serve` with user tokens (torch engine, the tiny model with the real SmolLM2 tokenizer):

- `save_weights_external` of a LoRA session is a PEFT adapter; the cookbook downloads it, and peft loads it onto
  the base to the same log-probs as the server's `forward` of that session;
- a training checkpoint (`tinker://.../weights/<name>`) downloads through the cookbook's temporary export,
  age-encrypted to a key it makes, which it deletes afterwards; the same weights as the first;
- a full-parameter session exports a Hugging Face model directory that transformers loads to the same log-probs;
- encrypted files decrypt with the recipient's key only;
- what an attacker tries: another user's export (urls, delete, TTL, export of another's model), an altered,
  another file's, an expired or a deleted export's URL, names that leave the export, and the rest of the API
  without a key (the download route alone takes none)."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import tinker_served

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
pyrage: Any = pytest.importorskip("pyrage")
pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is installed by `make setup` (Makefile)")

from tinker import types  # noqa: E402
from tinker.types.tensor_data import TensorData  # noqa: E402
from tinker_cookbook import weights  # noqa: E402
from tinker_cookbook.exceptions import WeightsDownloadError  # noqa: E402

from plexrl.server.api import RunningServer  # noqa: E402
from plexrl.server.tinker import exports  # noqa: E402
from plexrl.server.tinker.exports import Signer  # noqa: E402

ANN, BOB = "ann-token-0123456789", "bob-token-0123456789"
TOKENS = [1, 504, 2330, 314, 253, 1345, 30, 2]
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints(TOKENS[:-1]),
    loss_fn_inputs={"target_tokens": TensorData.from_numpy(np.array(TOKENS[1:])),
                    "weights": TensorData.from_numpy(np.ones(len(TOKENS) - 1, "f4"))},
)  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smol_tiny: Path) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("export")
    users = {"ann": ANN, "bob": BOB}
    with tinker_served(tmp, smol_tiny, cluster={"max_load": 4.0}, users=users, tinker={"engine": "torch"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def ann(server: RunningServer) -> Iterator[Any]:
    client = tinker.ServiceClient(base_url=server.url, api_key=f"tml-{ANN}")
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def trained(ann: Any, smol_tiny: Path) -> dict[str, Any]:
    """ann's LoRA session after one step, with its log-probs on DATUM (the server's forward), its state saved and
    its weights exported (`final`)."""
    training = ann.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=3).result()
    training.forward_backward([DATUM], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=0.05)).result()
    logprobs = training.forward([DATUM], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    state = training.save_state("after-one-step").result().path
    export = training.save_weights_external("final", ttl_seconds=7200).result().path
    return {"client": training, "logprobs": np.asarray(logprobs), "state": state, "export": export}


@pytest.fixture
def as_ann(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_API_KEY", f"tml-{ANN}")  # (weights.download makes its clients without a key)


def local_logprobs(model: Any) -> np.ndarray:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([TOKENS[:-1]])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    return np.asarray(logprobs.numpy())


def base_model(smol_tiny: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smol_tiny), dtype=torch.float32).eval()


def with_adapter(smol_tiny: Path, adapter: Path) -> Any:
    from peft import PeftModel

    with warnings.catch_warnings():  # (peft warns of an adapter on a tied output head: it adapts the head only)
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(base_model(smol_tiny), str(adapter)).eval()


def test_the_cookbook_downloads_an_external_export_that_peft_loads_to_the_servers_logprobs(
    server: RunningServer, trained: dict[str, Any], smol_tiny: Path, tmp_path: Path, as_ann: None
) -> None:
    training = trained["client"]
    assert trained["export"] == f"tinker://{training.model_id}/external_weights/final"
    out = Path(weights.download(tinker_path=trained["export"], output_dir=str(tmp_path / "adapter"),
                                base_url=server.url))  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    model = with_adapter(smol_tiny, out)
    np.testing.assert_allclose(local_logprobs(model), trained["logprobs"], atol=1e-4)
    with model.disable_adapter():  # (the step moved the log-probs: the adapter is what makes them agree)
        assert np.abs(local_logprobs(model) - trained["logprobs"]).max() > 1e-3

    rest = tinker.RestClient(base_url=server.url, api_key=f"tml-{ANN}")
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    final = listed["external_weights/final"]
    assert (final.checkpoint_type, final.tinker_path) == ("external", trained["export"])
    assert final.expires_at is not None and final.size_bytes == sum(p.stat().st_size for p in out.iterdir())
    info = rest.get_weights_info_by_tinker_path(trained["export"]).result()
    assert (info.is_lora, info.lora_rank, info.train_unembed) == (True, 4, True)
    from plexrl.server.tinker.quotas import saved_bytes  # an export counts against the user's saved bytes

    folder = server.sessions.root / training.model_id.replace(":", "-") / "external_weights" / "final"
    assert saved_bytes(server.sessions.root, "ann") >= final.size_bytes and folder.is_dir()
    with pytest.raises(tinker.BadRequestError, match="exist"):  # a name is used once
        training.save_weights_external("final").result()


def test_a_training_checkpoint_downloads_through_an_encrypted_export_that_is_deleted_after(
    server: RunningServer, trained: dict[str, Any], smol_tiny: Path, tmp_path: Path, as_ann: None
) -> None:
    from safetensors.torch import load_file

    first = Path(weights.download(tinker_path=trained["export"], output_dir=str(tmp_path / "a"), base_url=server.url))
    out = Path(weights.download(tinker_path=trained["state"], output_dir=str(tmp_path / "b"), base_url=server.url))
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    same, other = load_file(str(first / "adapter_model.safetensors")), load_file(str(out / "adapter_model.safetensors"))
    assert same.keys() == other.keys() and all(bool((same[k] == other[k]).all()) for k in same)
    np.testing.assert_allclose(local_logprobs(with_adapter(smol_tiny, out)), trained["logprobs"], atol=1e-4)
    rest = tinker.RestClient(base_url=server.url, api_key=f"tml-{ANN}")
    left = [c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints]
    assert not [p for p in left if p.endswith("/external_weights/download")]  # the cookbook deleted its export
    with pytest.raises(WeightsDownloadError, match="Sampler checkpoints cannot be downloaded"):
        weights.download(tinker_path=trained["state"].replace("/weights/", "/sampler_weights/"),
                         output_dir=str(tmp_path / "c"), base_url=server.url)  # fmt: skip


def test_a_full_parameter_session_exports_a_model_directory_transformers_loads(
    server: RunningServer, ann: Any, smol_tiny: Path, tmp_path: Path, as_ann: None
) -> None:
    from transformers import AutoModelForCausalLM

    full = ann.create_lora_training_client(base_model=str(smol_tiny), user_metadata={"plexrl.full_finetune": "true"})
    full = full.result()
    full.forward_backward([DATUM], "cross_entropy").result()
    full.optim_step(types.AdamParams(learning_rate=0.01)).result()
    served = np.asarray(full.forward([DATUM], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy())
    path = full.save_weights_external("full").result().path
    out = Path(weights.download(tinker_path=path, output_dir=str(tmp_path / "full"), base_url=server.url))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()  # (the dtype the config names: float32)
    np.testing.assert_allclose(local_logprobs(model), served, atol=1e-4)
    assert np.abs(local_logprobs(base_model(smol_tiny)) - served).max() > 1e-3


def test_encrypted_files_decrypt_with_the_recipients_key_only(
    server: RunningServer, trained: dict[str, Any], tmp_path: Path
) -> None:
    from safetensors.torch import load

    key, stranger = pyrage.x25519.Identity.generate(), pyrage.x25519.Identity.generate()
    training = trained["client"]
    path = training.save_weights_external("sealed", age_encryption_recipients=[str(key.to_public())]).result().path
    rest = tinker.RestClient(base_url=server.url, api_key=f"tml-{ANN}")
    urls = rest.get_external_weights_urls(path).result()
    assert sorted(urls.urls) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
    sealed = urllib.request.urlopen(urls.urls["adapter_model.safetensors.age"], timeout=60).read()
    assert sealed.startswith(b"age-encryption.org/v1") and b"lora_A" not in sealed
    tensors = load(pyrage.decrypt(sealed, [key]))
    assert any(".lora_A.weight" in k for k in tensors)
    with pytest.raises(pyrage.DecryptError):
        pyrage.decrypt(sealed, [stranger])
    folder = server.sessions.root / training.model_id.replace(":", "-") / "external_weights" / "sealed"
    assert sorted(p.name for p in folder.iterdir()) == sorted(urls.urls)  # no plaintext kept on the server
    with pytest.raises(tinker.BadRequestError, match="not a usable public key"):
        training.save_weights_external("bad", age_encryption_recipients=["age1notakey"]).result()


def test_an_export_converts_off_the_thread_that_delivers_replies(
    server: RunningServer, ann: Any, trained: dict[str, Any], smol_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While an export's conversion is held, another session's call is answered (the runner's thread delivered
    the export's reply and went on); the export's future completes once it is whole, and one whose conversion
    fails fails its future and leaves nothing behind."""
    entered, gate, write = threading.Event(), threading.Event(), exports.write_export

    def held(spec: exports.Export, keys: list[Any]) -> None:
        entered.set()
        assert gate.wait(120), "the test never opened the gate"
        write(spec, keys)

    monkeypatch.setattr(exports, "write_export", held)
    other = ann.create_lora_training_client(base_model=str(smol_tiny), rank=2, seed=9).result()
    training = trained["client"]
    folder = exports.export_dir(server.sessions.root, training.model_id, "held")
    try:
        export = training.save_weights_external("held")
        assert entered.wait(120), "the export never reached its conversion"
        assert other.forward([DATUM], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0  # meanwhile
        assert not folder.exists()  # (still converting: whole or absent)
    finally:
        gate.set()
    assert export.result(timeout=120).path.endswith("/external_weights/held")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    def broken(spec: exports.Export, keys: list[Any]) -> None:
        raise OSError("the disk is on fire")

    monkeypatch.setattr(exports, "write_export", broken)
    with pytest.raises(tinker.RequestFailedError, match="exporting the weights failed: OSError: the disk is on fire"):
        training.save_weights_external("burnt").result(timeout=120)
    assert not [p.name for p in folder.parent.iterdir() if "burnt" in p.name]  # (its staging folder removed)


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read().decode("latin-1")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_what_an_attacker_tries_is_refused(server: RunningServer, trained: dict[str, Any]) -> None:
    training = trained["client"]
    run_id, path = training.model_id, training.save_weights_external("target").result().path
    rest = tinker.RestClient(base_url=server.url, api_key=f"tml-{ANN}")
    bob = tinker.RestClient(base_url=server.url, api_key=f"tml-{BOB}")
    for call in (lambda: bob.get_external_weights_urls(path), lambda: bob.delete_checkpoint_from_tinker_path(path),
                 lambda: bob.set_checkpoint_ttl_from_tinker_path(path, 3600)):  # fmt: skip
        with pytest.raises(tinker.NotFoundError):  # another user's export: the answer of none
            call().result()
    body = {"model_id": run_id, "path": "mine", "seq_id": 10_000, "type": "save_weights_external"}
    stolen = httpx.post(f"{server.url}/api/v1/save_weights_external", json=body, headers={"X-API-Key": f"tml-{BOB}"})
    assert stolen.status_code == 404

    urls = rest.get_external_weights_urls(path).result().urls
    good = urls["adapter_config.json"]
    assert fetch(good)[0] == 200 and '"peft_type": "LORA"' in fetch(good)[1]  # no key sent: the signature is it
    base, query = good.split("?")
    weights_url = urls["adapter_model.safetensors"]
    signature = query.split("signature=")[1]
    expires = int(query.split("expires=")[1].split("&")[0])
    altered = signature[:-1] + ("0" if signature[-1] != "0" else "1")
    for url, why in [
        (base.replace("adapter_config.json", "adapter_model.safetensors") + "?" + query, "signature does not match"),
        (weights_url.split("?")[0] + "?" + query, "signature does not match"),  # another file's signature
        (f"{base}?expires={expires}&signature={altered}", "signature does not match"),
        (f"{base}?expires={expires + 1}&signature={signature}", "signature does not match"),
        (base, "needs its expires and signature"),
    ]:
        status, text = fetch(url)
        assert status == 403 and why in text, (url, status, text)
    signer = Signer(server.sessions.root)  # the server's own secret: an expired URL signed as the server would
    meta = json.loads((server.sessions.root / run_id.replace(":", "-") / "meta.json").read_text())
    export_id = meta["external_weights/target"]["export_id"]
    past = int(time.time()) - 5
    expired = f"{base}?{signer.query(run_id, 'target', export_id, 'adapter_config.json', past)}"
    status, text = fetch(expired)
    assert status == 403 and "expired" in text
    prefix = base.rsplit("/", 1)[0]
    future = int(time.time()) + 600
    for name in ["owner.json", "meta.json", "..", ".%2E", "..%2Fmeta.json", "%2E%2E%2F%2E%2E%2Fowner.json"]:
        # even signed with the server's secret, a name that is not a file of the export is not served: 404, or
        # 401 where the decoded path is no longer the download route's shape (so it needs a key like the rest)
        status, text = fetch(f"{prefix}/{name}?{signer.query(run_id, 'target', export_id, name, future)}")
        assert status in (401, 404) and "base_model" not in text and "expires_at" not in text, (name, status, text)
    outside = f"{prefix.rsplit('/', 2)[0]}/..%2F..%2Fweights/adapter_config.json?{query}"
    assert fetch(outside)[0] in (400, 401, 404)
    assert httpx.get(f"{server.url}/api/v1/training_runs/{run_id}").status_code == 401  # the rest needs a key

    rest.delete_checkpoint_from_tinker_path(path).result()
    assert fetch(good)[0] == 403  # a deleted export's URLs fetch nothing
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(path).result()


def test_the_cookbooks_merge_reproduces_an_adapter_without_the_tied_output_head(
    server: RunningServer, ann: Any, trained: dict[str, Any], smol_tiny: Path, tmp_path: Path, as_ann: None
) -> None:
    """`weights.build_hf_model` after `weights.download`: an adapter on attention and MLP merges into a model
    with the server's log-probs; one on the output head of a tied-embedding model is merged by the cookbook
    into the shared embedding matrix, so it does not give the session's log-probs back (docs/tutorial-your-loop.md)."""

    from transformers import AutoModelForCausalLM

    lora = ann.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=5, train_unembed=False).result()
    lora.forward_backward([DATUM], "cross_entropy").result()
    lora.optim_step(types.AdamParams(learning_rate=0.05)).result()
    served = np.asarray(lora.forward([DATUM], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy())
    path = lora.save_weights_external("body-only").result().path
    adapter = weights.download(tinker_path=path, output_dir=str(tmp_path / "adapter"), base_url=server.url)
    with warnings.catch_warnings():  # (the cookbook's own loading may warn; it is not under test here)
        warnings.simplefilter("ignore")
        weights.build_hf_model(base_model=str(smol_tiny), adapter_path=adapter, output_path=str(tmp_path / "merged"),
                               dtype="float32", merge_strategy="full")  # fmt: skip
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype="float32").eval()
    np.testing.assert_allclose(local_logprobs(merged), served, atol=1e-4)

    # an adapter on the tied output head merges too (into the shared embedding matrix, so the input embedding
    # moves with the head): it does not give the session's log-probs back; load such an adapter with peft instead
    with_head = weights.download(tinker_path=trained["export"], output_dir=str(tmp_path / "head"), base_url=server.url)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weights.build_hf_model(base_model=str(smol_tiny), adapter_path=with_head, output_path=str(tmp_path / "m2"),
                               dtype="float32", merge_strategy="full")  # fmt: skip
        tied = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m2"), dtype="float32").eval()
    assert np.abs(local_logprobs(tied) - trained["logprobs"]).max() > 0.1  # (6.4 when measured)
