"""vLLM options of a real job: prefix caching on, `max_model_len` set to the job's prompt + response budget
(not the model's positions), and every eos id of the model's generation config as a stop token; generations
stay identical to the torch engine's. Skipped where vLLM is not installed."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from plexrl.engines.torch_engine import TorchEngine
from plexrl.engines.vllm_engine import SharedLLM, VLLMEngine, vllm_installed
from plexrl.job.model_config import ModelConfig
from plexrl.job.models import build_model, build_tokenizer

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make setup-vllm)")

BUDGET = 40  # prompt + response tokens the engine serves; the model has 512 positions


def prompts(tok: Any) -> list[list[int]]:
    return [tok(f"{11 * i + 3}+{7 * i + 5}=")["input_ids"] for i in range(6)]


def responses(gen: Any) -> list[list[int]]:
    return [gen.response_ids[i, : int(gen.lengths[i])].tolist() for i in range(len(gen.lengths))]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny model whose generation config lists a second eos id: a token its greedy answers contain."""
    d = tmp_path_factory.mktemp("vllm-options")
    tok = build_tokenizer(d)
    build_model(ModelConfig(layers=1, hidden=64, heads=2, intermediate=128, max_position=512), tok, d, seed=0)
    plain = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    out = plain.generate(prompts(tok), n=1, temperature=1.0, max_new_tokens=8, seed=0, greedy=True)
    second = Counter(t for r in responses(out) for t in r if t != tok.eos_token_id).most_common(1)[0][0]
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [tok.eos_token_id, second]
    (d / "generation_config.json").write_text(json.dumps(gen))
    llm = SharedLLM(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, kv_cache_bytes=8 * 2**20, max_model_len=BUDGET)
    yield d, tok, llm, second, responses(out)
    llm.shutdown()


def test_prefix_caching_is_on_and_max_model_len_is_the_jobs_budget(setup: Any) -> None:
    _, _, llm, _, _ = setup
    config = llm.llm.llm_engine.vllm_config
    assert config.cache_config.enable_prefix_caching is True
    assert config.model_config.max_model_len == BUDGET == llm.max_model_len
    with pytest.raises(ValueError, match=rf"exceeds the model's {BUDGET} positions"):
        llm.generate([[1] * 30], n=1, temperature=1.0, max_new_tokens=11, seed=0)


def test_generations_equal_the_torch_engines_and_stop_at_every_eos(setup: Any) -> None:
    d, tok, llm, second, unstopped = setup
    trainer = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    assert llm.eos_ids == (tok.eos_token_id, second) and trainer.extra_eos == (second,)
    engine = VLLMEngine(trainer, llm, "options")
    greedy: dict[str, Any] = {"n": 1, "temperature": 1.0, "max_new_tokens": 8, "seed": 0, "greedy": True}
    ours, theirs = engine.generate(prompts(tok), **greedy), trainer.generate(prompts(tok), **greedy)
    assert responses(ours) == responses(theirs) and ours.finish_reasons == theirs.finish_reasons
    cut = [r[: next(j for j, t in enumerate(r) if t in (tok.eos_token_id, second)) + 1] for r in unstopped]
    assert responses(ours) == cut and any(r[-1] == second for r in cut)  # rows ended at the second eos
    # sampled: the same seed gives the same samples when the prompts' blocks come from the prefix cache
    sampled: dict[str, Any] = {"n": 4, "temperature": 1.0, "max_new_tokens": 8, "seed": 5}
    first = engine.generate(prompts(tok), **sampled)
    assert responses(engine.generate(prompts(tok), **sampled)) == responses(first)


def test_the_generator_key_separates_engines_of_other_lengths(setup: Any) -> None:
    from plexrl.engines.vllm_engine import generator_key

    d = setup[0]
    assert generator_key(d, BUDGET) == generator_key(d, BUDGET) != generator_key(d, 2 * BUDGET)
    assert generator_key(d, None) == generator_key(d) and generator_key(d, BUDGET).startswith(generator_key(d))


def test_a_small_block_size_reuses_a_shared_prefix_and_changes_no_answer(setup: Any) -> None:
    """At vLLM's CPU default (128-token blocks) a 44-token shared prefix is never reused; at 32 (the CPU
    attention's smallest) its first block is, and the answers stay the torch engine's. Engines of other block
    sizes are not shared."""
    from plexrl.engines.vllm_engine import generator_key

    d, tok, _, _, _ = setup
    shared = tok("1+1=2;2+2=4;3+3=6;4+4=8;5+5=10;6+6=12;7+7=14;")["input_ids"]
    asks = [shared + tok(f"{i}+{i}=")["input_ids"] for i in range(4)]
    llm = SharedLLM(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, kv_cache_bytes=8 * 2**20, max_model_len=96,
                    block_size=32)  # fmt: skip
    try:
        assert len(shared) > 32 and llm.llm.llm_engine.vllm_config.cache_config.block_size == 32
        trainer = TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
        engine = VLLMEngine(trainer, llm, "blocks")
        greedy: dict[str, Any] = {"n": 1, "temperature": 1.0, "max_new_tokens": 8, "seed": 0, "greedy": True}
        assert responses(engine.generate(asks, **greedy)) == responses(trainer.generate(asks, **greedy))
        assert responses(engine.generate(asks, **greedy)) == responses(trainer.generate(asks, **greedy))  # cached
    finally:
        llm.shutdown()
    assert generator_key(d, 96, 32) != generator_key(d, 96) != generator_key(d, 96, 64)
