"""Shared fixtures: small job configs that run in seconds on 2 CPU cores."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import leaks
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
leaks.mark()  # every process the tests start inherits it: the session's end finds those left running


def _fork_dask_workers() -> None:
    """Dask's local worker processes forked from one process that has imported distributed and what a worker
    imports at its start (`dask_tasks._warm_up`: transformers, the torch engine, the built-in operators) once,
    by multiprocessing's forkserver as distributed's own test suite does, not started as fresh interpreters that
    import it all again (5-6 s of CPU per worker, measured). Dask reads the method from the environment, so the
    servers and scripts the tests start fork theirs too (with distributed's preload only).
    `DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD=spawn` starts them as a user's cluster does. The forkserver
    starts with the first worker, in the environment of that moment (Nanny's PYTHONHASHSEED among it), and
    stays (tests/leaks.py leaves it)."""
    method = os.environ.setdefault("DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD", "forkserver")
    if method != "forkserver":
        return
    import multiprocessing.forkserver as forkserver

    set_preload = forkserver.set_forkserver_preload  # (distributed calls it once, with its own list)

    def with_a_workers_imports(modules: list[str]) -> None:
        from plexrl.operator import BUILTIN_OPERATORS

        ours = ["plexrl.runtime.dask_tasks", "transformers.models.auto.modeling_auto",
                "transformers.models.llama.modeling_llama", "plexrl.engines.torch_engine",
                *sorted({ref.partition(":")[0] for ref in BUILTIN_OPERATORS.values()})]  # fmt: skip
        set_preload([*modules, *(m for m in ours if m not in modules)])

    forkserver.set_forkserver_preload = with_a_workers_imports


_fork_dask_workers()

TINY: dict[str, Any] = {
    "name": "tiny",
    "seed": 0,
    "iterations": 2,
    "model": {"layers": 1, "hidden": 32, "heads": 2, "intermediate": 64},
    "task": {"digits": 2, "train_size": 200, "eval_size": 16},
    "warm_start": {"max_steps": 4, "batch_size": 16, "eval_every": 2, "eval_size": 16, "stop_at_accuracy": 0.9},
    "pipeline": {
        "name": "grpo",
        "params": {
            "batch_size": 4,
            "n": 4,
            "max_new_tokens": 4,
            "eval_every": 2,
            "eval_size": 16,
            "normaliser": {"skip_zero_advantage": False},
        },
    },
    "tracking": {"progress": False, "log_model": False},
}


@pytest.fixture
def tiny_config(tmp_path: Path) -> dict[str, Any]:
    """A complete job config (dict) for a tiny model, with its run directory under tmp_path."""
    cfg = copy.deepcopy(TINY)
    cfg["run_dir"] = str(tmp_path / "runs")
    return cfg


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    """Fails the run (at its end) if a test left a process, a daemon or a Tinker SDK client behind; ends them."""
    import time

    since = time.time() - 1.0
    yield
    import sys

    for pools in ("plexrl.reward_workers", "plexrl.runtime.cpu_nodes"):  # workers kept for the next call,
        if pools in sys.modules:  # closed at exit otherwise
            sys.modules[pools].POOL.close()
    problem = leaks.check(since)
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(autouse=True)
def _no_env_tracking_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


class Clock:
    """A settable clock for the pure planner tests: `t` is the time now; `step` > 0 moves it on at every read."""

    def __init__(self, step: float = 0.0) -> None:
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def local_runner(services: int = 1, *, validate: bool = True, ordering: Any = None, **kwargs: Any) -> Any:
    """The one Runner over an in-process executor, with the planner's invariants and the services' state
    checksums checked after every event (what the tests want; production runs leave them off). `ordering`: the
    planner's; `kwargs`: the runner's (`hooks`, `budgets`, ...)."""
    from plexrl.planner import Planner
    from plexrl.runtime import InlineExecutor, Runner

    executor = InlineExecutor(services=services, validate=validate)
    return Runner(executor, Planner(clock=executor.clock, validate=validate, ordering=ordering), **kwargs)


VOLATILE = ("time/", "tokens_per_s")  # metrics that depend on the machine's speed, not on what was learned


def stable(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """A job's metric rows without the timing keys: what must match exactly between two runs."""
    return [{k: v for k, v in row.items() if not any(s in k for s in VOLATILE)} for row in history]


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """Wrap `owner.name` (for the test) so that each call records the length of its first argument (how many
    engines or sessions one call served); the list of those lengths, filled as calls come."""
    seen: list[int] = []
    real = getattr(owner, name)

    def counted(first: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(len(first))
        return real(first, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return seen


def wait_for(check: Any, what: str, timeout: float = 60.0, interval: float = 0.02) -> Any:
    """Poll `check()` until it returns something truthy (returned), failing after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def shipped_data(path: Path, tmp_path: Path) -> list[str]:
    """Overrides (`key=value`) under which a shipped config validates on a fresh clone: a job on data files opens
    them when validated, and the real-model configs name files that `benchmarks/real_model.py --write-data`
    writes into the ignored runs/; small ones are written into `tmp_path` (caches too) instead."""
    import yaml

    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), dict):
        return []
    import sys

    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        from real_model import write_data
    finally:
        sys.path.remove(benchmarks)
    train, held_out = write_data(tmp_path / "data", train=200, held_out=50)
    return [f"data.train={train}", f"data.held_out={held_out}", f"run_dir={tmp_path}"]


def tinker_server_config(
    tmp: Path, model_dir: Path, *, port: int = 0, cluster: dict[str, Any] | None = None, **fields: Any
) -> Any:
    """The `plexrl serve` config the Tinker tests start: in this process (`driver: local`) with one service, its
    journal and run directory under `tmp`, no MLflow, paths allowed under `tmp` and the model's folder
    (`model_dir`: `smol_tiny`). `cluster`: more of the cluster section (e.g. `max_load`); `fields`: the rest."""
    from plexrl.server.config import ServerConfig

    return ServerConfig(
        port=port, journal=str(tmp / "journal.db"), run_dir=str(tmp / "runs"), mlflow=False,
        cluster={"driver": "local", "services": {"count": 1}, **(cluster or {})},
        allowed_roots=[str(tmp), str(model_dir.parent)], **fields,
    )  # fmt: skip


@contextlib.contextmanager
def tinker_served(tmp: Path, model_dir: Path, **kwargs: Any) -> Iterator[Any]:
    """A `plexrl serve` of `tinker_server_config(tmp, model_dir, **kwargs)` while in the block (a module's server
    fixture: `with tinker_served(...) as srv: yield srv`), stopped after it."""
    from plexrl.server.api import start_server

    srv = start_server(tinker_server_config(tmp, model_dir, **kwargs))
    try:
        yield srv
    finally:
        srv.stop(120)


@pytest.fixture(scope="session")
def smol_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (1 layer, hidden 32) with the REAL SmolLM2-135M-Instruct tokenizer and chat template
    (converted at set-up by `make setup`, or here on first use): a real tokenizer at test speed."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from plexrl.job.pretrained import pretrained_path

    real = pretrained_path("smollm2-135m-instruct")
    out = tmp_path_factory.mktemp("smol-tiny")
    tok = AutoTokenizer.from_pretrained(str(real))
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    import torch

    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig.from_pretrained(str(real)).save_pretrained(out)
    return out
