"""A real single-node Slurm for the launcher tests: munged (when none answers), slurmctld and slurmd from Debian's
`slurm-wlm` (installed by `make setup-slurm`, which `make test` runs; apt-get only when missing), with a
slurm.conf of their own in a temporary directory (state, spool, logs, pid files there; ports 16817/16818).

`start(tmp)` starts the daemons as root and waits (polling with a deadline) until the node is idle; `stop` ends
exactly the processes it started, by their pid files. The caller exports SLURM_CONF for the client commands
(sbatch, squeue, scancel: what dask-jobqueue calls)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd")


@dataclass
class SlurmNode:
    conf: Path
    pids: list[int] = field(default_factory=list)

    def pid_files(self) -> list[int]:
        """The daemons' pids from their pid files (a daemon may write its file after the node is idle)."""
        files = [self.conf.parent / f"{daemon}.pid" for daemon in DAEMONS]
        return [int(text) for f in files if f.is_file() and (text := f.read_text().strip()).isdigit()]

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}


def missing() -> str | None:
    """Why a Slurm node cannot start here, with the fix; None if it can."""
    lacking = [b for b in ("munged", "munge", *DAEMONS, "sbatch", "sinfo") if shutil.which(b) is None]
    if lacking:
        return (
            f"Slurm is not installed ({', '.join(lacking)} missing): run `make setup-slurm` (apt-get slurm-wlm munge)"
        )
    if os.geteuid() != 0:
        return "slurmd must run as root here (the test starts it): run the Slurm tests as root"
    return None


def _munge_answers() -> bool:
    enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    if enc.returncode != 0:
        return False
    return subprocess.run(["unmunge"], input=enc.stdout, capture_output=True, timeout=10).returncode == 0


def _conf(root: Path, host: str) -> str:
    d = {name: root / name for name in ("state", "spool", "log")}
    for p in d.values():
        p.mkdir(parents=True, exist_ok=True)
    return "\n".join([
        "ClusterName=plexrl-test", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmctldPort=16817",
        "SlurmdPort=16818", "AuthType=auth/munge", f"StateSaveLocation={d['state']}", f"SlurmdSpoolDir={d['spool']}",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={d['log']}/slurmctld.log", f"SlurmdLogFile={d['log']}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory", "ReturnToService=2", "MpiDefault=none",
        f"NodeName={host} CPUs={os.cpu_count() or 2} RealMemory=20000 State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP", "",
    ])  # fmt: skip


def start(root: Path, timeout: float = 60.0) -> SlurmNode:
    """Start munged (if none answers), slurmctld and slurmd with a config under `root`; wait until the node is idle."""
    why = missing()
    if why is not None:
        raise RuntimeError(why)
    host = socket.gethostname().split(".")[0]
    node = SlurmNode(root / "slurm.conf")
    node.conf.write_text(_conf(root, host))
    if not _munge_answers():  # a fresh machine: the package's key (or a new one), the socket's directory
        if not Path("/etc/munge/munge.key").is_file() and shutil.which("mungekey"):
            subprocess.run(["mungekey", "--create"], check=True, timeout=30)
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        subprocess.run(["munged", "--force", f"--pid-file={root}/munged.pid", f"--log-file={root}/log/munged.log"],
                       check=True, timeout=30)  # fmt: skip
        node.pids.append(int((root / "munged.pid").read_text()))
    env = node.env()
    for daemon in DAEMONS:
        subprocess.run([daemon, "-f", str(node.conf)], check=True, env=env, timeout=30)  # daemonizes
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        node.pids += [pid for pid in node.pid_files() if pid not in node.pids]
        state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env, timeout=10)
        if state.stdout.strip() == "idle":
            return node
        time.sleep(0.2)
    logs = "\n".join(
        (root / "log" / f"{d}.log").read_text()[-2000:] for d in DAEMONS if (root / "log" / f"{d}.log").is_file()
    )
    stop(node)
    raise RuntimeError(f"the Slurm node did not become idle within {timeout}s:\n{logs}")


def stop(node: SlurmNode) -> None:
    """End the daemons this module started (by pid, the pid files read again), newest first: SIGTERM, then
    SIGKILL for one still there after 20 s."""
    pids = [*node.pids, *(pid for pid in node.pid_files() if pid not in node.pids)]
    for pid in reversed(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    node.pids.clear()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
