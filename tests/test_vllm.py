"""vLLM as the rollout engine (skipped with a reason where vLLM is not installed; CI installs it).

- parity: with fp32 weights, vLLM's greedy generations equal the torch engine's token for token, before and
  after a training step (so the weight sync works), and the log-probs of sampled tokens agree within 1e-4;
- sharing: two jobs with different weights on ONE SharedLLM each get exactly what their own weights give
  alone, across several swaps (no cross-talk);
- a job end to end on vLLM: weight loads on the timeline and in the metrics, the resolved engine in MLflow,
  and the same job multiplexed with another one on a shared engine learns exactly as alone;
- an engine failure fails that job only; no process is left after shutdown; the process state vLLM
  changes (torch threads, global RNG) is restored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from test_multiplex import learning_job, stable

from plexrl.engines.torch_engine import TorchEngine
from plexrl.engines.vllm_engine import SharedLLM, VLLMEngine, generator_key, vllm_installed
from plexrl.errors import ConfigError
from plexrl.job.load import load_job
from plexrl.job.model_config import ModelConfig
from plexrl.job.models import build_model, build_tokenizer
from plexrl.job.spec import prepare_job

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make setup-vllm)")

# head size 32: vLLM's CPU attention supports 32, 64, 80, ... (the TINY model's 16 is not)
MODEL = {"layers": 1, "hidden": 64, "heads": 2, "intermediate": 128}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    d = tmp_path_factory.mktemp("vllm-model")
    tok = build_tokenizer(d)
    build_model(ModelConfig(**MODEL), tok, d, seed=0)
    return d, tok


@pytest.fixture(scope="module")
def llm(model_dir: tuple[Path, Any]) -> Any:
    d, tok = model_dir
    shared = SharedLLM(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, kv_cache_bytes=16 * 2**20)
    yield shared
    shared.shutdown()


def trainer(model_dir: tuple[Path, Any]) -> TorchEngine:
    d, tok = model_dir
    return TorchEngine(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, attention="eager")


def prompts(tok: Any, k: int = 12) -> list[list[int]]:
    return [tok(f"{11 * i + 3}+{7 * i + 5}=")["input_ids"] for i in range(k)]


def responses(gen: Any) -> list[list[int]]:
    return [gen.response_ids[i, : int(gen.lengths[i])].tolist() for i in range(len(gen.lengths))]


def a_training_step(engine: TorchEngine, ids: torch.Tensor) -> None:
    def loss_fn(mb: dict[str, torch.Tensor], logp: torch.Tensor, ent: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return -(logp * mb["attention_mask"]).sum() / mb["attention_mask"].sum(), {}

    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    engine.train_step(batch, loss_fn, temperature=1.0, lr=0.05, weight_decay=0.0, max_grad_norm=1.0, minibatches=1)


def test_greedy_matches_torch_before_and_after_a_training_step(model_dir: tuple[Path, Any], llm: Any) -> None:
    _, tok = model_dir
    torch_engine = trainer(model_dir)
    engine = VLLMEngine(torch_engine, llm, "parity")
    ps = prompts(tok)
    kw: dict[str, Any] = {"n": 1, "temperature": 1.0, "max_new_tokens": 8, "seed": 0, "greedy": True}
    before = responses(engine.generate(ps, **kw))
    assert before == responses(torch_engine.generate(ps, **kw))
    seven = tok("7")["input_ids"][-1]
    ids = torch.tensor([p + [seven] * 4 for p in ps if len(p) == len(ps[0])])  # teach it to answer 7777
    for _ in range(3):
        a_training_step(torch_engine, ids)
    assert torch_engine.weight_version == 3
    after = responses(engine.generate(ps, **kw))
    assert after == responses(torch_engine.generate(ps, **kw))
    assert after != before, "training should change some greedy output (else the sync is untested)"
    loads = engine.take_loads()
    assert [(w.kind, w.version) for w in loads] == [("swap", 0), ("sync", 3)]
    assert all(w.nbytes > 0 and w.end >= w.start for w in loads)


def test_sampled_logprobs_agree_with_torch(model_dir: tuple[Path, Any], llm: Any) -> None:
    _, tok = model_dir
    torch_engine = trainer(model_dir)
    engine = VLLMEngine(torch_engine, llm, "logprobs")
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.9)):
        gen = engine.generate(prompts(tok), n=4, temperature=temperature, max_new_tokens=8, seed=3, top_p=top_p)
        ids = torch.cat([gen.prompt_ids, gen.response_ids], 1)
        mask = torch.cat([gen.prompt_mask, gen.response_mask], 1)
        if top_p == 1.0:  # the torch engine scores the full distribution; with top-p vLLM renormalises
            lp = torch_engine.logprobs(ids, mask, temperature=temperature)[:, gen.prompt_ids.shape[1] :]
            diff = ((lp - gen.logprobs) * gen.response_mask).abs().max()
            assert float(diff) < 1e-4
        assert bool((gen.logprobs * gen.response_mask <= 0).all())
        again = engine.generate(prompts(tok), n=4, temperature=temperature, max_new_tokens=8, seed=3, top_p=top_p)
        assert responses(again) == responses(gen)  # same seed, same samples


def test_stop_strings_and_stop_tokens_end_responses_like_the_torch_engine(
    model_dir: tuple[Path, Any], llm: Any
) -> None:
    _, tok = model_dir
    torch_engine = trainer(model_dir)
    ps = prompts(tok)
    target = tok("1234")["input_ids"][-4:]
    ids = torch.tensor([p + target for p in ps if len(p) == len(ps[0])])
    for _ in range(8):  # teach it to answer 1234
        a_training_step(torch_engine, ids)
    engine = VLLMEngine(torch_engine, llm, "stops")
    greedy = {"n": 1, "temperature": 1.0, "max_new_tokens": 8, "seed": 0, "greedy": True}
    full = responses(torch_engine.generate(ps, **greedy))
    assert full[0][:2] == target[:2], "the taught answer (12...) is what this test stops in"
    for kw in ({"stop": ["2"]}, {"stop_token_ids": [target[1]]}):
        ours, theirs = engine.generate(ps, **greedy, **kw), torch_engine.generate(ps, **greedy, **kw)
        assert responses(ours) == responses(theirs)
        assert ours.finish_reasons == theirs.finish_reasons
        assert len(responses(ours)[0]) == 2 and ours.finish_reasons[0] == "stop"


def test_two_jobs_share_one_engine_without_cross_talk(model_dir: tuple[Path, Any], llm: Any) -> None:
    _, tok = model_dir
    a, b = trainer(model_dir), trainer(model_dir)
    with torch.no_grad():  # job b has other weights
        for p in b.policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    ea, eb = VLLMEngine(a, llm, "job-a"), VLLMEngine(b, llm, "job-b")
    ps = prompts(tok, 6)
    kw: dict[str, Any] = {"n": 2, "temperature": 1.0, "max_new_tokens": 6, "seed": 7}
    alone_a, alone_b = responses(ea.generate(ps, **kw)), responses(eb.generate(ps, **kw))
    assert alone_a != alone_b
    greedy_b = responses(b.generate(ps, n=1, temperature=1.0, max_new_tokens=6, seed=0, greedy=True))
    loads_before = llm.loads
    for _ in range(3):  # alternate: every call swaps the other job's weights out
        assert responses(ea.generate(ps, **kw)) == alone_a
        assert responses(eb.generate(ps, **kw)) == alone_b
        assert responses(eb.generate(ps, n=1, temperature=1.0, max_new_tokens=6, seed=0, greedy=True)) == greedy_b
    assert llm.loads - loads_before == 6
    assert {w.kind for w in ea.take_loads() + eb.take_loads()} == {"swap"}


def test_batches_larger_than_one_scheduler_step_generate(model_dir: tuple[Path, Any], llm: Any) -> None:
    """More prompt tokens than one vLLM step takes (4096): with chunked prefill a seeded request split across
    steps made vLLM rewind a CPU generator and fail (seen in multi-turn episodes)."""
    _, tok = model_dir
    many = [tok(f"{i}+{10000 - i}={i * 7}+{i % 97}=")["input_ids"] for i in range(1000, 1400)]
    assert sum(len(p) for p in many) > 4096
    gen = VLLMEngine(trainer(model_dir), llm, "big").generate(many, n=1, temperature=1.0, max_new_tokens=4, seed=5)
    assert gen.response_ids.shape[0] == 400 and bool((gen.lengths > 0).all())


def test_shutdown_leaves_no_process_and_restores_process_state(model_dir: tuple[Path, Any]) -> None:
    d, tok = model_dir
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. helpers of earlier tests
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    threads = torch.get_num_threads()
    shared = SharedLLM(d, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, kv_cache_bytes=8 * 2**20)
    assert torch.equal(torch.rand(3), expected), "building the engine must not reseed the global RNG"
    assert torch.get_num_threads() == threads
    torch.set_num_threads(1)  # vLLM's CPU worker replaces this with a no-op; it must still work
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads)
    shared.generate(prompts(tok, 2), n=1, temperature=1.0, max_new_tokens=4, seed=0)
    shared.shutdown()
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before] == []


def test_generator_key_groups_same_architecture(model_dir: tuple[Path, Any], tmp_path: Path) -> None:
    d, tok = model_dir
    other = tmp_path / "other"
    build_model(ModelConfig(**MODEL), tok, other, seed=5)  # other weights, same architecture
    tok.save_pretrained(str(other))
    bigger = tmp_path / "bigger"
    build_model(ModelConfig(**{**MODEL, "layers": 2}), tok, bigger, seed=0)
    tok.save_pretrained(str(bigger))
    assert generator_key(d) == generator_key(other) != generator_key(bigger)


def vllm_job(run_dir: Path, name: str, seed: int, iterations: int = 3) -> dict[str, Any]:
    """test_multiplex's tiny job with a learning signal (a length penalty), on vLLM."""
    cfg = learning_job(run_dir, name, seed, iterations)
    cfg.update(engine="vllm", model=dict(MODEL), vllm={"kv_cache_mb": 16})
    return cfg


