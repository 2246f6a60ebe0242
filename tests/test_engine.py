"""TorchEngine: sampling is seeded, behaviour log-probs match a full forward, state round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plexrl.engines.torch_engine import TorchEngine
from plexrl.job.model_config import ModelConfig
from plexrl.job.models import build_model, build_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    d = tmp_path_factory.mktemp("model")
    tok = build_tokenizer(d)
    build_model(ModelConfig(layers=1, hidden=32, heads=2, intermediate=64), tok, d, seed=0)
    return d, tok


def engine(model_dir: tuple[Path, object], **kw: object) -> TorchEngine:
    d, tok = model_dir
    return TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, **kw)  # type: ignore[attr-defined,arg-type]


def prompts(tok: object) -> list[list[int]]:
    return [tok(t)["input_ids"] for t in ["12+34=", "5+6=", "123+4="]]  # type: ignore[operator]


def test_tokenizer_is_character_level_and_round_trips(model_dir: tuple[Path, object]) -> None:
    _, tok = model_dir
    ids = tok("123+45=")["input_ids"]  # type: ignore[operator]
    assert ids[0] == tok.bos_token_id and len(ids) == 8  # type: ignore[attr-defined]
    assert tok.decode(ids, skip_special_tokens=True) == "123+45="  # type: ignore[attr-defined]


def test_generation_is_seeded_and_logprobs_match_full_forward(model_dir: tuple[Path, object]) -> None:
    e = engine(model_dir)
    p = prompts(model_dir[1])
    a = e.generate(p, n=4, temperature=1.0, max_new_tokens=6, seed=7)
    b = e.generate(p, n=4, temperature=1.0, max_new_tokens=6, seed=7)
    c = e.generate(p, n=4, temperature=1.0, max_new_tokens=6, seed=8)
    assert torch.equal(a.response_ids, b.response_ids) and not torch.equal(a.response_ids, c.response_ids)
    assert a.response_ids.shape[0] == 12 and a.prompt_ids.shape == (12, max(map(len, p)))
    ids = torch.cat([a.prompt_ids, a.response_ids], 1)
    mask = torch.cat([a.prompt_mask, a.response_mask], 1)
    full = e.logprobs(ids, mask, temperature=1.0)[:, a.prompt_ids.shape[1] :]
    rmask = a.response_mask.bool()
    assert torch.allclose(full[rmask], a.logprobs[rmask], atol=1e-5)
    assert (a.logprobs[~rmask] == 0).all()
    assert a.lengths.tolist() == a.response_mask.sum(1).tolist()
    for row, reason in zip(a.response_ids, a.finish_reasons, strict=True):
        assert (reason == "stop") == bool((row == model_dir[1].eos_token_id).any())  # type: ignore[attr-defined]


def test_left_padding_does_not_change_greedy_output(model_dir: tuple[Path, object]) -> None:
    e = engine(model_dir)
    p = prompts(model_dir[1])
    together = e.generate(p, n=1, temperature=1.0, max_new_tokens=5, seed=0, greedy=True)
    alone = e.generate([p[1]], n=1, temperature=1.0, max_new_tokens=5, seed=0, greedy=True)
    t = together.response_ids.shape[1]
    assert together.response_ids[1, : alone.response_ids.shape[1]].tolist() == alone.response_ids[0, :t].tolist()


def test_train_step_changes_weights_and_state_round_trips(model_dir: tuple[Path, object]) -> None:
    e = engine(model_dir, with_reference=True)
    p = prompts(model_dir[1])
    g = e.generate(p, n=2, temperature=1.0, max_new_tokens=4, seed=1)
    batch = {
        "input_ids": torch.cat([g.prompt_ids, g.response_ids], 1),
        "attention_mask": torch.cat([g.prompt_mask, g.response_mask], 1),
    }
    mask = torch.cat([torch.zeros_like(g.prompt_mask), g.response_mask], 1).float()

    def loss_fn(
        mb: dict[str, torch.Tensor], logp: torch.Tensor, ent: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        m = mask[: logp.shape[0]]
        return -(logp * m).sum() / m.sum(), {}

    before = e.export_state()
    before = {"policy": {k: v.clone() for k, v in before["policy"].items()}, "weight_version": 0}
    stats = e.train_step(batch, loss_fn, temperature=1.0, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0, minibatches=1)
    assert stats["grad_norm"] > 0 and stats["steps"] == 1 and e.weight_version == 1
    after = e.export_state()
    assert "optimizer" in after and "reference" in after
    assert any(not torch.equal(before["policy"][k], after["policy"][k]) for k in before["policy"])
    ref_lp = e.logprobs(batch["input_ids"], batch["attention_mask"], which="reference")
    pol_lp = e.logprobs(batch["input_ids"], batch["attention_mask"], which="policy")
    assert not torch.allclose(ref_lp, pol_lp)
    snapshot = {k: v.clone() for k, v in after["policy"].items()}
    e2 = engine(model_dir, with_reference=True)
    e2.load_state(after)
    assert e2.weight_version == 1
    assert all(torch.equal(snapshot[k], v) for k, v in e2.export_state()["policy"].items())
