"""Cache writes under concurrency (plexrl/cache_files.py): one data file prepared from many threads and
processes at once, and a server scenario (two users, one parquet file, submitted together:
the second job failed with `FileNotFoundError: .train-<key>.arrow.<pid>.tmp -> train-<key>.arrow`)."""

from __future__ import annotations

import copy
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import TINY, wait_for
from test_data_files import write_jsonl, write_verl_parquet

from plexrl.cache_files import key_lock, write_atomic
from plexrl.data.config import DataConfig
from plexrl.data.dataset import open_dataset

THREADS = 8


def open_together(cfg: DataConfig, cache: Path, threads: int = THREADS) -> list[Any]:
    """`open_dataset(cfg, cache)` on `threads` threads released at the same moment; each result or error."""
    barrier = threading.Barrier(threads)
    results: list[Any] = [None] * threads

    def one(i: int) -> None:
        barrier.wait()
        try:
            data = open_dataset(cfg, cache)
            results[i] = [data.train[k].ground_truth for k in range(len(data.train))]
        except BaseException as exc:
            results[i] = exc

    workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    return results


@pytest.mark.parametrize("kind", ["parquet", "csv", "jsonl"])
def test_one_data_file_prepared_from_many_threads_at_once(tmp_path: Path, kind: str) -> None:
    rows = 3000  # big enough that copies overlap
    if kind == "parquet":
        path = write_verl_parquet(tmp_path / "train.parquet", rows)
    elif kind == "csv":
        path = tmp_path / "train.csv"
        path.write_text("prompt,answer\n" + "".join(f"what is {i}?,{i}\n" for i in range(rows)))
    else:
        path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(rows)])
    cfg = DataConfig.model_validate({"train": str(path), "held_out_fraction": 0.1})
    results = open_together(cfg, tmp_path / "cache")
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[0]
    assert all(r == results[0] for r in results) and len(results[0]) == rows - rows // 10
    assert not list((tmp_path / "cache").glob("*.tmp")) and not list((tmp_path / "cache").glob(".*.tmp"))


def test_one_parquet_prepared_by_several_processes_at_once(tmp_path: Path) -> None:
    path = write_verl_parquet(tmp_path / "train.parquet", 3000)
    go = tmp_path / "go"
    script = (
        "import sys, time, os\n"
        "from pathlib import Path\n"
        "from plexrl.data.config import DataConfig\n"
        "from plexrl.data.dataset import open_dataset\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        f"data = open_dataset(DataConfig(train={str(path)!r}), Path({str(tmp_path / 'cache')!r}))\n"
        "print(len(data.train), data.train[7].ground_truth)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    go.touch()
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outs == ["3000 9\n"] * 3


def test_a_key_lock_holds_threads_and_write_atomic_leaves_no_half_file(tmp_path: Path) -> None:
    target, inside, order = tmp_path / "k" / "value.bin", threading.Event(), []
    release = threading.Event()

    def first() -> None:
        with key_lock(target):
            inside.set()
            order.append("first in")
            release.wait(30)
            order.append("first out")

    def second() -> None:
        inside.wait(30)
        with key_lock(target):
            order.append("second in")

    a, b = threading.Thread(target=first), threading.Thread(target=second)
    a.start()
    b.start()
    inside.wait(30)
    release.set()
    a.join(30)
    b.join(30)
    assert order == ["first in", "first out", "second in"]

    def broken(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, broken)
    assert not target.exists() and list(target.parent.iterdir()) == [target.parent / ".value.bin.lock"]


def test_two_users_one_data_file_submitted_together_to_a_server(tmp_path: Path, smol_tiny: Path) -> None:
    """Through `plexrl serve`: ann's and bob's jobs (two each) name one parquet file and are submitted
    at the same moment; the server prepares all four at once (real preparation: data opened, checked and
    copied to Arrow on the server's preparation threads) and all run (a simulated runner: the data, not
    training, is tested)."""
    from test_server import serving, sim_prepare

    from plexrl.server.api import prepare_entry
    from plexrl.server.client import Client

    data = write_verl_parquet(tmp_path / "shared.parquet", 100_000)
    job = copy.deepcopy(TINY)
    job.update(model={"path": str(smol_tiny)}, warm_start={"enabled": False}, engine="torch")
    job["data"] = {"train": str(data), "held_out_fraction": 0.1, "rewards": [{"name": "exact"}]}
    prepared: list[str] = []
    together = threading.Barrier(4)

    def prepare(entry: Any, cancel: threading.Event | None = None) -> Any:
        together.wait(60)  # both preparations start at once, as two free preparation threads would
        spec = prepare_entry(entry, cancel)  # the real thing: opens and caches the data
        prepared.append(entry.user)
        assert len(spec.task.train) == 90_000
        return sim_prepare(entry)

    users = {"ann": "a" * 20, "bob": "b" * 20}
    roots = [str(tmp_path), str(smol_tiny.parent)]
    # jobs not private: all four share one run_dir and so one data cache (private jobs would get one each)
    with serving(tmp_path, prepare=prepare, prepare_workers=4, users=users, allowed_roots=roots,
                 private_jobs=False) as srv:  # fmt: skip
        submissions = [(user, k) for user in users for k in range(2)]
        for user, k in submissions:
            (tmp_path / f"{user}{k}.yaml").write_text(
                yaml.safe_dump({**job, "name": f"{user}-job{k}", "run_dir": str(tmp_path / "runs")})
            )
        barrier, ids = threading.Barrier(len(submissions)), {}

        def submit(user: str, k: int) -> None:
            barrier.wait()
            ids[user, k] = Client(srv.url, token=users[user]).submit(tmp_path / f"{user}{k}.yaml")["job_id"]

        threads = [threading.Thread(target=submit, args=s) for s in submissions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert set(ids) == set(submissions)
        for who, job_id in ids.items():
            entry = wait_for(lambda j=job_id: (e := srv.journal.get(j)) and e.status in ("done", "failed") and e, who)
            assert entry.status == "done", f"{who}'s job: {entry.reason}"
    assert sorted(prepared) == ["ann", "ann", "bob", "bob"]


def test_a_model_preparation_waits_for_another_process_preparing_the_same_cache_entry(tmp_path: Path) -> None:
    """The warm-start cache (plexrl/job/models.py) is locked across processes too: while another process
    holds a cache entry's lock, a preparation of the same entry waits (and a cancel ends the wait); it
    used to lock threads of one process only."""
    from plexrl.job.models import PreparationCancelled, _cache_lock

    root, held, release = tmp_path / "cache" / "abc", tmp_path / "held", tmp_path / "release"
    script = (
        "import os, time\n"
        "from pathlib import Path\n"
        "from plexrl.cache_files import key_lock\n"
        f"with key_lock(Path({str(root)!r})):\n"
        f"    Path({str(held)!r}).touch()\n"
        f"    while not os.path.exists({str(release)!r}): time.sleep(0.01)\n"
    )
    other = subprocess.Popen([sys.executable, "-c", script])
    try:
        wait_for(held.exists, "the other process holds the lock")
        cancel = threading.Event()
        cancel.set()
        with pytest.raises(PreparationCancelled, match="the wait for another preparation"), _cache_lock(root, cancel):
            pass
    finally:
        release.touch()
        assert other.wait(60) == 0
    with _cache_lock(root, threading.Event()):  # free again
        pass
