"""A real `plexrl serve` process killed with SIGKILL right after an `optim_step` whose result its Tinker client
received, then started again on the same journal: the session resumes at that step, with the same weights (the
step was journalled before it was answered: `checkpoint_every: 1`). The in-process restarts of
tests/test_tinker_durable.py stop the server; this one gives it no chance to write anything at the end.
Lean: the tiny model, one step, every wait with a deadline."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import wait_for

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402

DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([1, 4, 9, 16]),
    loss_fn_inputs={"target_tokens": [4, 9, 16, 25], "weights": [1.0, 1.0, 1.0, 1.0]},
)


def loss(training: object) -> float:
    out = training.forward([DATUM], "cross_entropy").result(timeout=120)  # type: ignore[attr-defined]
    return float(out.metrics["loss:sum"])


def serve(config: Path, log: Path, url: str) -> subprocess.Popen[bytes]:
    """`plexrl serve --config config`, its output in `log`; returns once it answers at `url`."""
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "plexrl.cli", "serve", "--config", str(config)], stdout=out,
                                stderr=subprocess.STDOUT, cwd=config.parent)  # fmt: skip

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"plexrl serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, "plexrl serve to answer", timeout=120)
    return proc


def test_an_answered_optim_step_survives_a_kill_9_of_the_server(tmp_path: Path, smol_tiny: Path) -> None:
    with socket.socket() as s:  # one port for both processes: the client keeps its base_url
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({
        "port": port, "journal": str(tmp_path / "journal.db"), "run_dir": str(tmp_path / "runs"), "mlflow": False,
        "checkpoint_every": 1, "allowed_roots": [str(tmp_path), str(smol_tiny.parent)],
        "cluster": {"driver": "local", "services": {"count": 1}, "max_load": 64},
    }))  # fmt: skip
    url, log = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    proc = serve(config, log, url)
    service = tinker.ServiceClient(base_url=url, api_key="tml-ann")
    try:
        training = service.create_lora_training_client(base_model=str(smol_tiny), rank=4, seed=5).result()
        before = loss(training)
        training.forward_backward([DATUM], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=0.05)).result(timeout=120)  # answered: told the client
        after = loss(training)
        assert after != before  # (the step changed the weights: resuming before it would show)
        proc.send_signal(signal.SIGKILL)  # right after the answer: nothing is written at the end
        assert proc.wait(60) == -signal.SIGKILL
        proc = serve(config, log, url)
        assert loss(training) == after  # the same client, the same weights: resumed at the answered step
        training.forward_backward([DATUM], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=0.05)).result(timeout=120)  # and it trains on from there
        assert loss(training) < after
    finally:
        if proc.poll() is None:
            service.close("success").result(timeout=60)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
