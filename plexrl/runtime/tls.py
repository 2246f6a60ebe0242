"""Dask's network security for PlexRL: loopback by default, mutual TLS beyond it.

Dask's protocol is pickle, so whoever reaches a scheduler, worker or nanny can run code in it. `TLSFiles` names
the PEM files of a CA and one certificate it signed that every member of a cluster presents
(`require_encryption`); `write_certs` makes them (`plexrl certs DIR`); `is_loopback` says whether an interface
accepts connections from this machine only. `DaskExecutor` (runtime/dask.py) uses them to bind the local
cluster and to connect to an external one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


# -- network: loopback by default, mutual TLS beyond it --------------------------------------------------
@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files for Dask's mutual TLS: the CA every member trusts, and the certificate (with its key) that this
    process, the local cluster's scheduler, workers and nannies present (one certificate for every role; it
    must allow both server and client authentication, as `write_certs` makes it)."""

    ca_file: str
    cert: str
    key: str

    def security(self) -> Any:
        """A `distributed.security.Security` that requires TLS on every connection."""
        from distributed.security import Security

        for what, path in (("ca_file", self.ca_file), ("cert", self.cert), ("key", self.key)):
            if not Path(path).is_file():
                raise FileNotFoundError(f"TLS {what} {path!r} does not exist; make the files with `plexrl certs DIR`")
        return Security(
            tls_ca_file=self.ca_file, tls_client_cert=self.cert, tls_client_key=self.key,
            tls_scheduler_cert=self.cert, tls_scheduler_key=self.key, tls_worker_cert=self.cert,
            tls_worker_key=self.key, require_encryption=True,
        )  # fmt: skip


def is_loopback(host: str) -> bool:
    """Whether the interface `host` (an address, `[::1]`, or `localhost`) only accepts connections from this
    machine (127.0.0.0/8, ::1). A bare name may resolve to anything: False.

    >>> is_loopback("127.0.0.2"), is_loopback("[::1]"), is_loopback("localhost"), is_loopback("0.0.0.0")
    (True, True, True, False)
    """
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def write_certs(directory: str | Path, hosts: Sequence[str] = (), days: int = 365, force: bool = False) -> TLSFiles:
    """Make a CA (`ca.pem`, its key `ca-key.pem`) and one certificate it signed (`cert.pem`, `key.pem`) for
    every member of a Dask cluster and its clients, valid `days` days, for `localhost`, 127.0.0.1, ::1 and
    `hosts` (Dask does not check host names; the names are there for other tools). Keys are written 0600.
    Refuses to overwrite existing files unless `force`. Keep `ca-key.pem` off the cluster's machines."""
    import datetime
    import ipaddress
    import os

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    names = {"ca": out / "ca.pem", "ca_key": out / "ca-key.pem", "cert": out / "cert.pem", "key": out / "key.pem"}
    existing = [str(p) for p in names.values() if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} exist already; choose another directory or pass --force")
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "plexrl dask CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    alt: list[x509.GeneralName] = [x509.DNSName("localhost")]
    alt += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")]
    for h in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "plexrl dask")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False).add_extension(usage, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem = serialization.Encoding.PEM

    def private(path: Path, k: ec.EllipticCurvePrivateKey) -> None:
        data = k.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(path, 0o600)  # an existing file (--force) keeps its old mode otherwise

    private(names["ca_key"], ca_key)
    private(names["key"], key)
    names["ca"].write_bytes(ca.public_bytes(pem))
    names["cert"].write_bytes(cert.public_bytes(pem))
    return TLSFiles(str(names["ca"]), str(names["cert"]), str(names["key"]))


__all__ = ["LOOPBACK", "TLSFiles", "is_loopback", "write_certs"]
