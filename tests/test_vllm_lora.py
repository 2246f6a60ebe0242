"""vLLM's own LoRA serving, checked on the CPU build (skipped where vLLM is not installed): what a LoRA job's
rollouts on vLLM rely on (`plexrl/engines/vllm_lora.py`; the jobs themselves: tests/test_lora_vllm.py).

With fp32 weights and greedy decoding, `LLM(enable_lora=True)` + `LoRARequest` generate exactly what peft
computes for the same adapter: one adapter, a new version of it under a new id (a weight sync after a train
step), and two adapters in ONE generate call (a list of requests, one per prompt: rollouts of several LoRA
jobs batched into one engine call), while the base without a request stays the base."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plexrl.engines.vllm_engine import _import_vllm, _process_state_kept, _quiet, vllm_installed
from plexrl.job.model_config import ModelConfig
from plexrl.job.models import build_model, build_tokenizer

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make setup-vllm)")


def greedy(model: Any, prompts: list[list[int]], pad: int) -> list[list[int]]:
    out = []
    for ids in prompts:
        row = model.generate(
            torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=pad, eos_token_id=None
        )
        out.append(row[0, len(ids) :].tolist())
    return out


def test_vllm_cpu_serves_lora_adapters_as_peft_computes_them_also_two_in_one_call(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer(tmp_path)
    build_model(ModelConfig(layers=1, hidden=64, heads=2, intermediate=128), tok, tmp_path, seed=0)  # head size 32
    gen = torch.Generator().manual_seed(0)
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    prompts = [tok("12+34=")["input_ids"], tok("5+6=")["input_ids"]]
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    peft.save_pretrained(tmp_path / "v1")
    want_v1 = greedy(peft, prompts, tok.pad_token_id)
    with peft.disable_adapter():
        want_base = greedy(peft, prompts, tok.pad_token_id)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_A" in name:
                p.mul_(-1.5)
    peft.save_pretrained(tmp_path / "v2")
    want_v2 = greedy(peft, prompts, tok.pad_token_id)
    assert want_v1 != want_base and want_v2 != want_v1  # the adapters really change the output

    vllm = _import_vllm()
    from vllm.lora.request import LoRARequest

    with _process_state_kept(), _quiet():  # as SharedLLM builds its engine
        llm = vllm.LLM(
            model=str(tmp_path), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=16 * 2**20,
            enable_lora=True, max_lora_rank=8, max_loras=2, seed=0,
        )  # fmt: skip
        try:
            params = vllm.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            rows = [{"prompt_token_ids": p} for p in prompts]

            def run(request: Any = None) -> list[list[int]]:
                return [list(o.outputs[0].token_ids) for o in llm.generate(rows, params, lora_request=request)]

            v1, v2 = LoRARequest("v1", 1, str(tmp_path / "v1")), LoRARequest("v2", 2, str(tmp_path / "v2"))
            assert run(v1) == want_v1
            assert run() == want_base
            assert run(v2) == want_v2  # a new version under a new id
            assert run([v1, v2]) == [want_v1[0], want_v2[1]]  # two adapters in one call, one per prompt
        finally:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