def test_job_on_vllm_end_to_end_and_multiplexed_on_a_shared_engine(tmp_path: Path) -> None:
    from conftest import local_runner

    from plexrl.hooks.timeline import TimelineRecorder
    from plexrl.runtime import Budgets

    run_dir = tmp_path / "runs"
    cfg = vllm_job(run_dir, "a", 0)
    cfg["tracking"]["mlflow"] = True
    timeline = TimelineRecorder(tmp_path / "tl", draw=False)
    from plexrl.hooks.mlflow_hook import MlflowHook

    (alone,) = local_runner(hooks=[timeline, MlflowHook()]).run([prepare_job(load_job(cfg))])
    assert alone.status == "done", alone.error
    assert alone.spec.generation == "vllm"
    loads = [s for s in timeline.spans if s.kind == "weights"]
    # the first load, then one sync per update (each is followed by a generation: evaluate or rollout)
    assert [s.node for s in loads] == ["weight swap"] + ["weight sync"] * 3
    assert all(row.get("time/weight_sync", 0) > 0 for row in alone.history[2:])
    import mlflow

    run = mlflow.MlflowClient(f"sqlite:///{run_dir}/mlflow.db").get_run(alone.tracking["run_id"])
    assert run.data.params["engine"] == "vllm" and run.data.params["engine.resolved"] == "vllm"

    jobs = [prepare_job(load_job(vllm_job(run_dir, n, s))) for n, s in (("a", 0), ("b", 1))]
    assert jobs[0].engine() == jobs[1].engine()  # same architecture: one engine on the service
    size = max(j.state_bytes() for j in jobs)
    engine_bytes = jobs[0].engine()[1]  # type: ignore[index]
    runner = local_runner(budgets=Budgets(device=size + engine_bytes, host=size))  # one state + the engine
    done = runner.run(jobs)
    assert [j.status for j in done] == ["done", "done"], [j.error for j in done]
    assert stable(done[0].history) == stable(alone.history)
    assert any(row.get("train/grad_norm", 0) > 0 for row in alone.history)  # the weights really changed
    service = runner.service_reports["service-0"]
    assert service["moves"] > 0  # the states were swapped too
    assert service["generation_engines"] == 0  # shut down once its last job ended


