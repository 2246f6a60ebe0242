"""LoRA jobs rolling out on vLLM (plexrl/engines/vllm_lora.py), on a tiny random Llama with the REAL SmolLM2
tokenizer (head size 32: vLLM's CPU attention has no 16); skipped where vLLM is not installed:

- the rollout's log-probs are what the job's adapter computes: the LoRAEngine's own scoring of the same tokens
  agrees (fp32), and differs from the base's (the adapter is really applied);
- a train step syncs the adapter only: a new version under a fresh id, the old one removed from vLLM and the
  disk, reported as a "sync" WeightLoad of the adapter's bytes; the base is never reloaded;
- two LoRA jobs on one engine get exactly what each gets alone, also with both jobs' rollouts in ONE vLLM call
  (`generate_together`); end to end, two LoRA jobs multiplexed on one
  service with vLLM rollouts learn exactly what each learns alone, the engine and the base loaded once;
- `engine: auto` picks vLLM for a LoRA job by the full job's rule; the planner and the cluster budget count
  the base + the vLLM engine once beside the adapter states.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import local_runner, stable
from test_lora import lora_job

from plexrl.engines.lora import LoRAEngine, SharedBase
from plexrl.engines.vllm_engine import vllm_cpu_build, vllm_installed
from plexrl.errors import ConfigError
from plexrl.job.load import load_job
from plexrl.job.spec import JobRun, prepare_job
from plexrl.sizes import model_bytes

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make setup-vllm)")


@pytest.fixture(scope="module")
def smol32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """conftest's smol_tiny with hidden 64 over 2 heads (head size 32, which vLLM's CPU attention serves)."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from plexrl.job.pretrained import pretrained_path

    real = pretrained_path("smollm2-135m-instruct")
    out = tmp_path_factory.mktemp("smol32")
    tok = AutoTokenizer.from_pretrained(str(real))
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig.from_pretrained(str(real)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llm(smol32: Path) -> Any:
    from plexrl.engines.vllm_lora import SharedLoRALLM

    shared = SharedLoRALLM(smol32, r=4, eos_id=2, pad_id=2, kv_cache_bytes=16 * 2**20)
    yield shared
    shared.shutdown()


def adapter_engine(base: SharedBase, job: str, seed: int) -> LoRAEngine:
    return LoRAEngine(base, job, eos_id=2, pad_id=2, r=4, alpha=8, dropout=0.0, targets=["q_proj", "v_proj"], seed=seed)


def train(engine: LoRAEngine, steps: int, token: int) -> None:
    """`steps` AdamW steps that teach the adapter to follow a prompt with `token` (moves it away from B = 0)."""
    ids = torch.tensor([[1, 520, 9531, 198, token, token], [1, 33, 44, 198, token, token]])

    def loss_fn(mb: dict[str, torch.Tensor], logp: torch.Tensor, ent: torch.Tensor) -> Any:
        return -logp[:, -2:].mean(), {}

    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    for _ in range(steps):
        engine.train_step(batch, loss_fn, temperature=1.0, lr=0.05, weight_decay=0.0, max_grad_norm=1.0, minibatches=1)


PROMPTS = [[1, 520, 9531, 198], [1, 33, 44, 198], [1, 7, 8, 9, 198]]


def scored(engine: LoRAEngine, gen: Any, which: str = "policy") -> torch.Tensor:
    ids = torch.cat([gen.prompt_ids, gen.response_ids], 1)
    mask = torch.cat([gen.prompt_mask, gen.response_mask], 1)
    return engine.logprobs(ids, mask, which=which)[:, gen.prompt_ids.shape[1] :]


def test_rollout_logprobs_are_the_adapters_and_a_sync_moves_the_adapter_only(smol32: Path, llm: Any) -> None:
    from plexrl.engines.vllm_lora import VLLMLoRAEngine

    base = SharedBase(smol32, torch.device("cpu"), "eager")
    trainer = adapter_engine(base, "job-a", 0)
    loads = llm.loads
    train(trainer, 3, 4000)
    engine = VLLMLoRAEngine(trainer, llm, "job-a")
    gen = engine.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=6, seed=3)
    mask = gen.response_mask.bool()
    diff = (scored(trainer, gen) - gen.logprobs).abs()[mask].max()
    assert float(diff) < 1e-4  # the adapter's log-probs of the tokens vLLM sampled
    assert float((scored(trainer, gen, "reference") - gen.logprobs).abs()[mask].max()) > 1e-2  # not the base's
    (first,) = engine.take_loads()
    assert (first.kind, first.version) == ("sync", 3)
    adapter_file = llm.adapters["job-a"].path / "adapter_model.safetensors"
    assert first.nbytes == adapter_file.stat().st_size and 0 < first.nbytes * 20 < model_bytes(smol32)
    old = llm.adapters["job-a"]
    engine.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=4, seed=4)
    assert engine.take_loads() == []  # same version: nothing loaded
    train(trainer, 1, 4000)
    again = engine.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=6, seed=3)
    (sync,) = engine.take_loads()
    assert (sync.kind, sync.version) == ("sync", 4)
    new = llm.adapters["job-a"]
    assert new.request.lora_int_id != old.request.lora_int_id and new.request.lora_name != old.request.lora_name
    assert llm.served() == {new.request.lora_int_id} and not old.path.exists()  # the old version is gone
    assert float((scored(trainer, again) - again.logprobs).abs()[again.response_mask.bool()].max()) < 1e-4
    assert llm.holds is None and llm.loads - loads == 2  # the base was never reloaded: two adapter loads only
    with pytest.raises(RuntimeError, match="base weights never change"):
        llm.load_weights("job-a", 4, [])
    engine.release()
    assert "job-a" not in llm.adapters and llm.served() == set()


