"""Partial rollouts on vLLM (decode-step preemption, `plexrl/engines/partial.py`), through the path a sliced
rollout node takes (`plexrl.engines.slicing.generate_slice`), on a tiny local model (skipped where vLLM is not
installed):

- greedy: slices of 1 and 3 tokens give exactly the unsliced generation (tokens, lengths, finish reasons),
  also when another job's weights are loaded into the shared engine between two slices (this job's are
  loaded again before its next slice) and when a stop string spans two slices;
- sampled: each row gets at most K tokens per slice, the result is the same in two runs (seeded per row and
  slice), and every token carries the weight version of its slice.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plexrl.engines.slicing import SlicePaused, SliceSlot, generate_slice, token_versions
from plexrl.engines.torch_engine import TorchEngine
from plexrl.engines.vllm_engine import SharedLLM, VLLMEngine, vllm_installed
from plexrl.job.model_config import ModelConfig
from plexrl.job.models import build_model, build_tokenizer

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make setup-vllm)")

MODEL = {"layers": 1, "hidden": 64, "heads": 2, "intermediate": 128}  # head size 32: vLLM CPU attention


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp("partial-model")
    tok = build_tokenizer(d)
    build_model(ModelConfig(**MODEL), tok, d, seed=0)
    llm = SharedLLM(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, kv_cache_bytes=16 * 2**20)
    yield d, tok, llm
    llm.shutdown()


def engine(setup: Any, job: str, seed: int = 0) -> VLLMEngine:
    d, tok, llm = setup
    trainer = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, attention="eager")
    if seed:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            for p in trainer.policy.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return VLLMEngine(trainer, llm, job)


def prompts(tok: Any, k: int = 6) -> list[list[int]]:
    return [tok(f"{11 * i + 3}+{7 * i + 5}=")["input_ids"] for i in range(k)]


def sliced(e: VLLMEngine, steps: int, ps: list[list[int]], between: Any = None, **kw: Any) -> tuple[Any, SliceSlot]:
    slot = SliceSlot(steps)
    while True:
        try:
            return generate_slice(e, slot, ps, **kw), slot
        except SlicePaused:
            if between is not None:
                between()


def same(a: Any, b: Any) -> None:
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.lengths, b.lengths)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and a.finish_reasons == b.finish_reasons


def test_greedy_partial_rollouts_equal_the_unsliced_generation_across_weight_swaps(setup: Any) -> None:
    _, tok, _ = setup
    a, b = engine(setup, "a"), engine(setup, "b", seed=3)
    ps = prompts(tok)
    kw: dict[str, Any] = {"n": 2, "temperature": 1.0, "max_new_tokens": 7, "seed": 0, "greedy": True}
    whole = a.generate(ps, **kw)
    for steps in (1, 3):
        got, slot = sliced(a, steps, ps, between=lambda: b.generate(ps, **kw), **kw)
        same(got, whole)
        assert slot.slices == -(-int(whole.lengths.max()) // steps)  # ceil(longest / K) slices
    kinds = [w.kind for w in a.take_loads()]
    assert kinds.count("swap") >= 2  # a's weights went back in after b's, before a's next slice


def test_a_stop_string_that_spans_two_slices_ends_the_row_where_it_completes(setup: Any) -> None:
    _, tok, _ = setup
    a = engine(setup, "a")
    ps = prompts(tok)
    plain = a.generate(ps, n=1, temperature=1.0, max_new_tokens=8, seed=0, greedy=True)
    texts = [tok.decode(plain.response_ids[i, : int(n)].tolist(), skip_special_tokens=True)
             for i, n in enumerate(plain.lengths)]  # fmt: skip
    text = max(texts, key=len)
    assert len(text) >= 4, texts
    stop = text[2:4]  # two characters a row writes after its first two: they complete in a later slice
    kw: dict[str, Any] = {"n": 1, "temperature": 1.0, "max_new_tokens": 8, "seed": 0, "greedy": True, "stop": [stop]}
    got, _ = sliced(a, 1, ps, **kw)  # one token per slice: the string spans two slices
    same(got, a.generate(ps, **kw))
    assert "stop" in got.finish_reasons


def test_sampled_partial_rollouts_are_seeded_bounded_per_slice_and_record_versions(setup: Any) -> None:
    _, tok, _ = setup
    a = engine(setup, "a")
    ps = prompts(tok)
    kw: dict[str, Any] = {"n": 2, "temperature": 1.0, "max_new_tokens": 6, "seed": 5}
    first, slot = sliced(a, 2, ps, **kw)
    again, _ = sliced(a, 2, ps, **kw)
    same(first, again)
    assert torch.equal(first.logprobs, again.logprobs) and bool((first.logprobs <= 0).all())
    assert slot.slices <= 3 and int(first.lengths.max()) <= 6
    assert slot.versions == [0] * slot.slices  # the engine's weight version at each slice
    slot.versions = [3, 4, 4]  # as if the job had trained between its slices
    versions = token_versions(slot, first.response_mask)
    for i in range(versions.shape[0]):
        n = int(first.lengths[i])
        assert versions[i, :n].tolist() == [3, 3, 4, 4, 4, 4][:n]
        assert bool((versions[i, n:] == -1).all())
