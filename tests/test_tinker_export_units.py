"""The parts of external weights that need no server (`plexrl/server/tinker/exports.py`): URL signatures under
an injected clock, the server's secret file, the adapter's peft key names, the recipients a request may name,
the one path the server's authentication lets in without a key, and the LoRA alpha of saved weights."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest

from plexrl.server.tinker.decode import Refused
from plexrl.server.tinker.exports import Signer, peft_tensors, recipients_of
from plexrl.server.tinker.records import alpha_of
from plexrl.server.tinker.rest import signed_download

RUN = "s0123456789abcdef:train:0"


def test_a_signature_binds_every_part_and_expires(tmp_path: Path) -> None:
    clock = [1000.0]
    signer = Signer(tmp_path, lambda: clock[0])
    good = signer.signature(RUN, "final", "e1", "adapter_model.safetensors", 1100)
    signer.check(RUN, "final", "e1", "adapter_model.safetensors", "1100", good)  # (expires as the query gives it)
    for parts in [
        (RUN.replace(":0", ":1"), "final", "e1", "adapter_model.safetensors", "1100"),
        (RUN, "other", "e1", "adapter_model.safetensors", "1100"),
        (RUN, "final", "e2", "adapter_model.safetensors", "1100"),  # the export deleted and made again
        (RUN, "final", "e1", "adapter_config.json", "1100"),
        (RUN, "final", "e1", "adapter_model.safetensors", "1101"),
    ]:
        with pytest.raises(Refused, match="does not match") as exc:
            signer.check(*parts, good)
        assert exc.value.status == 403
    for bad in (None, "", good.upper(), good[:-1]):
        with pytest.raises(Refused, match="does not match"):
            signer.check(RUN, "final", "e1", "adapter_model.safetensors", "1100", bad)
    with pytest.raises(Refused, match="needs its expires"):
        signer.check(RUN, "final", "e1", "adapter_model.safetensors", "soon", good)
    clock[0] = 1100.5
    with pytest.raises(Refused, match="expired") as exc:
        signer.check(RUN, "final", "e1", "adapter_model.safetensors", "1100", good)
    assert exc.value.status == 403


def test_the_secret_is_private_lasting_and_per_server(tmp_path: Path) -> None:
    one = Signer(tmp_path / "a").signature(RUN, "n", "e", "f", 1)
    assert Signer(tmp_path / "a").signature(RUN, "n", "e", "f", 1) == one  # (a restarted server: the same URLs)
    assert Signer(tmp_path / "b").signature(RUN, "n", "e", "f", 1) != one
    secret = tmp_path / "a" / ".export-secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_bytes()) == 32
    assert [p.name for p in (tmp_path / "a").iterdir()] == [".export-secret"]
    secret.write_bytes(b"short")
    with pytest.raises(RuntimeError, match="remove it"):
        Signer(tmp_path / "a").secret()


def test_adapter_tensors_take_peft_names() -> None:
    tensors: dict[str, Any] = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.adapter.weight": 1,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.adapter.weight": 2,
        "base_model.model.lm_head.lora_A.adapter.weight": 3,
    }
    assert peft_tensors(tensors) == {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": 1,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": 2,
        "base_model.model.lm_head.lora_A.weight": 3,
    }
    with pytest.raises(ValueError, match="not a LoRA A / B matrix"):
        peft_tensors({"model.embed_tokens.weight": 0})


def test_recipients_are_checked_before_anything_is_written() -> None:
    pyrage: Any = pytest.importorskip("pyrage")
    key = str(pyrage.x25519.Identity.generate().to_public())
    assert recipients_of(None) == [] and len(recipients_of([key, key])) == 2
    for bad, why in [([], "list of 1 to 10"), ([key] * 11, "list of 1 to 10"), ("age1x", "list of 1 to 10"),
                     ([3], r"\[0\] must be"), (["age1nope"], "not a usable public key"),
                     (["AGE-SECRET-KEY-1ABC"], "not a usable public key")]:  # fmt: skip
        with pytest.raises(Refused, match=why) as exc:
            recipients_of(bad)
        assert exc.value.status == 400


def test_only_the_download_routes_shape_goes_without_a_key() -> None:
    prefix = "/api/v1"
    assert signed_download(prefix, f"/api/v1/external_weights/download/{RUN}/final/adapter_config.json")
    for path in ["/api/v1/external_weights/download/a/b", "/api/v1/external_weights/download/a/b/c/d",
                 "/api/v1/external_weights/download/a//c", "/api/v1/external_weights/download/../../jobs",
                 "/api/v1/training_runs", "/jobs", "/api/v1/external_weights/downloadX/a/b/c"]:  # fmt: skip
        assert not signed_download(prefix, path), path


def test_saved_weights_keep_the_alpha_they_were_trained_with() -> None:
    assert alpha_of({"lora_rank": 4, "lora_alpha": 8.0}, 32.0) == 8.0  # (recorded in owner.json at creation)
    assert alpha_of({"lora_rank": 4, "lora_alpha": 16}, 32.0) == 16.0
    for older in ({"lora_rank": 4}, {"lora_rank": 4, "lora_alpha": None}, {"lora_rank": 4, "lora_alpha": True},
                  {"lora_rank": 4, "lora_alpha": -1.0}, {"lora_rank": 4, "lora_alpha": "8"}):  # fmt: skip
        assert alpha_of(older, 32.0) == 32.0, older  # a record from before alphas were: the server's, as then
    assert alpha_of({"lora_rank": None, "lora_alpha": 8.0}, 32.0) is None  # a full fine-tune has none
