"""A server's cluster (`ServerConfig.cluster`): the runtime section of a cluster config, embedded whole, so every
setting a cluster config takes (but its jobs and its run's name and outputs) a server takes, and a setting a
cluster config refuses is refused here too, with the same words."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from plexrl.cluster import ClusterConfig
from plexrl.errors import ConfigError
from plexrl.runtime.config import RuntimeConfig
from plexrl.server.config import ServerConfig, load_server_config

# the settings of a cluster config that are its run's, not the runtime's: a server has none of these
CLUSTER_RUN_ONLY = {
    "jobs": "a server's jobs are submitted to it",
    "name": "the name of a cluster run's MLflow run (a server logs each job's own)",
    "experiment": "the MLflow experiment of that cluster run",
    "progress": "progress bars on a terminal (a server has none)",
}
SERVER_OWN = {"run_dir", "mlflow"}  # a cluster run's outputs, which a server config sets at its own level


def paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every settable field of a config model, nested sections walked (`services.count`, ...)."""
    out = set()
    for name, field in model.model_fields.items():
        kind: Any = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out |= paths(kind, f"{prefix}{name}.")
        else:
            out.add(f"{prefix}{name}")
    return out


def test_every_setting_a_cluster_config_takes_a_server_config_takes() -> None:
    """Walk both schemas: each field of a cluster config is under the server's `cluster:` or (a run's outputs)
    a server field; only the cluster run's own settings are exempt, each with its reason. (Before the section
    was embedded, `batch_rollouts` and `hold_ahead` were missing from a server: it could not set them.)"""
    server = paths(ServerConfig)
    for setting in sorted(paths(ClusterConfig)):
        top = setting.split(".")[0]
        if top in CLUSTER_RUN_ONLY:
            continue
        assert f"cluster.{setting}" in server or (top in SERVER_OWN and setting in server), setting
    assert {"cluster.batch_rollouts", "cluster.hold_ahead", "cluster.services.group_timeout"} <= server


def test_a_server_sets_every_runtime_field_and_its_runner_gets_them() -> None:
    """Every field of the section given to a server reaches the section its runner is built from, unchanged."""
    settings = {
        "driver": "local", "cpu_threads": 3, "placement": "pack", "max_load": 2.5, "ordering": "io-first",
        "lookahead": False, "hold_ahead": True, "batch_rollouts": True, "fair_share": False,
        "share_half_life_s": 60.0, "validate_state": True, "pin_cores": False,
        "services": {"count": 3, "device_memory": "64MB", "host_memory": "1GB", "threads": 2, "group_timeout": 9},
    }  # fmt: skip
    cfg = load_server_config(None, [f"cluster={settings}"])
    assert cfg.cluster == RuntimeConfig.model_validate(settings)
    assert set(settings) | set(RuntimeConfig.model_fields) == set(RuntimeConfig.model_fields)
    from plexrl.planner import Planner

    planner = Planner.from_config(cfg.cluster, clock=lambda: 0.0)
    assert planner.batch_rollouts and planner.hold_ahead and planner.ordering.name == "io-first"
    assert planner.usage.half_life == 60.0 and planner.validate_each_step and not planner.lookahead


def test_a_cluster_setting_at_the_servers_top_level_names_where_it_goes() -> None:
    with pytest.raises(ConfigError) as err:
        load_server_config(None, ["placement=pack", "services.count=3"])
    message = str(err.value)
    assert "placement, services: a setting of the cluster the server runs goes under `cluster:`" in message
    assert "(cluster.placement, cluster.services)" in message


def test_worker_groups_off_dask_are_refused_at_load_with_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        load_server_config(None, ["cluster.driver=local", "cluster.services.ranks=2"])
    assert "services.ranks > 1 (worker groups) needs driver: dask; set driver: dask or ranks: 1" in str(err.value)
    ServerConfig.model_validate({"cluster": {"services": {"ranks": 2}}})  # on dask (the default driver) they are fine
