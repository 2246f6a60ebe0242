"""A real model's options on the torch engine: several eos ids from generation_config.json, pad fallback."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from plexrl.data.prompts import engine_special_ids
from plexrl.engines.torch_engine import TorchEngine
from plexrl.job.model_config import ModelConfig
from plexrl.job.models import build_model, build_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    d = tmp_path_factory.mktemp("options-model")
    tok = build_tokenizer(d)
    build_model(ModelConfig(layers=1, hidden=32, heads=2, intermediate=64), tok, d, seed=0)
    return d, tok


def prompts(tok: Any) -> list[list[int]]:
    return [tok(t)["input_ids"] for t in ["12+34=", "5+6=", "123+4=", "7+70="]]


def responses(gen: Any) -> list[list[int]]:
    return [gen.response_ids[i, : int(gen.lengths[i])].tolist() for i in range(len(gen.lengths))]


def with_generation_eos(src: Path, dst: Path, eos: list[int]) -> Path:
    """A copy of the model in `src` whose generation_config.json lists the eos ids `eos`."""
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    gen["eos_token_id"] = eos
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


def test_a_built_model_stops_at_its_tokenizer_eos_only(model_dir: tuple[Path, Any]) -> None:
    d, tok = model_dir
    engine = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    assert (engine.eos_id, engine.extra_eos, engine.pad_id) == (tok.eos_token_id, (), tok.pad_token_id)


def test_every_eos_of_the_generation_config_ends_a_row(model_dir: tuple[Path, Any], tmp_path: Path) -> None:
    d, tok = model_dir
    kw: dict[str, Any] = {"n": 4, "temperature": 1.0, "max_new_tokens": 12, "seed": 3}
    plain = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id).generate(prompts(tok), **kw)
    # a second eos: the token the model samples most often (not the tokenizer's eos), so rows meet it
    counts = Counter(t for row in responses(plain) for t in row if t != tok.eos_token_id)
    second = counts.most_common(1)[0][0]
    multi = with_generation_eos(d, tmp_path / "multi", [tok.eos_token_id, second])
    engine = TorchEngine(multi, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    assert engine.extra_eos == (second,)
    out = engine.generate(prompts(tok), **kw)
    hit = 0
    for before, after, reason in zip(responses(plain), responses(out), out.finish_reasons, strict=True):
        stops = [j for j, t in enumerate(before) if t in (tok.eos_token_id, second)]
        if stops:  # same seed, same weights: the row is the unpaused one cut at its first eos of either kind
            assert after == before[: stops[0] + 1] and reason == "stop"
            hit += before[stops[0]] == second
        else:
            assert after == before and reason == "length"
    assert hit >= 1  # some row really ended at the second eos


def test_pad_falls_back_to_the_generation_config_then_to_eos(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9], "pad_token_id": 5}))
    assert engine_special_ids(tmp_path, 9, None).eos == (9, 7)
    assert engine_special_ids(tmp_path, 9, None).pad == 5
    assert engine_special_ids(tmp_path, None, 3).pad == 3
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert engine_special_ids(tmp_path, None, None).pad == 4
    (tmp_path / "generation_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no eos token id"):
        engine_special_ids(tmp_path, None, None)


def test_a_tokenizer_without_pad_generates(model_dir: tuple[Path, Any]) -> None:
    d, tok = model_dir
    engine = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=None)
    gen_pad = json.loads((d / "generation_config.json").read_text()).get("pad_token_id", tok.eos_token_id)
    assert engine.pad_id == gen_pad
    out = engine.generate(prompts(tok), n=1, temperature=1.0, max_new_tokens=4, seed=0, greedy=True)
    assert torch.equal(out.prompt_mask.sum(1), torch.tensor([len(p) for p in prompts(tok)]))


# ---- the prompt + response budget against the model's context length ------------------------------------


def budget_job(model: dict[str, Any], max_new_tokens: int, data: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"model": model, "warm_start": {"enabled": False}}
    cfg["pipeline"] = {"name": "grpo", "params": {"max_new_tokens": max_new_tokens}}
    if data is not None:
        cfg["data"] = data
    return cfg


def test_prompt_and_response_budget_is_checked_against_the_context_length(smol_tiny: Path, tmp_path: Path) -> None:
    from test_data_files import write_verl_parquet

    from plexrl.errors import ConfigError
    from plexrl.job.checks import generation_budget
    from plexrl.job.load import load_job

    data = {"train": str(write_verl_parquet(tmp_path / "t.parquet", 4)), "max_prompt_tokens": 500}
    with pytest.raises(ConfigError) as err:  # smol_tiny has 512 positions
        load_job(budget_job({"path": str(smol_tiny)}, 24, data))
    text = str(err.value)
    assert "data.max_prompt_tokens" in text and "max_prompt_tokens (500)" in text and "(24) = 524" in text
    assert "context length 512 (max_position_embeddings in" in text and "lower data.max_prompt_tokens" in text
    ok = load_job(budget_job({"path": str(smol_tiny)}, 12, data))  # 512 exactly: fits
    assert generation_budget(ok.config, ok.graph) == 512
    with pytest.raises(ConfigError, match=r"max_new_tokens \(64\) leaves no room for a prompt.*model\.max_position"):
        load_job(budget_job({"max_position": 64}, 64))  # a built model, no data: the response alone
    assert generation_budget(load_job(budget_job({"max_position": 64}, 8)).config, None) is None


# ---- dtype: bf16 with fp32 masters; gradient checkpointing ------------------------------------------------


def nll(mb: dict[str, torch.Tensor], logp: torch.Tensor, ent: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    mask = mb["attention_mask"][:, 1:].float()
    return -(logp[:, 1:] * mask).sum() / mask.sum(), {}


def a_batch(tok: Any) -> dict[str, torch.Tensor]:
    ids = torch.tensor([tok("12+34=46")["input_ids"], tok("5+60=65")["input_ids"][:1] * 2 + tok("5+6=11")["input_ids"]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def step(engine: TorchEngine, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    return engine.train_step(batch, nll, temperature=1.0, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0, minibatches=1)


def test_a_bf16_engine_trains_fp32_masters_and_counts_their_bytes(model_dir: tuple[Path, Any]) -> None:
    from plexrl.job.models import engine_options

    d, tok = model_dir
    opts = engine_options(ModelConfig(dtype="bfloat16"))
    assert opts == {"dtype": "bfloat16", "gradient_checkpointing": False}
    engine = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, **opts)
    assert all(p.dtype == torch.bfloat16 for p in engine.policy.parameters())
    before = {k: v.clone() for k, v in engine.policy.state_dict().items()}
    batch = a_batch(tok)
    losses = [step(engine, batch)["loss"] for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    after = engine.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert engine.master is not None and all(m.dtype == torch.float32 for m in engine.master.values())
    params = dict(engine.policy.named_parameters())
    for name, m in engine.master.items():  # the policy is its master rounded to bf16
        assert torch.equal(params[name], m.to(torch.bfloat16))
        assert params[name].grad is None and m.grad is None  # no gradient outlives the step
    opt_params = [p for g in engine.optimizer.param_groups for p in g["params"]]  # type: ignore[union-attr]
    assert {id(p) for p in opt_params} == {id(m) for m in engine.master.values()}
    # the state's real bytes: bf16 policy (2 a parameter) + fp32 masters (4) + two fp32 AdamW moments (8)
    n = sum(p.numel() for p in engine.policy.parameters())
    tensors = engine.state_tensors()
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == 14 * n
    # the state round-trips with its masters: a fresh engine continues exactly
    twin = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, **opts)
    twin.load_state(engine.export_state())
    assert step(twin, batch)["loss"] == step(engine, batch)["loss"]
    assert all(torch.equal(a, b) for a, b in zip(twin.master.values(), engine.master.values(), strict=True))  # type: ignore[union-attr]
    out = engine.generate(prompts(tok), n=2, temperature=1.0, max_new_tokens=4, seed=0)
    assert torch.isfinite(out.logprobs).all()


def gradients(engine: TorchEngine, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from plexrl.engines.logprobs import token_logprobs
    from plexrl.engines.torch_engine import positions

    engine.policy.train()
    mask = batch["attention_mask"]
    logits = engine.policy(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions(mask)).logits
    loss, _ = nll(batch, *token_logprobs(logits, batch["input_ids"], 1.0))
    loss.backward()
    engine.policy.eval()
    return {k: p.grad.clone() for k, p in engine.policy.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_the_same_gradients(model_dir: tuple[Path, Any]) -> None:
    d, tok = model_dir
    plain = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    ckpt = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, gradient_checkpointing=True)
    assert ckpt.policy.is_gradient_checkpointing and not plain.policy.is_gradient_checkpointing
    batch = a_batch(tok)
    a, b = gradients(plain, batch), gradients(ckpt, batch)
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)
    assert step(plain, batch)["grad_norm"] == pytest.approx(step(ckpt, batch)["grad_norm"], rel=1e-5)
    with pytest.raises(ValueError, match="model dtype 'float16' is not one of float32, bfloat16"):
        TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, dtype="float16")


# ---- decode-step preemption: pause between decode steps, resume, same tokens --------------------------------


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_paused_generation_samples_exactly_what_an_unpaused_one_does(
    model_dir: tuple[Path, Any], top_p: float
) -> None:
    d, tok = model_dir
    engine = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    ps = prompts(tok)
    probe = engine.generate(ps, n=4, temperature=1.0, max_new_tokens=16, seed=7)
    common = Counter(t for row in responses(probe) for t in row).most_common(1)[0][0]  # rows stop early at it
    kw: dict[str, Any] = {"n": 4, "temperature": 1.0, "max_new_tokens": 16, "seed": 7, "top_p": top_p}
    kw["stop_token_ids"] = [common]
    unpaused = engine.generate(ps, **kw)
    dec = engine.begin_generation(ps, **kw)
    with pytest.raises(RuntimeError, match="paused after 0 steps"):
        dec.output()
    batch_sizes = []
    for k in range(100):
        engine.resume(dec, max_steps=1 + k % 3)
        if dec.finished:
            break
        batch_sizes.append(len(dec.rows))
        engine.generate([tok("9+9=")["input_ids"]], n=3, temperature=1.0, max_new_tokens=5, seed=k)  # meanwhile
    paused = dec.output()
    assert dec.finished and dec.past is None  # its KV cache freed with the last step
    assert min(batch_sizes) < len(ps) * 4, "some finished rows should have left the batch (else untested)"
    assert torch.equal(paused.response_ids, unpaused.response_ids)
    assert torch.equal(paused.logprobs, unpaused.logprobs)
    assert torch.equal(paused.response_mask, unpaused.response_mask)
    assert paused.finish_reasons == unpaused.finish_reasons and "stop" in paused.finish_reasons
    for row, reason in zip(responses(paused), paused.finish_reasons, strict=True):  # rows end at a stop token
        assert (row[-1] == common) == (reason == "stop") or row[-1] == tok.eos_token_id


def test_the_state_estimate_bounds_a_bf16_engines_measured_state(model_dir: tuple[Path, Any]) -> None:
    from plexrl.job.load import load_job
    from plexrl.sizes import estimate_state_bytes, model_bytes

    d, tok = model_dir
    engine = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, dtype="bfloat16")
    step(engine, a_batch(tok))  # the AdamW moments exist after a step
    measured = sum(t.numel() * t.element_size() for t in engine.state_tensors().values())
    graph = load_job({"pipeline": {"name": "grpo", "params": {"kl": {"coef": 0.0}}}}).graph  # no reference
    assert estimate_state_bytes(model_bytes(d), graph, "float32") < measured  # fp32 copies undercount bf16
    assert estimate_state_bytes(model_bytes(d), graph, "bfloat16") >= measured


def test_the_budget_of_a_pretrained_model_reads_its_converted_config(tmp_path: Path) -> None:
    from test_data_files import write_verl_parquet

    from plexrl.errors import ConfigError
    from plexrl.job.load import load_job
    from plexrl.job.pretrained import pretrained_path

    try:
        path = pretrained_path("smollm2-135m-instruct", convert=False)
    except LookupError:
        pytest.skip("SmolLM2 is not converted here (make setup-pretrained)")
    positions = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    data = {"train": str(write_verl_parquet(tmp_path / "t.parquet", 4)), "max_prompt_tokens": positions - 8}
    with pytest.raises(ConfigError, match=rf"= {positions + 16} tokens exceeds the model's context length {positions}"):
        load_job(budget_job({"pretrained": "smollm2-135m-instruct"}, 24, data))
    load_job(budget_job({"pretrained": "smollm2-135m-instruct"}, 8, data))
