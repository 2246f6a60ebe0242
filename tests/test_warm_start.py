"""The supervised warm start's learning-rate schedule."""

from __future__ import annotations

import doctest
import itertools
from pathlib import Path

import pytest
import torch

import plexrl.job.models as models_mod
from plexrl.job.config import WarmStartConfig
from plexrl.job.models import warm_start_lr


def test_models_doctests() -> None:
    result = doctest.testmod(models_mod)
    assert result.attempted > 0 and result.failed == 0


def test_default_schedule_is_constant() -> None:
    cfg = WarmStartConfig()
    assert {warm_start_lr(cfg, s) for s in range(1, 2000, 7)} == {cfg.lr}


def test_warmup_then_cosine_decay_then_hold() -> None:
    cfg = WarmStartConfig(lr=3e-3, warmup_steps=50, decay_steps=600, min_lr_ratio=0.05)
    lrs = [warm_start_lr(cfg, s) for s in range(1, 1001)]
    warm, decay, held = lrs[:50], lrs[50:650], lrs[650:]
    assert all(a < b for a, b in itertools.pairwise(warm)) and warm[-1] == pytest.approx(3e-3)
    assert all(a > b for a, b in itertools.pairwise(decay))
    assert decay[-1] == pytest.approx(3e-3 * 0.05) and held == pytest.approx([3e-3 * 0.05] * len(held))
    assert warm_start_lr(cfg, 350) == pytest.approx(3e-3 * (0.05 + 0.95 * 0.5))  # half-way down the cosine


def test_schedule_fields_are_validated() -> None:
    with pytest.raises(ValueError, match="min_lr_ratio"):
        WarmStartConfig(min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="decay_steps"):
        WarmStartConfig(decay_steps=-1)


def test_decay_from_accuracy_holds_the_peak_until_the_check_then_decays_from_there() -> None:
    cfg = WarmStartConfig(lr=3e-3, warmup_steps=50, decay_steps=700, decay_from_accuracy=0.5)
    assert warm_start_lr(cfg, 25) == pytest.approx(1.5e-3)  # the warm-up is unchanged
    assert [warm_start_lr(cfg, s) for s in (51, 400, 2000)] == [3e-3] * 3  # no check has reached 50% yet
    assert warm_start_lr(cfg, 450, decay_from=450) == pytest.approx(3e-3)
    assert warm_start_lr(cfg, 800, decay_from=450) == pytest.approx(3e-3 * (0.05 + 0.95 * 0.5))  # half-way
    assert warm_start_lr(cfg, 1150, decay_from=450) == pytest.approx(3e-3 * 0.05)
    assert warm_start_lr(WarmStartConfig(lr=3e-3, warmup_steps=50, decay_steps=700), 400, decay_from=450) < 3e-3


@pytest.mark.parametrize("std", [0.02, 0.05])
def test_init_std_sets_the_scale_of_the_initial_weights(tmp_path: Path, std: float) -> None:
    """`model.init_std` reaches the built model: its linear and embedding weights have that spread (the
    warm start's plateau on addition depends on it), and the same seed builds the same weights."""
    from safetensors.torch import load_file

    from plexrl.job.model_config import ModelConfig
    from plexrl.job.models import build_model, build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    cfg = ModelConfig(layers=1, hidden=64, heads=2, intermediate=128, init_std=std)
    for name in ("a", "b"):
        build_model(cfg, tok, tmp_path / name, seed=3)
    a, b = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    spread = torch.cat([t.flatten() for k, t in a.items() if "proj" in k or "embed" in k]).std().item()
    assert spread == pytest.approx(std, rel=0.05)
    with pytest.raises(ValueError, match="init_std"):
        ModelConfig(init_std=0)