def test_two_adapters_on_one_engine_get_what_each_gets_alone(smol32: Path, llm: Any) -> None:
    from plexrl.engines.vllm_lora import VLLMLoRAEngine

    base = SharedBase(smol32, torch.device("cpu"), "eager")
    a, b = adapter_engine(base, "a", 0), adapter_engine(base, "b", 1)
    train(a, 2, 4000)
    train(b, 2, 77)
    ea, eb = VLLMLoRAEngine(a, llm, "a"), VLLMLoRAEngine(b, llm, "b")
    kw: dict[str, Any] = {"n": 2, "temperature": 1.0, "max_new_tokens": 5, "seed": 7}
    alone_a, alone_b = ea.generate(PROMPTS, **kw), eb.generate(PROMPTS, **kw)
    # (a random model's 49k-token distribution is near uniform: the adapters move its log-probs, seldom a sample)
    assert float((alone_a.logprobs - alone_b.logprobs).abs().max()) > 1e-3
    for _ in range(2):  # alternating jobs loads nothing and changes nothing
        for engine, alone in ((ea, alone_a), (eb, alone_b)):
            got = engine.generate(PROMPTS, **kw)
            assert torch.equal(got.response_ids, alone.response_ids) and torch.equal(got.logprobs, alone.logprobs)
    assert len(ea.take_loads()) == len(eb.take_loads()) == 1
    # both jobs' rollouts in ONE vLLM call (what co-scheduled rollouts would use): each gets its own rows
    from plexrl.engines.vllm_lora import generate_together

    kw_b: dict[str, Any] = {"n": 3, "temperature": 0.8, "max_new_tokens": 4, "seed": 9}
    solo_b = eb.generate(PROMPTS[:2], **kw_b)
    both = generate_together([ea, eb], [(PROMPTS, kw), (PROMPTS[:2], kw_b)])
    for got, alone in zip(both, (alone_a, solo_b), strict=True):
        assert torch.equal(got.response_ids, alone.response_ids) and got.finish_reasons == alone.finish_reasons
        torch.testing.assert_close(got.logprobs, alone.logprobs, rtol=0, atol=1e-5)  # batch numerics only
    with pytest.raises(ValueError, match="one call per job"):
        generate_together([ea, ea], [(PROMPTS, kw), (PROMPTS, kw)])
    ea.release()
    eb.release()


def test_a_sliced_rollout_runs_every_slice_under_the_jobs_adapter(smol32: Path, llm: Any) -> None:
    """Decode-step slices (`slices:`, plexrl/engines/partial.py) of a LoRA job on vLLM: each slice is a vLLM
    call under the job's LoRARequest, so the tokens' log-probs are the adapter's, not the base's."""
    from plexrl.engines.slicing import pausable
    from plexrl.engines.vllm_lora import VLLMLoRAEngine

    trainer = adapter_engine(SharedBase(smol32, torch.device("cpu"), "eager"), "sliced", 0)
    train(trainer, 3, 4000)
    engine = VLLMLoRAEngine(trainer, llm, "sliced")
    assert pausable(engine)
    p = engine.begin_generation(PROMPTS, n=2, temperature=1.0, max_new_tokens=6, seed=3)
    while not p.finished:
        engine.resume(p, 2)
    gen = p.output()
    assert p.slices == 3
    mask = gen.response_mask.bool()
    assert float((scored(trainer, gen) - gen.logprobs).abs()[mask].max()) < 1e-4
    assert float((scored(trainer, gen, "reference") - gen.logprobs).abs()[mask].max()) > 1e-2
    engine.release()


def vllm_lora_job(model: Path, run_dir: Path, name: str, seed: int, iterations: int = 2) -> dict[str, Any]:
    cfg = lora_job(model, run_dir, name, seed, iterations)
    cfg.update(engine="vllm", vllm={"kv_cache_mb": 16})
    return cfg


