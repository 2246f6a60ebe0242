"""Every GPU decision, checked without a GPU: `plexrl.devices` fed hand-built device descriptions.

What a CUDA machine would get is computed by plain functions, so these CPU tests fail if it would get fp32 LoRA
kernels (vLLM's Triton LoRA ops assert fp16/bf16), a `gpu_memory_utilization` that vLLM's own start-up check
(`vllm.v1.worker.utils.request_memory`, called here) refuses with the trainer resident, every service on one
GPU, or a device budget that does not leave the headroom a job needs."""

from __future__ import annotations

import doctest
import os
from types import SimpleNamespace
from typing import Any

import pytest

import plexrl.devices.assignment
import plexrl.devices.base
import plexrl.devices.engines
from plexrl.devices import (
    CPU,
    Device,
    DeviceError,
    GiB,
    Shape,
    cuda_env,
    device_split,
    gpu_memory_utilization,
    idle_engine,
    inline_devices,
    resolve_device,
    service_gpus,
    services_budget,
    vllm_args,
    vllm_need,
    worker_envs,
)
from plexrl.job.config import JobConfig
from plexrl.job.devices import job_defaults
from plexrl.job.load import load_job

H200 = Device("cuda", 0, 141 * GiB, 141 * GiB, (9, 0), "NVIDIA H200")
T4 = Device("cuda", 0, 15 * GiB, 15 * GiB, (7, 5), "Tesla T4")
SMOLLM2 = Shape(params=134_515_008, hidden=576, intermediate=1536, layers=30, vocab=49_152)
ONE_B = Shape(params=1_235_814_400, hidden=2048, intermediate=8192, layers=16, vocab=128_256)


def with_free(dev: Device, free: int) -> Device:
    return Device(dev.kind, dev.index, dev.total, free, dev.capability, dev.name)


@pytest.mark.parametrize("module", [plexrl.devices.base, plexrl.devices.engines, plexrl.devices.assignment])
def test_doctests(module: Any) -> None:
    assert doctest.testmod(module).failed == 0


# -- vLLM's arguments ------------------------------------------------------------------------------------------
def vllm_module(name: str) -> Any:
    """A vLLM module, imported as the engine imports vLLM (its environment set, its import warnings quiet)."""
    import importlib

    from plexrl.engines.vllm_engine import _import_vllm, _quiet, vllm_installed

    if not vllm_installed():
        pytest.skip("vLLM is not installed (make setup-vllm)")
    _import_vllm()
    with _quiet():
        return importlib.import_module(name)


def vllm_check(util: float, dev: Device) -> int:
    """vLLM 0.32's own start-up check of `util` on `dev` (raises ValueError as it would at engine start)."""
    request_memory = vllm_module("vllm.v1.worker.utils").request_memory

    snapshot = SimpleNamespace(total_memory=dev.total, free_memory=dev.free, device_=dev.torch_name)
    requested: int = request_memory(snapshot, SimpleNamespace(gpu_memory_utilization=util))  # type: ignore[arg-type]
    return requested


def test_a_cuda_lora_engine_never_gets_fp32_kernels() -> None:
    """A1: vLLM's CUDA LoRA ops assert fp16/bf16 inputs and weights. A LoRA job left at the defaults gets bf16
    on CUDA, and its adapters compute in it; an explicit fp32 LoRA job is refused with the fix; CPU stays fp32."""
    job = job_defaults(load_job({"model": {"lora": {"r": 8}}}).config, "cuda")
    args = vllm_args(H200, dtype=job.model.dtype, shape=SMOLLM2, kv_cache_bytes=GiB, batched_tokens=4096, lora=True)
    assert args["dtype"] in ("bfloat16", "float16") and args["lora_dtype"] == args["dtype"]
    with pytest.raises(DeviceError, match=r"LoRA kernels take fp16/bf16 only.*model.dtype: bfloat16"):
        vllm_args(H200, dtype="float32", shape=SMOLLM2, kv_cache_bytes=GiB, batched_tokens=4096, lora=True)
    assert vllm_args(CPU, dtype="bfloat16", shape=SMOLLM2, kv_cache_bytes=GiB, batched_tokens=4096, lora=True)[
        "dtype"
    ] == "float32"  # fmt: skip


def test_a_lora_job_in_fp32_stays_on_torch_where_vllm_is_the_cuda_build() -> None:
    from plexrl.engines.vllm_lora import lora_vllm_problem

    assert lora_vllm_problem(16, ["q_proj"], "float32", cuda=True) is not None
    assert lora_vllm_problem(16, ["q_proj"], "bfloat16", cuda=True) is None
    assert lora_vllm_problem(16, ["q_proj"], "float32", cuda=False) is None  # the CPU build's LoRA ops are torch's


