"""`engine: auto` picks the faster rollout engine for the job's model, and says which and why.

The rule (plexrl/job/config.py `auto_engine_rule`): models under `vllm.auto_min_params` parameters stay on the
torch engine, which generates faster for them (measured: the main job's 0.53M-parameter model is 2.7x slower
on vLLM); larger ones go to vLLM when it is installed and can serve them. The size check comes first, so a
small model never imports vLLM. The cluster's device-budget estimate follows the same rule.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest

from plexrl.engines.vllm_engine import vllm_installed
from plexrl.job.budget import estimate_engine_bytes
from plexrl.job.config import AUTO_MIN_PARAMS, auto_engine_rule
from plexrl.job.load import load_job
from plexrl.job.spec import prepare_job, resolve_engine
from plexrl.sizes import count_parameters


def test_the_rule_splits_at_the_threshold() -> None:
    assert auto_engine_rule(AUTO_MIN_PARAMS - 1, AUTO_MIN_PARAMS) is not None
    assert auto_engine_rule(AUTO_MIN_PARAMS, AUTO_MIN_PARAMS) is None
    assert auto_engine_rule(1, 0) is None  # 0: size never rules vLLM out
    why = auto_engine_rule(530_000, 10_000_000)
    assert why is not None and "0.53M parameters" in why and "vllm.auto_min_params (10M)" in why


def test_a_small_model_on_auto_runs_on_torch_and_the_log_says_why(
    tiny_config: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    cfg = copy.deepcopy(tiny_config)
    cfg["engine"] = "auto"
    with caplog.at_level(logging.INFO, logger="plexrl.job"):
        spec = prepare_job(load_job(cfg))
    params = count_parameters(spec.model_path)
    assert 1_000 < params < 100_000  # the tiny model: 1 layer, hidden 32
    assert spec.generation == "torch"
    assert "engine: auto" in spec.generation_reason and "parameters" in spec.generation_reason
    assert any("rollouts on torch" in r.getMessage() and "auto_min_params" in r.getMessage() for r in caplog.records)
    assert estimate_engine_bytes(load_job(cfg).config) == 0  # no vLLM engine in the service's budget


def test_count_parameters_reads_the_safetensors_headers(tiny_config: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    spec = prepare_job(load_job(tiny_config))
    model = AutoModelForCausalLM.from_pretrained(str(spec.model_path), dtype=torch.float32)
    saved = {id(p): p.numel() for p in model.parameters()}  # tied weights counted once, as saved
    assert count_parameters(spec.model_path) == sum(saved.values())
    with pytest.raises(FileNotFoundError):
        count_parameters(Path(spec.model_path).parent)


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make setup-vllm)")
def test_a_model_over_the_threshold_goes_to_vllm(tiny_config: dict[str, Any]) -> None:
    cfg = copy.deepcopy(tiny_config)
    cfg.update(engine="auto", model={"layers": 1, "hidden": 64, "heads": 2, "intermediate": 64})  # head size 32
    cfg["vllm"] = {"auto_min_params": 1000, "kv_cache_mb": 16}
    loaded = load_job(cfg)
    spec = prepare_job(loaded)
    assert count_parameters(spec.model_path) >= 1000
    assert resolve_engine(loaded.config, spec.model_path)[0] == spec.generation == "vllm"
    assert "large enough" in spec.generation_reason
    assert estimate_engine_bytes(loaded.config) >= 16 * 2**20
