"""The device decisions (`plexrl.devices`) where the code uses them, checked without a GPU:

- the vLLM engines are built with the device's arguments: on a CUDA device (described by hand; `vllm.LLM`
  replaced by a recorder in this unit test of the engine builders) a LoRA job's engine computes in bf16 and
  asks for a `gpu_memory_utilization` that vLLM's start-up check accepts beside the trainer; building one
  leaves the CUDA RNG as it was;
- an engine no job uses sleeps on CUDA and wakes for the next job of its key, instead of a rebuild;
- a job admitted to host is never made on the service's device (here `meta`: nothing built there has data);
- the cluster loader sizes a bf16 job at bf16 size and refuses what a worker group would silently ignore;
- a real local Dask cluster's service workers each see their own GPU list and the CPU pool none."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import yaml
from conftest import TINY

from plexrl.devices import Device, GiB
from plexrl.errors import ConfigError
from plexrl.job.load import load_job
from plexrl.job.model_config import ModelConfig
from plexrl.job.models import build_model, build_tokenizer
from plexrl.planner.state import Move

H100 = Device("cuda", 0, 80 * GiB, 80 * GiB - 50 * GiB, (9, 0), "NVIDIA H100")  # a trainer holds 50 GiB


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    tok = build_tokenizer(out)
    build_model(ModelConfig(layers=1, hidden=64, heads=2, intermediate=128), tok, out, seed=0)
    return out


class RecordedLLM:
    """Stands for `vllm.LLM` in the engine-builder tests: records the arguments, builds nothing."""

    calls: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, **kwargs: Any) -> None:
        RecordedLLM.calls.append(kwargs)
        self.llm_engine = None

    def sleep(self, level: int) -> None:
        RecordedLLM.calls.append({"sleep": level})

    def wake_up(self) -> None:
        RecordedLLM.calls.append({"wake_up": True})

    def reset_prefix_cache(self) -> None:
        pass


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    from plexrl.engines.vllm_engine import _import_vllm, _quiet, vllm_installed

    if not vllm_installed():
        pytest.skip("vLLM is not installed (make setup-vllm)")
    vllm = _import_vllm()
    RecordedLLM.calls = []
    with _quiet():  # vLLM imports `LLM` lazily, with warnings no caller can act on
        monkeypatch.setattr(vllm, "LLM", RecordedLLM)
    return RecordedLLM.calls


def test_a_lora_engine_on_cuda_is_built_in_bf16_within_what_vllm_starts_with(
    model_dir: Path, recorded: list[dict[str, Any]]
) -> None:
    """A1, A2, B8, C1: what `SharedLoRALLM` hands vLLM on a CUDA device for a bf16 job (the CUDA default)."""
    from plexrl.devices import vllm_need
    from plexrl.engines.vllm_engine import model_shape
    from plexrl.engines.vllm_lora import SharedLoRALLM, lora_slot_bytes

    llm = SharedLoRALLM(model_dir, r=8, eos_id=2, pad_id=0, kv_cache_bytes=GiB, device=H100, dtype="bfloat16")
    args = recorded[0]
    assert args["dtype"] == "bfloat16" and args["lora_dtype"] == "bfloat16" and args["enable_lora"]
    assert args["enforce_eager"] is False and args["enable_sleep_mode"] is True
    util = args["gpu_memory_utilization"]
    need = vllm_need(model_shape(model_dir), "bfloat16", GiB, 4096, lora_slot_bytes(model_dir, 8, "bfloat16"))
    assert need <= util * H100.total <= H100.free  # vLLM starts only if util x total is free (tests/test_devices.py)
    assert llm.dtype == "bfloat16"


def test_a_full_engine_on_cpu_keeps_fp32_and_eager(model_dir: Path, recorded: list[dict[str, Any]]) -> None:
    from plexrl.engines.vllm_engine import SharedLLM

    SharedLLM(model_dir, eos_id=2, pad_id=0, dtype="bfloat16")  # the CPU default device
    assert recorded[0]["dtype"] == "float32" and recorded[0]["enforce_eager"] is True
    assert "gpu_memory_utilization" not in recorded[0] and "enable_sleep_mode" not in recorded[0]


def test_building_an_engine_leaves_the_cuda_rng_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """B7: vLLM seeds every generator, CUDA's too; the engine builder puts CUDA's back (here a stand-in RNG
    API on a machine without CUDA, as the builder calls it)."""
    from plexrl.engines.vllm_engine import _process_state_kept

    state: dict[str, Any] = {"rng": ["before"]}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(state["rng"]))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: state.__setitem__("rng", list(s)))
    with _process_state_kept():
        state["rng"] = ["seeded by vLLM"]
    assert state["rng"] == ["before"]


def test_the_dtype_is_part_of_the_engine_keys_and_of_the_lora_engine_bytes(model_dir: Path) -> None:
    from plexrl.engines.vllm_engine import generator_key
    from plexrl.engines.vllm_lora import lora_engine_bytes, lora_generator_key

    assert generator_key(model_dir) != generator_key(model_dir, dtype="bfloat16")
    assert lora_generator_key(model_dir, 8) != lora_generator_key(model_dir, 8, dtype="bfloat16")
    assert lora_engine_bytes(model_dir, 8, 0, "bfloat16") * 2 == lora_engine_bytes(model_dir, 8, 0)


class IdleEngine:
    """A shared engine as `Generators` sees it (in this unit test of `Generators` only)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir, self.dtype, self.broken, self.loads = model_dir, "bfloat16", False, 0
        self.events: list[str] = []

    def sleep(self, level: int) -> None:
        self.events.append(f"sleep{level}")

    def shutdown(self) -> None:
        self.events.append("shutdown")