def test_the_engine_computes_in_the_jobs_dtype_on_cuda_with_cuda_graphs_and_sleep_mode() -> None:
    """B8, C1, D4: behaviour log-probs in the arithmetic the job trains in; decode steps in CUDA graphs without
    torch.compile; sleep mode on. A GPU without bf16 is refused with the fix."""
    args = vllm_args(H200, dtype="bfloat16", shape=SMOLLM2, kv_cache_bytes=GiB, batched_tokens=4096)
    assert args["dtype"] == "bfloat16" and args["enforce_eager"] is False and args["enable_sleep_mode"] is True
    assert args["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert vllm_args(CPU, dtype="bfloat16", shape=SMOLLM2, kv_cache_bytes=GiB, batched_tokens=4096) == {
        "dtype": "float32", "enforce_eager": True,
    }  # fmt: skip
    with pytest.raises(DeviceError, match="no bfloat16"):
        vllm_args(T4, dtype="bfloat16", shape=SMOLLM2, kv_cache_bytes=GiB, batched_tokens=4096)


def test_vllms_own_compilation_config_accepts_the_cuda_graph_settings() -> None:
    CompilationConfig = vllm_module("vllm.config").CompilationConfig

    args = vllm_args(H200, dtype="bfloat16", shape=SMOLLM2, kv_cache_bytes=GiB, batched_tokens=4096)
    config = CompilationConfig(**args["compilation_config"])
    assert config.cudagraph_mode.name == "FULL_DECODE_ONLY" and int(config.mode) == 0


def test_the_utilization_passes_vllms_start_up_check_with_the_trainer_resident() -> None:
    """A2: vLLM refuses to start unless utilization x total bytes are free. A 1B job's trainer (bf16 policy,
    fp32 masters and moments: ~17 GiB) and another job's state hold 60 GiB of an H200: vLLM's default (0.92)
    fails its own check; the computed utilization passes it and covers what the engine needs."""
    dev = with_free(H200, H200.total - 60 * GiB)
    EngineArgs = vllm_module("vllm.engine.arg_utils").EngineArgs

    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        vllm_check(EngineArgs.gpu_memory_utilization, dev)
    args = vllm_args(dev, dtype="bfloat16", shape=ONE_B, kv_cache_bytes=8 * GiB, batched_tokens=8192)
    requested = vllm_check(args["gpu_memory_utilization"], dev)
    assert requested >= vllm_need(ONE_B, "bfloat16", 8 * GiB, 8192) and requested <= dev.free


def test_an_engine_that_does_not_fit_is_refused_with_the_numbers() -> None:
    dev = with_free(H200, 3 * GiB)
    with pytest.raises(DeviceError, match=r"needs .* GiB of NVIDIA H200 but only 3.0 of 141.0 GiB are free"):
        gpu_memory_utilization(dev, 10 * GiB)
    with pytest.raises(DeviceError, match="more than 95%"):
        gpu_memory_utilization(H200, 140 * GiB)


def test_vllm_in_process_is_refused_on_a_second_gpu_of_one_process() -> None:
    """vLLM in-process builds on the process's cuda:0; a service on cuda:1 of an in-process executor would put
    its engine on the first service's GPU."""
    second = Device("cuda", 1, H200.total, H200.free, (9, 0), "NVIDIA H200")
    with pytest.raises(DeviceError, match="driver: dask"):
        vllm_args(second, dtype="bfloat16", shape=SMOLLM2, kv_cache_bytes=GiB, batched_tokens=4096)