def test_two_lora_jobs_on_one_service_with_vllm_rollouts_learn_exactly_as_alone(smol32: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from plexrl.engines.vllm_lora import lora_engine_bytes
    from plexrl.runtime import Budgets
    from plexrl.sizes import lora_state_bytes

    specs = [prepare_job(load_job(vllm_lora_job(smol32, tmp_path / "runs", n, s))) for n, s in (("la", 0), ("lb", 1))]
    assert [s.generation for s in specs] == ["vllm", "vllm"]
    shared = specs[0].engine()
    assert shared is not None and shared == specs[1].engine()  # one base + one vLLM engine per service
    assert shared[1] == model_bytes(smol32) + lora_engine_bytes(smol32, 4, 16 * 2**20)

    def adapter(run: JobRun) -> dict[str, torch.Tensor]:
        return load_file(str(Path(run.artifacts["model"]) / "adapter_model.safetensors"))

    alone = []
    for spec in specs:
        (run,) = local_runner().run([spec])
        assert run.status == "done", run.error
        alone.append((stable(run.history), adapter(run)))
        assert all(row.get("time/weight_sync", 0) > 0 for row in run.history)  # an adapter sync per rollout
    assert alone[0][0][0]["train/loss"] != alone[0][0][1]["train/loss"] and alone[0][0] != alone[1][0]
    state = lora_state_bytes(smol32, 4, ["q_proj", "v_proj"])
    runner = local_runner(budgets=Budgets(device=shared[1] + state, host=state))  # every switch swaps adapters
    runs = runner.run(specs)
    assert [r.status for r in runs] == ["done", "done"], [r.error for r in runs]
    for run, (history, weights) in zip(runs, alone, strict=True):
        assert stable(run.history) == history
        got = adapter(run)
        assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    report = runner.service_reports["service-0"]
    assert report["moves"] >= 2 and 0 < report["bytes_to_tier"].get("device", 0) < model_bytes(smol32)
    assert report["generation_engines"] == 0  # shut down with the last job


def test_engine_choice_and_budgets_of_a_lora_job_on_vllm(smol32: Path, tmp_path: Path) -> None:
    import yaml

    from plexrl.cluster import load_cluster
    from plexrl.engines.vllm_lora import lora_engine_bytes
    from plexrl.sizes import lora_state_bytes

    cfg = lora_job(smol32, tmp_path / "runs", "auto", 0)
    cfg["engine"] = "auto"  # a 3.2M-parameter base is under vllm.auto_min_params: torch, as for a full job
    spec = prepare_job(load_job(cfg))
    assert spec.generation == "torch" and "auto_min_params" in spec.generation_reason
    alone = spec.engine()
    assert alone is not None and alone[1] == model_bytes(smol32)  # the base alone, no vLLM engine
    cfg["vllm"] = {"auto_min_params": 0}
    spec = prepare_job(load_job(cfg))
    if vllm_cpu_build():  # vLLM's CPU build applies adapters ~3x slower than torch (benchmarks/engine_choice.py)
        assert spec.generation == "torch" and "CPU build" in spec.generation_reason, spec.generation_reason
        cfg["engine"] = "vllm"  # asked for: it is used
        spec = prepare_job(load_job(cfg))
    assert spec.generation == "vllm", spec.generation_reason
    for bad, why in ((600, "LoRA ranks up to 512"), ("lm_head", "vLLM applies adapters to")):
        wrong = vllm_lora_job(smol32, tmp_path / "runs", "bad", 0)
        if bad == 600:
            wrong["model"]["lora"]["r"] = bad
        else:
            wrong["model"]["lora"]["target_modules"] = ["q_proj", bad]
        with pytest.raises(ConfigError, match=why):
            load_job(wrong)
        wrong["engine"] = "auto"  # auto falls back to torch and says why
        wrong["vllm"] = {"auto_min_params": 0}
        fallback = prepare_job(load_job(wrong))
        assert fallback.generation == "torch" and why in fallback.generation_reason

    state = lora_state_bytes(smol32, 4, ["q_proj", "v_proj"])

    def cluster(budget: int) -> Path:
        jobs = [{"job": vllm_lora_job(smol32, tmp_path / "runs", n, s)} for n, s in (("la", 0), ("lb", 1))]
        path = tmp_path / f"c{budget}.yaml"
        doc = {"name": "c", "driver": "local", "services": {"count": 1, "device_memory": budget}, "mlflow": False}
        path.write_text(yaml.safe_dump({**doc, "jobs": jobs}))
        return path

    full = model_bytes(smol32) + lora_engine_bytes(smol32, 4, 16 * 2**20) + state
    assert [j.config.name for j in load_cluster(cluster(full)).jobs] == ["la", "lb"]
    with pytest.raises(ConfigError, match="for its base and its vLLM engine"):  # both bases, no KV cache: short
        load_cluster(cluster(2 * model_bytes(smol32) + state))
