"""Slurm and Kubernetes through Dask's own launchers (`plexrl/runtime/launchers.py`).

- the decisions, without a cluster: dask-jobqueue's options (one worker per GPU job with `--resources GPU=1` and
  the GPU by --gres, the CPU pool as its own job class) and the job script dask-jobqueue writes from them; the
  dask-kubernetes custom resources and the server's manifests (deploy/kubernetes/) validated against the
  Kubernetes schema (kubernetes-validate, offline);
- end to end on a REAL single-node Slurm (slurmctld, slurmd, munge: started here, `tests/slurm_node.py`):
  `run_cluster` of a two-job multiplexed mix whose workers are Slurm jobs, both jobs learning exactly as on
  the local driver.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import stable

from plexrl.runtime.config import RuntimeConfig
from plexrl.runtime.launchers import KubernetesLauncher, SlurmLauncher, kube_specs, slurm_options

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def slurm(**kw: Any) -> SlurmLauncher:
    return SlurmLauncher.model_validate({"kind": "slurm", **kw})


def test_slurm_options_one_gpu_worker_per_job_and_the_cpu_pool_its_own_class() -> None:
    cluster, cpu = slurm_options(slurm(partition="gpu"), cpu_threads=6, host="127.0.0.1", tls=None)
    assert cluster["queue"] == "gpu" and cluster["processes"] == 1 and cluster["cores"] == 2
    assert "--gres=gpu:1" in cluster["job_extra_directives"]  # Slurm sets CUDA_VISIBLE_DEVICES for the worker
    args = cluster["worker_extra_args"]
    assert args[args.index("--resources") + 1] == "GPU=1" and args[args.index("--host") + 1] == "127.0.0.1"
    assert cluster["job_cpu"] == 4 and cluster["job_mem"] == "64GB"
    assert cpu["cores"] == 6 and cpu["job_cpu"] == 8 and "--resources" not in cpu["worker_extra_args"]
    assert not any(d.startswith("--gres") for d in cpu["job_extra_directives"])
    off, _ = slurm_options(slurm(interface="ib0"), cpu_threads=2, host="10.0.0.5", tls=None)
    assert "--host" not in off["worker_extra_args"] and "ib0" in off["worker_extra_args"]


def test_the_job_script_dask_jobqueue_writes_asks_for_one_gpu_and_runs_a_gpu_worker() -> None:
    from dask_jobqueue import SLURMCluster

    kw, _ = slurm_options(slurm(account="rl", prologue=["source /opt/venv/bin/activate"]), cpu_threads=2,
                          host="127.0.0.1", tls=None)  # fmt: skip
    with SLURMCluster(**kw) as cluster:
        script = cluster.job_script()
    for line in ("#SBATCH --gres=gpu:1", "#SBATCH -A rl", "#SBATCH --cpus-per-task=4", "#SBATCH --mem=64G",
                 "source /opt/venv/bin/activate", "--resources GPU=1", "--nthreads 2", "--memory-limit 0"):  # fmt: skip
        assert line in script, (line, script)


def test_launcher_rules_name_the_fix() -> None:
    from pydantic import ValidationError

    kube = {"kind": "kubernetes", "image": "plexrl:1"}
    with pytest.raises(ValidationError, match="dask_tls"):
        RuntimeConfig.model_validate({"launcher": kube})
    with pytest.raises(ValidationError, match="set driver: dask"):
        RuntimeConfig.model_validate({"driver": "local", "launcher": {"kind": "slurm"}})
    with pytest.raises(ValidationError, match="dask_tls"):  # a scheduler off loopback for other nodes' workers
        RuntimeConfig.model_validate({"dask_host": "10.0.0.5", "launcher": {"kind": "slurm"}})
    ok = RuntimeConfig.model_validate({"launcher": kube, "allow_plaintext_scheduler": True})
    assert isinstance(ok.launcher, KubernetesLauncher)


# -- Kubernetes: the rendered resources and the server's manifests against the schema -----------------------------
def validate(doc: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def as_pod(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}


@pytest.mark.parametrize("tls", [False, True])
def test_the_dask_cluster_resources_hold_valid_pods_one_gpu_per_worker(tls: bool) -> None:
    launcher = KubernetesLauncher(kind="kubernetes", image="plexrl:1", namespace="rl", env={"HF_HUB_OFFLINE": "1"})
    specs = kube_specs(launcher, workers=3, cpu_threads=8, tls=tls)
    cluster = specs["cluster"]
    assert (cluster["apiVersion"], cluster["kind"]) == ("kubernetes.dask.org/v1", "DaskCluster")
    worker, scheduler = cluster["spec"]["worker"], cluster["spec"]["scheduler"]
    assert worker["replicas"] == 3 and specs["cpu_pool"]["replicas"] == 1
    for pod in (worker["spec"], scheduler["spec"], specs["cpu_pool"]["spec"]):
        validate(as_pod(pod))
    validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}, "spec": scheduler["service"]})
    (gpu,) = worker["spec"]["containers"]
    (cpu,) = specs["cpu_pool"]["spec"]["containers"]
    (sched,) = scheduler["spec"]["containers"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1 and "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert "GPU=1" in gpu["args"] and "GPU=1" not in cpu["args"] and cpu["args"][-1] == "8"
    assert "resources" not in sched  # the scheduler asks for no GPU
    assert ("--tls-ca-file" in gpu["args"] and "--protocol" in sched["args"]) == tls


def test_the_server_manifests_validate_and_embed_a_valid_runtime_section() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "plexrl-server.yaml").read_text()))
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "NetworkPolicy"} <= kinds
    for doc in docs:
        validate(doc)
    from plexrl.server.config import ServerConfig

    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    server = ServerConfig.model_validate({**yaml.safe_load(cm["data"]["server.yaml"]), "token": "x" * 32})
    assert isinstance(server.cluster.launcher, KubernetesLauncher) and server.cluster.services.device == "cuda"
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["plexrl", "serve"]


# -- a real single-node Slurm ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import slurm_node as sn

    why = sn.missing()
    if why is not None:
        pytest.fail(why)  # `make test` installs Slurm first (make setup-slurm)
    node = sn.start(tmp_path_factory.mktemp("slurm"))
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", str(node.conf))
    try:
        yield node
    finally:
        mp.undo()
        sn.stop(node)


@pytest.mark.slow
def test_a_multiplexed_mix_runs_end_to_end_on_slurm_workers(slurm_node: Any, tmp_path: Path) -> None:
    from _tiny import tiny_cluster_file

    from plexrl.cluster import load_cluster, run_cluster

    path = tiny_cluster_file(tmp_path / "runs", driver="dask", jobs=2)
    raw = yaml.safe_load(path.read_text())
    local = load_cluster(path)
    launcher = {"kind": "slurm", "service": {"cpus": 1, "memory": "4GB"}, "cpu_pool": {"cpus": 1, "memory": "4GB"},
                "log_directory": str(tmp_path / "slurm-logs"), "start_timeout_s": 180}  # fmt: skip
    raw.update(launcher=launcher, pin_cores=False)
    path.write_text(yaml.safe_dump(raw))
    res = run_cluster(load_cluster(path))
    assert [j.status for j in res.jobs] == ["done", "done"], [j.error for j in res.jobs]
    jobs = subprocess.run(["scontrol", "show", "jobs", "-o"], capture_output=True, text=True, timeout=30).stdout
    assert "JobName=plexrl-service" in jobs and "JobName=plexrl-cpu" in jobs  # the workers were Slurm jobs
    alone = run_cluster(dataclasses.replace(local, config=local.config.model_copy(update={"driver": "local"})))
    for a, b in zip(sorted(res.jobs, key=lambda j: j.job_id), sorted(alone.jobs, key=lambda j: j.job_id), strict=True):
        assert stable(a.history) == stable(b.history)  # multiplexed on Slurm workers, learning exactly as locally