def test_an_engine_failure_fails_that_job_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import local_runner

    jobs = [prepare_job(load_job(vllm_job(tmp_path / "runs", n, s))) for n, s in (("bad", 0), ("good", 1))]
    real = SharedLLM.generate_calls  # (every generation goes through it)
    calls = {"n": 0}

    def crash_once_for_bad(self: SharedLLM, *args: Any, **kw: Any) -> Any:
        if self.holds is not None and self.holds[0] == "bad" and calls["n"] == 0:
            calls["n"] += 1
            raise RuntimeError("EngineCore died: simulated")  # a fault inside vLLM
        return real(self, *args, **kw)

    monkeypatch.setattr(SharedLLM, "generate_calls", crash_once_for_bad)
    bad, good = local_runner().run(jobs)
    assert bad.status == "failed" and "vLLM engine failed" in bad.error and "EngineCore died" in bad.error
    assert good.status == "done", good.error
    assert good.iterations_done == 3


def test_engine_vllm_is_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = vllm_job(tmp_path, "x", 0)
    cfg["model"] = {"layers": 1, "hidden": 32, "heads": 2, "intermediate": 64}  # head size 16
    with pytest.raises(ConfigError) as err:
        load_job(cfg)
    assert "head sizes" in str(err.value) and "engine: torch" in str(err.value)
    cfg["engine"] = "auto"  # auto falls back to torch, and says why (whatever the model's size)
    cfg["vllm"] = {"auto_min_params": 0}
    job = prepare_job(load_job(cfg))
    assert job.generation == "torch" and "head sizes" in job.generation_reason
    import plexrl.engines.vllm_engine as ve

    monkeypatch.setattr(ve, "vllm_installed", lambda: False)  # a machine without vLLM
    cfg["engine"] = "vllm"
    cfg["model"] = dict(MODEL)
    with pytest.raises(ConfigError) as err:
        load_job(cfg)
    assert "vLLM is not installed" in str(err.value) and "make setup-vllm" in str(err.value)
