"""Nothing listens unauthenticated: `plexrl serve` with its local Dask cluster (driver: dask) opens listening
sockets on loopback only, in its own process and in every worker process; off loopback with TLS files, only
Dask's tls:// comms listen beyond loopback and a client without a certificate is turned away. The configs
refuse a local cluster off loopback without TLS and an external scheduler off loopback over plain TCP,
naming the fix."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import wait_for
from typer.testing import CliRunner

from plexrl.cli import app
from plexrl.cluster import ClusterConfig
from plexrl.errors import ConfigError
from plexrl.runtime.build import make_executor
from plexrl.runtime.dask import DaskExecutor
from plexrl.runtime.tls import TLSFiles, write_certs
from plexrl.server.config import ServerConfig, load_server_config

JOBS = [{"job": {"name": "j"}}]


def listening() -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every listening inet socket of this process and its children."""
    out = []
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            out += [
                (proc.pid, proc.name(), c.laddr.ip, c.laddr.port)
                for c in proc.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            ]
        except psutil.NoSuchProcess:  # a child that ended meanwhile
            continue
    return out


def off_loopback(sockets: list[tuple[int, str, str, int]]) -> list[tuple[int, str, str, int]]:
    return [s for s in sockets if not ipaddress.ip_address(s[2].split("%")[0]).is_loopback]


def test_serve_with_a_local_dask_cluster_listens_on_loopback_only(tmp_path: Path) -> None:
    from plexrl.server.api import start_server

    cfg = ServerConfig(
        port=0, journal=str(tmp_path / "journal.db"), run_dir=str(tmp_path / "runs"), mlflow=False,
        cluster={"cpu_threads": 1},
    )  # fmt: skip
    assert cfg.cluster.driver == "dask" and cfg.cluster.dask_host == "127.0.0.1"
    srv = start_server(cfg)
    try:
        executor: Any = srv.controller.runner.executor
        assert isinstance(executor, DaskExecutor)
        wait_for(lambda: executor.worker_of and srv.controller.runner.services, "the Dask cluster to start", 180)
        sockets = listening()
        workers = {pid for pid, *_ in sockets if pid != os.getpid()}
        # the HTTP server, the scheduler, its dashboard, the nannies here; a comm and an http server per worker
        assert len(workers) == 2 and len(sockets) >= 4 + 2 * 2, sockets
        assert off_loopback(sockets) == [], sockets
        assert executor.client.scheduler.address.startswith("tcp://127.0.0.1:")
        assert all(a.startswith("tcp://127.0.0.1:") for a in executor.client.scheduler_info()["workers"])
    finally:
        assert srv.stop(120)


def test_a_tls_cluster_off_loopback_exposes_only_its_tls_comms(tmp_path: Path) -> None:
    """`dask_host` off loopback with TLS: what listens beyond loopback is the scheduler's, workers' and nannies'
    TLS comms and nothing else (dashboard and the workers' plain-HTTP endpoints stay on loopback); a client
    without the certificates is turned away, one with them gets in."""
    from distributed import Client

    tls = write_certs(tmp_path / "certs")
    executor = DaskExecutor(services=1, cpu_threads=1, tls=tls, host="0.0.0.0")
    try:
        assert executor.start() == ["service-0"]
        address = executor.client.scheduler.address
        workers = list(executor.client.scheduler_info()["workers"])
        nannies = [n.address for n in executor.cluster.workers.values()]
        assert all(a.startswith("tls://") for a in [address, *workers, *nannies]), (address, workers, nannies)
        comms = {int(a.rsplit(":", 1)[1]) for a in [address, *workers, *nannies]}
        exposed = off_loopback(listening())
        assert exposed and {port for *_, port in exposed} == comms, (exposed, comms)
        with pytest.raises((OSError, TypeError, ValueError)):  # no certificate: no connection
            Client(address, timeout=5)
        with pytest.raises(OSError):  # plain TCP to a TLS listener
            Client(address.replace("tls://", "tcp://"), timeout=5)
        # the certificates: in. (On the executor's client's event loop: in a long test process a new loop thread
        # sometimes missed distributed's fixed 10 s start-up wait, which is not what this test is about.)
        with Client(address, security=tls.security(), timeout=30, loop=executor.client.loop) as other:
            assert len(other.scheduler_info()["workers"]) == 2
    finally:
        executor.close()