@pytest.mark.parametrize(("device", "kept"), [(H100, True), (Device(), False)])
def test_an_idle_engine_sleeps_on_cuda_instead_of_a_shutdown_and_a_rebuild(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, device: Device, kept: bool
) -> None:
    """A5: on CUDA the engine no job uses sleeps and stays (a shutdown would keep its GPU memory in-process);
    at most MAX_ASLEEP sleep, the one idle longest is shut down; on CPU it is shut down."""
    from plexrl.devices import MAX_ASLEEP
    from plexrl.services.generators import Generators

    gens = Generators(torch.device("cpu"))
    monkeypatch.setattr(gens, "describe", lambda: device)
    engines = {f"k{i}": IdleEngine(model_dir) for i in range(MAX_ASLEEP + 1)}
    gens._engines.update(engines)
    gens.drop({}, {})
    if kept:
        assert engines["k0"].events == ["sleep2", "shutdown"]  # idle longest: shut down beyond MAX_ASLEEP
        assert all(e.events == ["sleep2"] for k, e in engines.items() if k != "k0")
        assert len(gens) == MAX_ASLEEP and gens.awake() == 0
    else:
        assert all(e.events == ["shutdown"] for e in engines.values()) and len(gens) == 0


def test_a_job_admitted_to_host_is_never_made_on_the_device(
    tiny_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A7: the planner admits a job to host when the device has no room, so its engine is made on the host
    (`build_device`: "cpu" whatever the service's device) and its tensors become its host copy; the live
    tensors hold nothing until the planner brings the job in. (The service runs on the CPU here: where the
    engine's tensors were made is what its constructor was told, seen by a spy.)"""
    from transformers import AutoModelForCausalLM

    from plexrl.devices import build_device
    from plexrl.engines.torch_engine import TorchEngine
    from plexrl.job.spec import prepare_job
    from plexrl.services.service import Service

    assert build_device("cuda:0", "host") == build_device("cuda:0", "disk") == "cpu"
    assert build_device("cuda:0", "device") == "cuda:0"
    made_on: list[Any] = []
    init = TorchEngine.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        made_on.append(kwargs.get("load_on"))
        init(self, *args, **kwargs)

    spec = prepare_job(load_job(tiny_config))
    monkeypatch.setattr(TorchEngine, "__init__", spy)
    svc = Service("s", "cpu")
    try:
        nbytes = svc.load_job(spec, "host")
        assert made_on == ["cpu"]
        place = svc.states[spec.job_id]
        assert place.tier == "host" and place.host is not None and nbytes > 0
        model = AutoModelForCausalLM.from_pretrained(str(spec.model_path), dtype=torch.float32)
        want = dict(model.named_parameters())
        for name, t in place.host.tensors().items():
            if name.startswith("policy."):
                assert torch.equal(t, want[name.removeprefix("policy.")].detach())
        assert all(t.numel() == 0 for t in svc.engines[spec.job_id].state_tensors().values())
        svc.apply([Move(spec.job_id, "host", "device", 0)])  # the planner brings it in: the weights arrive
        live = svc.engines[spec.job_id].state_tensors()
        assert torch.equal(live["policy.model.embed_tokens.weight"], want["model.embed_tokens.weight"].detach())
    finally:
        svc.close()


def write_cluster(tmp_path: Path, services: dict[str, Any], jobs: list[dict[str, Any]], driver: str = "local") -> Path:
    path = tmp_path / "cluster.yaml"
    doc = {"name": "c", "driver": driver, "services": services, "mlflow": False, "jobs": [{"job": j} for j in jobs]}
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_bf16_job_is_sized_at_bf16_size_by_the_cluster_check(tmp_path: Path) -> None:
    """B4: bf16 policy 2 + fp32 masters 4 + moments 8 = 14 bytes a parameter, not fp32's 12: a budget between
    the two refuses the bf16 job (the planner sizes it so too)."""
    from plexrl.cluster import load_cluster
    from plexrl.job.budget import estimate_weight_bytes
    from plexrl.sizes import estimate_state_bytes

    job = {**copy.deepcopy(TINY), "engine": "torch", "model": {**TINY["model"], "dtype": "bfloat16"}}
    loaded = load_job(job)
    weights = estimate_weight_bytes(loaded.config)
    fp32, bf16 = estimate_state_bytes(weights, loaded.graph), estimate_state_bytes(weights, loaded.graph, "bfloat16")
    assert fp32 < bf16
    with pytest.raises(ConfigError, match="needs about"):
        load_cluster(write_cluster(tmp_path, {"device_memory": (fp32 + bf16) // 2}, [job]))


@pytest.mark.parametrize(
    ("model", "named"),
    [({"lora": {"r": 4}}, "model.lora"), ({"dtype": "bfloat16"}, "model.dtype"),
     ({"gradient_checkpointing": True}, "model.gradient_checkpointing")],
)  # fmt: skip
def test_a_worker_group_refuses_what_it_would_silently_ignore(
    tmp_path: Path, model: dict[str, Any], named: str
) -> None:
    """B5: FSDPEngine trains every weight in fp32 without checkpointing; a job asking otherwise is refused."""
    from plexrl.cluster import load_cluster

    job = {**copy.deepcopy(TINY), "engine": "torch", "model": {**TINY["model"], **model}}
    with pytest.raises(ConfigError, match=rf"{named}.*services.ranks: 1"):
        load_cluster(write_cluster(tmp_path, {"ranks": 2}, [job], driver="dask"))


def test_a_cuda_cluster_without_a_budget_gets_one_that_leaves_headroom(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D3: on CUDA services.device_memory unset is not unlimited: free memory minus headroom for the jobs."""
    import plexrl.devices
    from plexrl.cluster import load_cluster
    from plexrl.runtime.build import device_budget

    monkeypatch.setattr(plexrl.devices, "query_gpus", lambda: {"0": H100, "1": H100})
    monkeypatch.setattr(plexrl.devices, "visible_gpus", lambda: ["0", "1"])
    loaded = load_cluster(write_cluster(tmp_path, {"count": 2, "device": "cuda"}, [copy.deepcopy(TINY)]))
    assert loaded.jobs[0].config.model.dtype == "bfloat16"  # the CUDA default where the job leaves it unset
    budget = device_budget(loaded.config, loaded.jobs)
    assert budget is not None and 0 < budget < H100.free - GiB  # the CUDA context at least is held back
    external = loaded.config.model_copy(update={"driver": "dask", "scheduler": "tcp://127.0.0.1:8786"})
    with pytest.raises(ConfigError, match="external scheduler"):
        device_budget(external, loaded.jobs)


def test_the_executor_of_a_cuda_cluster_gives_each_service_worker_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import plexrl.devices
    from plexrl.runtime.build import make_executor
    from plexrl.runtime.config import RuntimeConfig

    monkeypatch.setattr(plexrl.devices, "visible_gpus", lambda: ["0", "1", "2", "3"])
    cfg = RuntimeConfig.model_validate({"services": {"count": 2, "device": "cuda", "devices": ["3", "1"]}})
    ex: Any = make_executor(cfg)
    assert {k: v["CUDA_VISIBLE_DEVICES"] for k, v in ex.worker_env.items()} == {
        "service-0": "3", "service-1": "1", "cpu-0": ""
    }  # fmt: skip


def test_a_local_dask_clusters_workers_see_their_own_gpus(tmp_path: Path) -> None:
    """A3, D2 on a real LocalCluster: the environment reaches each worker process (a fake GPU list: the
    services themselves run on the CPU here)."""
    from plexrl.devices import worker_envs
    from plexrl.runtime.dask import DaskExecutor

    env = worker_envs("cuda", 2, 1, None, ["5", "7"], deterministic=False)
    ex = DaskExecutor(services=2, cpu_threads=1, device="cpu", spill_dir=tmp_path, worker_env=env)
    ex.start()
    try:
        seen = ex.client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
        names = {w["name"]: a for a, w in ex.client.scheduler_info()["workers"].items()}
        assert {name: seen[addr] for name, addr in names.items()} == {"service-0": "5", "service-1": "7", "cpu-0": ""}
        assert os.environ.get("CUDA_VISIBLE_DEVICES") != "5"  # this process is untouched
    finally:
        ex.close()


def test_a_servers_worker_group_refuses_a_bf16_job() -> None:
    """B5 on the server's path (a job submitted later, not in a cluster file): refused before anything is built."""
    from plexrl.server.api import prepare_entry
    from plexrl.server.journal_records import JobEntry

    job = {**copy.deepcopy(TINY), "model": {**TINY["model"], "dtype": "bfloat16"}}
    entry = JobEntry(1, "j1", "j", "u", job, "queued", "", None, 2, 0, 1, 0.0, None, None, {})
    with pytest.raises(ConfigError, match=r"model.dtype bfloat16: worker groups train in float32"):
        prepare_entry(entry, device="cuda", group=True)
