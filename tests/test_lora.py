"""LoRA jobs over one shared base (plexrl/engines/lora.py), with the real SmolLM2 tokenizer on a tiny model:

- a LoRA job's state is its adapter and optimizer only; it round-trips through every tier bit-exactly while
  the base, loaded once per service and shared, never changes;
- two LoRA jobs on one base, multiplexed on one service whose device budget holds the base and ONE adapter
  state (so every switch swaps adapters), learn exactly what each learns alone.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY, local_runner, stable

from plexrl.errors import ConfigError
from plexrl.job.load import load_job
from plexrl.job.spec import JobRun, JobSpec, prepare_job
from plexrl.planner.state import Move
from plexrl.runtime import Budgets
from plexrl.services.service import Service
from plexrl.services.swap import checksum
from plexrl.sizes import model_bytes


def lora_job(model: Path, run_dir: Path, name: str, seed: int, iterations: int = 3) -> dict[str, Any]:
    cfg = copy.deepcopy(TINY)
    cfg.update(name=name, seed=seed, iterations=iterations, run_dir=str(run_dir), engine="torch")
    cfg["model"] = {"path": str(model), "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
    cfg["warm_start"] = {"enabled": False}
    cfg["tracking"].update(mlflow=False, log_model=True)
    cfg["pipeline"] = {"nodes": [
        {"name": "prompts", "op": "sample_prompts", "params": {"batch_size": 4}},
        {"name": "rollout", "op": "rollout", "inputs": {"prompts": "prompts"}, "params": {"n": 4, "max_new_tokens": 4}},
        {"name": "verify", "op": "verify", "inputs": {"rollouts": "rollout"}},
        {"name": "shaped", "op": "user_ops:first_token_parity", "inputs": {"rollouts": "rollout", "rewards": "verify"}},
        {"name": "advantage", "op": "grpo_advantage", "inputs": {"rollouts": "rollout", "rewards": "shaped"}},
        {"name": "ref", "op": "logprob", "inputs": {"rollouts": "rollout"}, "params": {"which": "reference"}},
        {"name": "train", "op": "train", "params": {"kl": {"coef": 0.05}, "optimiser": {"lr": 1e-2}},
         "inputs": {"rollouts": "rollout", "advantages": "advantage", "ref_logprobs": "ref"}},
    ]}  # fmt: skip
    return cfg


@pytest.fixture(scope="module")
def specs(smol_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> list[JobSpec]:
    run_dir = tmp_path_factory.mktemp("lora") / "runs"
    return [prepare_job(load_job(lora_job(smol_tiny, run_dir, n, s))) for n, s in (("la", 0), ("lb", 1))]


def snapshot(service: Service, job_id: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in service.engines[job_id].state_tensors().items()}


def test_a_lora_state_is_adapter_and_optimizer_and_the_base_is_shared_untouched(
    specs: list[JobSpec], tmp_path: Path
) -> None:
    a, b = specs
    assert a.engine() == b.engine() and a.engine() is not None  # one shared base, counted once per service
    svc = Service("s0", spill_dir=tmp_path / "spill", validate=True)
    size_a, _ = svc.load_job(a), svc.load_job(b)
    (base,) = svc.bases.values()
    assert svc.engines[a.job_id].shared is svc.engines[b.job_id].shared is base
    names = set(svc.engines[a.job_id].state_tensors())
    assert names and all(n.startswith(("adapter.", "optimizer.")) for n in names)
    assert all(".lora_" in n for n in names if n.startswith("adapter."))
    assert size_a <= a.state_bytes() and size_a * 20 < base.nbytes() <= model_bytes(a.model_path)
    before_base = checksum(base.base_tensors())
    # a trained adapter: one optimizer step on job a, then its state through every tier while b runs
    engine = svc.engines[a.job_id]
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def loss_fn(mb: dict[str, torch.Tensor], logp: torch.Tensor, ent: torch.Tensor) -> Any:
        return -logp.mean(), {}

    engine.train_step(batch, loss_fn, temperature=1.0, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0, minibatches=1)
    names = set(engine.state_tensors())
    assert any(n.startswith("optimizer.") for n in names)
    trained = snapshot(svc, a.job_id)
    j = a.job_id
    moved = svc.apply([Move(j, "device", "host", 0), Move(j, "host", "disk", 0)])
    assert all(t.numel() == 0 for t in engine.state_tensors().values())
    svc.engines[b.job_id].generate([[1, 5, 6]], n=2, temperature=1.0, max_new_tokens=3, seed=0)
    svc.apply([Move(j, "disk", "device", 0)])
    after = snapshot(svc, j)
    assert after.keys() == trained.keys() and all(torch.equal(after[k], trained[k]) for k in trained)
    assert moved == 2 * sum(t.numel() * 4 for t in trained.values())  # adapter and moments only
    assert checksum(base.base_tensors()) == before_base  # training and swaps never touched the base
    svc.release(a.job_id)
    assert svc.bases  # b still uses it
    svc.release(b.job_id)
    assert not svc.bases  # freed with the last LoRA job
    svc.close()


def test_two_lora_jobs_on_one_base_learn_exactly_as_alone(specs: list[JobSpec]) -> None:
    from safetensors.torch import load_file

    def adapter(run: JobRun) -> dict[str, torch.Tensor]:
        return load_file(str(Path(run.artifacts["model"]) / "adapter_model.safetensors"))

    alone = []
    for spec in specs:
        (run,) = local_runner().run([spec])
        assert run.status == "done", run.error
        alone.append((stable(run.history), adapter(run)))
    assert alone[0][0][1]["train/loss"] != alone[0][0][2]["train/loss"]  # the adapter really learns
    assert alone[0][0] != alone[1][0]
    _, base_bytes = specs[0].engine() or ("", 0)
    state = max(s.state_bytes() for s in specs)
    runner = local_runner(services=1, budgets=Budgets(device=base_bytes + state, host=state))
    runs = runner.run(specs)
    assert [r.status for r in runs] == ["done", "done"], [r.error for r in runs]
    for run, (history, weights) in zip(runs, alone, strict=True):
        assert stable(run.history) == history
        got = adapter(run)
        assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    report = runner.service_reports["service-0"]
    assert report["moves"] >= 2 and 0 < report["bytes_to_tier"].get("device", 0) < base_bytes


def test_lora_refuses_what_it_cannot_do(smol_tiny: Path, tmp_path: Path) -> None:
    cfg = lora_job(smol_tiny, tmp_path / "runs", "lv", 0)
    cfg["engine"] = "vllm"  # accepted with an adapter vLLM can apply (tests/test_lora_vllm.py); not this rank
    cfg["model"]["lora"]["r"] = 600
    with pytest.raises(ConfigError, match="vLLM serves LoRA ranks up to 512"):
        load_job(cfg)
    cfg = lora_job(smol_tiny, tmp_path / "runs", "lp", 0)
    cfg["pipeline"] = {"name": "ppo"}
    with pytest.raises(ConfigError, match="a LoRA job has no critic"):
        load_job(cfg)


def test_a_cluster_budget_counts_a_lora_job_as_its_adapter_state_beside_one_base(
    smol_tiny: Path, tmp_path: Path
) -> None:
    """services.device_memory of base + one adapter state admits two LoRA jobs (they share the base; every
    switch swaps adapters); below the base + one state, the error names the base."""
    import yaml

    from plexrl.cluster import load_cluster
    from plexrl.sizes import lora_state_bytes, model_bytes

    jobs = [{"job": lora_job(smol_tiny, tmp_path / "runs", n, s)} for n, s in (("la", 0), ("lb", 1))]
    state = lora_state_bytes(smol_tiny, 4, ["q_proj", "v_proj"])
    base = model_bytes(smol_tiny)
    assert state * 20 < base  # full-model accounting (weights + 2 moments) would need 60x the adapter

    def cluster(budget: int) -> Path:
        path = tmp_path / f"c{budget}.yaml"
        services = {"count": 1, "device_memory": budget}
        doc = {"name": "c", "driver": "local", "services": services, "mlflow": False, "jobs": jobs}
        path.write_text(yaml.safe_dump(doc))
        return path

    loaded = load_cluster(cluster(base + state))
    assert [j.config.name for j in loaded.jobs] == ["la", "lb"]
    with pytest.raises(ConfigError, match=r"adapter, 2 AdamW moments.*for its base"):
        load_cluster(cluster(base + state // 2))


def test_a_lora_engine_stops_at_every_eos_of_the_generation_config(smol_tiny: Path, tmp_path: Path) -> None:
    """Like the full engine: a second eos id listed in generation_config.json ends a LoRA job's rows too."""
    import json
    import shutil

    from plexrl.engines.lora import LoRAEngine, SharedBase

    model = tmp_path / "model"
    shutil.copytree(smol_tiny, model)
    config = model / "generation_config.json"
    gen = json.loads(config.read_text()) if config.is_file() else {}
    base = SharedBase(model, torch.device("cpu"), "eager")
    plain = LoRAEngine(base, "plain", eos_id=2, pad_id=2, r=4, alpha=8, dropout=0.0, targets=["q_proj"], seed=0)
    out = plain.generate([[1, 520, 9531, 198]] * 4, n=1, temperature=1.0, max_new_tokens=8, seed=0)
    second = int(out.response_ids[0, 0])  # a token some row really samples first
    assert second != 2 and second not in plain.extra_eos
    gen["eos_token_id"] = [2, second]
    config.write_text(json.dumps(gen))
    stopped = LoRAEngine(base, "stopped", eos_id=2, pad_id=2, r=4, alpha=8, dropout=0.0, targets=["q_proj"], seed=0)
    assert stopped.extra_eos == (second,)
    again = stopped.generate([[1, 520, 9531, 198]] * 4, n=1, temperature=1.0, max_new_tokens=8, seed=0)
    assert int(again.lengths[0]) == 1 and int(again.response_ids[0, 0]) == second  # ended at the second eos