def test_an_idle_engine_sleeps_on_cuda_and_is_shut_down_on_cpu() -> None:
    """A5: in-process vLLM keeps its GPU memory after shutdown; an idle engine sleeps (level 2: the next job
    loads its weights anyway; a LoRA engine keeps its base at level 1 when host memory holds it)."""
    assert idle_engine(CPU, lora=False, weight_bytes=GiB, host_free=None) == "shutdown"
    assert idle_engine(H200, lora=False, weight_bytes=GiB, host_free=100 * GiB) == "sleep2"
    assert idle_engine(H200, lora=True, weight_bytes=GiB, host_free=100 * GiB) == "sleep1"
    assert idle_engine(H200, lora=True, weight_bytes=GiB, host_free=GiB // 2) == "sleep2"


# -- which GPU runs what ---------------------------------------------------------------------------------------
def test_every_service_rank_gets_a_gpu_of_its_own_and_the_cpu_pool_none() -> None:
    """A3, D2: no two service ranks on one GPU; `services.devices` names them; the CPU pool sees no GPU."""
    env = worker_envs("cuda", 2, 2, None, ["0", "1", "2", "3"], deterministic=False)
    gpus = {name: e["CUDA_VISIBLE_DEVICES"] for name, e in env.items()}
    assert gpus == {"service-0": "0", "service-0-rank1": "1", "service-1": "2", "service-1-rank1": "3", "cpu-0": ""}
    assert env["service-0"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert service_gpus(2, 1, ["3", "1"], ["0", "1", "2", "3"]) == [["3"], ["1"]]
    cpu = worker_envs("cpu", 1, 1, None, [], deterministic=False)
    assert cpu == {"service-0": {}, "cpu-0": {"CUDA_VISIBLE_DEVICES": ""}}


def test_fewer_gpus_than_services_times_ranks_is_refused() -> None:
    with pytest.raises(DeviceError, match=r"need 4 GPUs, but the visible GPUs are 3"):
        service_gpus(2, 2, None, ["0", "1", "2"])
    with pytest.raises(DeviceError, match="twice"):
        service_gpus(2, 1, ["1", "1"], ["0", "1"])
    with pytest.raises(DeviceError, match="not visible"):
        inline_devices("cuda", 1, ["5"], ["0", "1"])
    assert inline_devices("cuda", 2, None, ["4", "6"]) == ["cuda:0", "cuda:1"]


def test_the_cluster_config_refuses_too_few_named_gpus() -> None:
    from plexrl.runtime.config import ServicesConfig

    with pytest.raises(ValueError, match="need 2 GPUs"):
        ServicesConfig(count=2, device="cuda", devices=["0"])
    with pytest.raises(ValueError, match=r"services\.device: cuda"):
        ServicesConfig(devices=["0"])


def test_the_device_of_a_single_job_run() -> None:
    assert resolve_device("auto", []) == "cpu" and resolve_device("auto", ["3"]) == "cuda:0"
    with pytest.raises(DeviceError, match="shows 1 GPU"):
        resolve_device("cuda:1", ["0"])


def test_deterministic_mode_sets_cublas_and_vllm_batch_invariance() -> None:
    env = cuda_env(deterministic=True)
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and env["VLLM_BATCH_INVARIANT"] == "1"
    assert "CUBLAS_WORKSPACE_CONFIG" not in cuda_env()


def test_configure_process_turns_on_torchs_deterministic_algorithms(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from plexrl.devices import configure_process

    monkeypatch.setattr(os, "environ", {})
    try:
        configure_process("cuda", deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


# -- the device budget -----------------------------------------------------------------------------------------
def test_the_default_budget_leaves_the_headroom_a_job_needs() -> None:
    """D3: a CUDA service with no services.device_memory gets free memory minus the context, the job's largest
    minibatch activations, its optimizer temporaries, vLLM's working memory and a fragmentation margin: the
    budget plus all of it never exceeds what is free."""
    from plexrl.devices.budget import mix_headroom
    from plexrl.job.devices import job_headroom

    params = {"batch_size": 16, "n": 8, "max_new_tokens": 256}
    loaded = load_job({"model": {"max_position": 1024}, "pipeline": {"name": "grpo", "params": params}})
    cfg = job_defaults(loaded.config, "cuda")
    head = job_headroom(cfg, loaded.graph, SMOLLM2, 512, vllm=True, vllm_key="k")
    assert head.activations > 64 * 256 * SMOLLM2.vocab * 4  # 16 x 8 rows / 2 minibatches: the fp32 logits at least
    dev = with_free(H200, 120 * GiB)
    split = device_split(dev, **mix_headroom([head]))
    assert split.budget + split.context + split.activations + split.optimizer + split.vllm <= dev.free
    assert split.budget < dev.free - head.activations
    assert services_budget({"0": dev}, services=1, ranks=1, named=None, visible=["0"], jobs=[head]) == split


def test_a_budget_with_nothing_left_is_refused() -> None:
    with pytest.raises(DeviceError, match="nothing is left for job states"):
        device_split(with_free(T4, 2 * GiB), activations=2 * GiB)


def test_a_server_keeps_a_share_of_each_gpu_and_uses_the_smallest() -> None:
    small = Device("cuda", 1, 80 * GiB, 70 * GiB, (9, 0), "H100")
    split = services_budget({"0": H200, "1": small}, services=2, ranks=1, named=None, visible=["0", "1"], jobs=None)
    assert split == device_split(small, activations=8 * GiB)


# -- a job's defaults on a device ------------------------------------------------------------------------------
def test_cuda_defaults_are_bf16_and_sdpa_unless_the_job_sets_them() -> None:
    """C2: on CUDA a job that leaves dtype and attention unset trains in bf16 (fp32 masters) with sdpa; one
    that sets them keeps them; a worker group (FSDP, fp32) keeps fp32; the CPU keeps the config."""
    plain = load_job(None).config
    assert (plain.model.dtype, plain.model.attention) == ("float32", "eager")
    cuda = job_defaults(plain, "cuda")
    assert (cuda.model.dtype, cuda.model.attention) == ("bfloat16", "sdpa")
    assert job_defaults(plain, "cuda", group=True).model.dtype == "float32"
    assert job_defaults(plain, "cpu") is plain
    explicit = JobConfig.model_validate({"model": {"dtype": "float32", "attention": "eager"}})
    assert job_defaults(explicit, "cuda").model.dtype == "float32"
    assert job_defaults(explicit, "cuda").model.attention == "eager"
