"""The vLLM engine's context and KV cache sized from the job (plexrl/job/generation.py): decisions tested on
a model directory that holds only SmolLM2-135M's config.json (no weights, no vLLM)."""

from __future__ import annotations

import doctest
import json
from pathlib import Path
from typing import Any

import pytest

import plexrl.job.generation as generation
from plexrl.job.generation import generation_sizes, sizing_problems
from plexrl.job.load import load_job

SMOL = {  # SmolLM2-135M-Instruct's config.json, the fields that size its KV cache and context
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "max_position_embeddings": 8192,
}


@pytest.fixture
def smol_config(tmp_path: Path) -> Path:
    model = tmp_path / "smol"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOL))
    return model


def job(model: Path, tmp_path: Path, vllm: dict[str, Any] | None = None, **data: Any) -> Any:
    (tmp_path / "t.jsonl").write_text('{"prompt": "q", "answer": "1"}\n')
    raw = {
        "model": {"path": str(model)},
        "engine": "torch",  # the checks below are the vLLM engine's sizes, decided without it
        "warm_start": {"enabled": False},
        "data": {"train": str(tmp_path / "t.jsonl"), **data},
        "pipeline": {"name": "grpo", "params": {"batch_size": 4, "n": 4, "max_new_tokens": 24}},
        "vllm": vllm or {},
    }
    return load_job(raw)


def test_the_tutorial_job_gets_its_own_context_and_a_cache_for_its_batch(smol_config: Path, tmp_path: Path) -> None:
    """Before: without max_prompt_tokens the engine was built for the model's 8,192 positions in 64 MiB (one
    such sequence needs 360 MiB). Sized from the job: the longest prompt (80 tokens) + 24 new, and 16 rows of
    one 128-token block each at 45 KiB a token."""
    loaded = job(smol_config, tmp_path)
    sizes = generation_sizes(loaded.config, loaded.graph, smol_config, longest_prompt=80)
    assert sizes.max_model_len == 104 and sizes.prompt_source == "the longest rendered prompt of the data"
    assert sizes.per_token == 46080 and sizes.rows == 16
    assert sizes.kv_cache_bytes == 90 * 2**20  # 16 x 128 x 46080 bytes
    assert sizing_problems(loaded.config, loaded.graph, smol_config, 80) == []
    bounded = job(smol_config, tmp_path, max_prompt_tokens=300)
    assert generation_sizes(bounded.config, bounded.graph, smol_config, 80).max_model_len == 324
    blocks = job(smol_config, tmp_path, {"block_size": 32})
    assert generation_sizes(blocks.config, blocks.graph, smol_config, 80).kv_cache_bytes == 16 * 128 * 46080


def test_a_prompt_longer_than_the_model_is_refused_naming_both_numbers(smol_config: Path, tmp_path: Path) -> None:
    loaded = job(smol_config, tmp_path)
    (problem,) = sizing_problems(loaded.config, loaded.graph, smol_config, longest_prompt=8180)
    assert problem.where == "data.max_prompt_tokens"
    assert "(8180 tokens) + rollout.max_new_tokens (24) = 8204 positions, more than the model's 8192" in problem.message
    assert "set data.max_prompt_tokens" in problem.message


def test_a_kv_cache_set_too_small_for_one_sequence_is_refused(smol_config: Path, tmp_path: Path) -> None:
    loaded = job(smol_config, tmp_path, {"kv_cache_mb": 4}, max_prompt_tokens=1000)
    sizes = generation_sizes(loaded.config, loaded.graph, smol_config)
    assert sizes.kv_cache_bytes == 4 * 2**20 and sizes.max_model_len == 1024
    (problem,) = sizing_problems(loaded.config, loaded.graph, smol_config)
    assert problem.where == "vllm.kv_cache_mb"
    assert "one sequence of 1024 tokens needs 45.0 MiB of KV cache but vllm.kv_cache_mb is 4 MiB" in problem.message
    assert "raise vllm.kv_cache_mb to at least 45 (the rollout batch of 16 rows at once: 720)" in problem.message


def test_the_doctests() -> None:
    assert doctest.testmod(generation).failed == 0
