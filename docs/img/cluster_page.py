"""Takes docs/img/cluster-page.png: a real `plexrl serve` (driver local, 2 services, spread placement, a device
budget that holds one job's state, so that the two jobs on each service swap), four of the tests' tiny jobs of
two users, checkpoints every 2 iterations; the page shot by headless Chromium once two jobs are 3 iterations in.

    .venv/bin/python docs/img/cluster_page.py docs/img/cluster-page.png      # about 15 s
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from plexrl.server.api import start_server
from plexrl.server.client import Client
from plexrl.server.config import ServerConfig

ADMIN = "admin-token-0123456789"
USERS = {"ann": "ann-secret-0123456789", "bob": "bob-secret-0123456789"}


def main(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from conftest import TINY

    tmp = Path(tempfile.mkdtemp(prefix="plexrl-page-"))
    job = tmp / "job.yaml"
    job.write_text(yaml.safe_dump({**copy.deepcopy(TINY), "iterations": 14, "run_dir": str(tmp / "runs")}))
    cfg = ServerConfig(
        port=0, journal=str(tmp / "journal.db"), run_dir=str(tmp / "runs"), mlflow=False, checkpoint_every=2,
        cluster={"driver": "local", "services": {"count": 2, "device_memory": "200KB"}, "placement": "spread"},
        users=USERS, token=ADMIN,
    )  # fmt: skip
    srv = start_server(cfg)
    try:
        ann, bob, admin = (Client(srv.url, token=t) for t in (USERS["ann"], USERS["bob"], ADMIN))
        jobs = [(ann, ["seed=1"]), (bob, ["seed=2", "name=probe"]), (ann, ["seed=3", "name=sweep"]),
                (bob, ["seed=4", "name=late"])]  # fmt: skip
        ids = [client.submit(job, overrides)["job_id"] for client, overrides in jobs]
        deadline = time.monotonic() + 300
        while sum(admin.status(j)["iterations_done"] >= 3 for j in ids) < 2:
            if time.monotonic() > deadline:
                raise SystemExit("the jobs made no progress in 300 s")
            time.sleep(0.5)
        cmd = ["chromium", "--headless", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={tmp / 'profile'}",
               "--window-size=1200,600", "--virtual-time-budget=3000", f"--screenshot={out.resolve()}",
               f"{srv.url}/#token={ADMIN}"]  # fmt: skip
        if os.geteuid() == 0:
            cmd.insert(1, "--no-sandbox")
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    finally:
        srv.stop(120)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img/cluster-page.png"))
