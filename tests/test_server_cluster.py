"""A server's cluster (`ServerConfig.cluster()`): the services, policies and driver it runs, as a validated
`ClusterRuntime` (a cluster config without jobs), so a setting a cluster config refuses is refused here too."""

from __future__ import annotations

import pytest

from plexrl.cluster import ClusterConfig, ClusterRuntime
from plexrl.errors import ConfigError
from plexrl.server.config import ServerConfig, load_server_config


def test_the_servers_cluster_is_a_validated_runtime_with_its_settings() -> None:
    cfg = load_server_config(None, ["driver=local", "placement=pack", "services.count=3", "ordering=fifo"])
    runtime = cfg.cluster()
    assert type(runtime) is ClusterRuntime and not isinstance(runtime, ClusterConfig)  # no jobs
    assert (runtime.driver, runtime.placement, runtime.services.count, runtime.ordering) == ("local", "pack", 3, "fifo")
    assert runtime.name == "server" and runtime.mlflow is False


def test_worker_groups_off_dask_are_refused_at_load_with_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        load_server_config(None, ["driver=local", "services.ranks=2"])
    assert "services.ranks > 1 (worker groups) needs driver: dask; set driver: dask or ranks: 1" in str(err.value)
    ServerConfig.model_validate({"services": {"ranks": 2}})  # on dask (the default driver) they are fine