def test_a_local_cluster_off_loopback_needs_tls() -> None:
    def cluster(settings: dict[str, Any]) -> ClusterConfig:
        return ClusterConfig.model_validate({**settings, "jobs": JOBS})

    def server(settings: dict[str, Any]) -> Any:
        return ServerConfig.model_validate({"cluster": settings}).cluster

    for model in (cluster, server):
        with pytest.raises(ValueError, match=r"dask_host '0\.0\.0\.0' lets anyone .* give `dask_tls` .*plexrl certs"):
            model({"dask_host": "0.0.0.0"})
        tls = {"ca_file": "ca.pem", "cert": "cert.pem", "key": "key.pem"}
        assert model({"dask_host": "0.0.0.0", "dask_tls": tls}).dask_tls is not None
        model({"dask_host": "0.0.0.0", "driver": "local"})  # no Dask cluster at all
        with pytest.raises(ValueError, match="Extra inputs are not permitted"):
            model({"dask_tls": {**tls, "password": "x"}})
    # the executor refuses it too, before it starts anything
    with pytest.raises(ValueError, match=r"local Dask cluster on '10\.1\.2\.3' .*dask_tls"):
        DaskExecutor(host="10.1.2.3").start()
    assert DaskExecutor().client is None


@pytest.mark.parametrize(
    ("scheduler", "ok"),
    [
        ("tcp://127.0.0.1:8786", True),
        ("localhost:8786", True),
        ("tcp://[::1]:8786", True),
        ("tls://10.0.0.5:8786", True),
        ("tcp://10.0.0.5:8786", False),
        ("10.0.0.5:8786", False),
        ("tcp://dask-head:8786", False),  # a name may resolve to anything
    ],
)
def test_an_external_scheduler_off_loopback_needs_tls(scheduler: str, ok: bool) -> None:
    if ok:
        assert load_server_config(None, [f"cluster.scheduler={scheduler}"]).cluster.scheduler == scheduler
        ClusterConfig.model_validate({"scheduler": scheduler, "jobs": JOBS})
        return
    with pytest.raises(ConfigError, match=r"plain TCP off this machine: .*tls://HOST:PORT .*allow_plaintext_scheduler"):
        load_server_config(None, [f"cluster.scheduler={scheduler}"])
    with pytest.raises(ValueError, match="plain TCP off this machine"):
        ClusterConfig.model_validate({"scheduler": scheduler, "jobs": JOBS})
    with pytest.raises(ValueError, match="plain TCP off this machine"):
        ClusterConfig.model_validate({"scheduler": scheduler, "jobs": JOBS, "dask_host": "127.0.0.1"})
    # the user's explicit choice, on a network they trust
    plain = [f"cluster.scheduler={scheduler}", "cluster.allow_plaintext_scheduler=true"]
    assert load_server_config(None, plain).cluster.scheduler


def test_a_tls_scheduler_without_certificates_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match=r"speaks TLS but no certificates are given: set `dask_tls`"):
        DaskExecutor(scheduler="tls://127.0.0.1:1").start()


def test_the_configs_reach_the_executor(tmp_path: Path) -> None:
    tls = {"ca_file": "c", "cert": "d", "key": "e"}
    for cfg in (
        ServerConfig.model_validate({"cluster": {"dask_host": "10.0.0.9", "dask_tls": tls}}).cluster,
        ClusterConfig.model_validate({"dask_host": "10.0.0.9", "dask_tls": tls, "jobs": JOBS}),
    ):
        ex = make_executor(cfg)
        assert isinstance(ex, DaskExecutor) and ex.host == "10.0.0.9" and ex.tls == TLSFiles("c", "d", "e")
        with pytest.raises(FileNotFoundError, match=r"TLS ca_file 'c' does not exist; .*plexrl certs"):
            ex.start()
    assert make_executor(ServerConfig().cluster).host == "127.0.0.1"  # type: ignore[attr-defined]


def test_certs_command_writes_a_ca_and_a_certificate_it_signed(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    out = tmp_path / "certs"
    res = CliRunner().invoke(app, ["certs", str(out), "--host", "10.0.0.5", "--host", "head.example"])
    assert res.exit_code == 0, res.output
    assert f"dask_tls: {{ca_file: {out}/ca.pem, cert: {out}/cert.pem, key: {out}/key.pem}}" in res.output
    for key in ("key.pem", "ca-key.pem"):
        assert stat.S_IMODE((out / key).stat().st_mode) == 0o600
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((out / "cert.pem").read_bytes())
    pub = ca.public_key()
    assert isinstance(pub, ec.EllipticCurvePublicKey)
    cert.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "head.example" in names.get_values_for_type(x509.DNSName)
    assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1", "10.0.0.5"}
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
    before = (out / "key.pem").read_bytes()
    res = CliRunner().invoke(app, ["certs", str(out)])
    assert res.exit_code == 2 and "exist already; choose another directory or pass --force" in res.output
    assert (out / "key.pem").read_bytes() == before
    assert CliRunner().invoke(app, ["certs", str(out), "--force"]).exit_code == 0
    assert (out / "key.pem").read_bytes() != before
