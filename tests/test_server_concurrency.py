"""A server with `driver: local` builds models on its preparation threads while its runner thread loads jobs onto
in-process services: model construction is serialized (`plexrl.job.construction.model_construction`), a job whose load
fails fails alone, and the runner's records are written by its own thread only."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY, local_runner

from plexrl.hooks.base import Hook, HookFailed
from plexrl.job.load import load_job
from plexrl.job.spec import JobRun, JobSpec, prepare_job
from plexrl.planner import Planner
from plexrl.runtime.inline import InlineExecutor
from plexrl.runtime.runner import Runner
from plexrl.runtime.sim import GB, GRPO_ORDER, SeededCosts, SimExecutor, SimJob, grpo_like_jobs, grpo_nodes
from plexrl.server.controller import Controller, runner_of
from plexrl.server.journal import JobEntry, Journal


def quick_job(run_dir: Path, seed: int, **fields: Any) -> dict[str, Any]:
    """TINY with a one-step warm start (one model load, no evaluation) and a small task: quick to prepare."""
    cfg = copy.deepcopy(TINY)
    cfg.update(run_dir=str(run_dir), seed=seed, name=f"job{seed}", **fields)
    cfg["task"] = {"digits": 2, "train_size": 32, "eval_size": 8}
    cfg["warm_start"] = {"max_steps": 1, "batch_size": 4, "eval_every": 2, "eval_size": 8}
    return cfg


def test_overlapping_preparations_and_loads_all_succeed(tmp_path: Path) -> None:
    """20 prepare + load cycles on 4 threads at once: each builds a model, warm-starts it (a model load) and
    loads it on an in-process service. Unserialized, transformers' process-global init patches overlap and
    every load fails with 'Cannot copy out of meta tensor', and so does every later load of the process."""
    threads, cycles = 4, 5
    barrier = threading.Barrier(threads, timeout=120)
    errors: list[str] = []
    loaded: list[str] = []

    def work(k: int) -> None:
        ex = InlineExecutor()
        ex.start()
        try:
            barrier.wait()
            for i in range(cycles):
                seed = k * cycles + i
                try:
                    spec = prepare_job(load_job(quick_job(tmp_path / "runs", seed)))
                    ex.ship(spec)
                    ex.load(spec.job_id, "service-0", "device")
                    (done,) = ex.wait(0)
                    if done.report.error is not None:
                        errors.append(f"load of {spec.job_id}: {done.report.error}")
                        continue
                    engine = ex.services["service-0"].engines[spec.job_id]
                    if any(p.is_meta for p in engine.policy.parameters()):
                        errors.append(f"{spec.job_id} loaded with meta tensors")
                        continue
                    loaded.append(spec.job_id)
                    ex.release(spec.job_id, "service-0")
                except Exception as exc:
                    errors.append(f"cycle {seed}: {type(exc).__name__}: {exc}")
        finally:
            ex.close()

    workers = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(600)
    assert not any(t.is_alive() for t in workers), "the cycles did not end within 600 s"
    assert errors == [] and len(loaded) == threads * cycles, errors[:3]


def broken_copy(spec: JobSpec, where: Path) -> JobSpec:
    """`spec` as job "bad", whose model's weights file is garbage (of the same size): its load raises."""
    where.mkdir()
    for f in spec.model_path.iterdir():
        if f.is_file():
            data = f.read_bytes()
            (where / f.name).write_bytes(b"\x00" * len(data) if f.suffix == ".safetensors" else data)
    return dataclasses.replace(spec, job_id="bad", model_path=where)


class Seen(Hook):
    def __init__(self) -> None:
        self.after: list[tuple[str, str]] = []

    def after_node(self, run: JobRun, iteration: int, node: str, *args: Any) -> None:
        self.after.append((run.job_id, node))


def test_a_job_whose_load_fails_fails_alone_and_none_of_its_nodes_runs(tmp_path: Path) -> None:
    """The planner sends the job's first node (the baseline evaluation, a service node) right behind its load;
    the load fails: the node is not run, its report reaches nobody, the job fails with the load's error, and
    the other job on the same service runs to the end."""
    good = prepare_job(load_job(quick_job(tmp_path / "runs", 0, iterations=2)))
    bad = broken_copy(good, tmp_path / "broken")
    seen = Seen()
    runner = local_runner(hooks=[seen])
    runs = runner.run([bad, dataclasses.replace(good, job_id="good")])
    status = {r.job_id: (r.status, r.iterations_done) for r in runs}
    assert status == {"bad": ("failed", 0), "good": ("done", 2)}, [r.error for r in runs]
    assert runs[0].error.startswith("loading the job on service-0: "), runs[0].error
    assert [n for j, n in seen.after if j == "bad"] == []  # no node of it ran, nor reported
    assert ("good", "evaluate") in seen.after


class RaiseOnIteration(Hook):
    required = True

    def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        raise OSError("the journal's disk is full")


def test_an_interrupted_server_runner_closes_its_jobs_while_forgetting_them() -> None:
    """A required hook fails with jobs open in a runner that forgets ended jobs (the server's): every open job
    is closed, and the error is the hook's, not 'dictionary changed size during iteration'."""
    closed: list[str] = []
    ex = SimExecutor(2, SeededCosts(seed=0))
    runner = Runner(
        ex,
        Planner(clock=ex.clock, validate=True),
        hooks=[RaiseOnIteration()],
        forget_ended=True,
        on_closed=lambda run: closed.append(run.job_id),
    )
    jobs = grpo_like_jobs(3, (3, 5), seed=0)
    with pytest.raises(HookFailed, match="the journal's disk is full"):
        runner.run(jobs)
    assert sorted(closed) == sorted(j.job_id for j in jobs) and runner.runs == {}


def sim_prepare(entry: JobEntry) -> SimJob:
    nodes = grpo_nodes(every=2)
    return SimJob(entry.job_id, nodes, entry.iterations, {n: 0.1 for n in nodes}, GRPO_ORDER, (), GB, user=entry.user)


def test_concurrent_submits_cancels_and_status_reads_leave_the_runner_healthy(tmp_path: Path) -> None:
    """Three threads at once against one controller whose runner forgets ended jobs: one submits 60 jobs, one
    cancels every other job as soon as it is submitted, one reads statuses and the controller's health. The
    runner thread stays alive, every job ends (done or cancelled), and nothing of them stays in the runner."""
    journal = Journal(tmp_path / "journal.db")
    runner = runner_of(SimExecutor(2, SeededCosts(seed=0)), planner={"validate": True}, forget_ended=True)
    controller = Controller(runner, journal, sim_prepare, prepare_workers=3)
    controller.start()
    n = 60
    submitted: list[str] = []
    to_cancel: list[str] = []
    have = threading.Condition()
    errors: list[BaseException] = []
    deadline = time.monotonic() + 120

    def submitter() -> None:
        try:
            for i in range(n):
                entry = controller.submit(f"j{i}", {}, 3, user=f"user{i % 3}")
                with have:
                    submitted.append(entry.job_id)
                    if i % 2:
                        to_cancel.append(entry.job_id)
                    have.notify_all()
        except BaseException as exc:
            with have:
                errors.append(exc)
                have.notify_all()

    def canceller() -> None:
        try:
            for _ in range(n // 2):
                with have:
                    assert have.wait_for(lambda: to_cancel or errors, timeout=max(deadline - time.monotonic(), 0))
                    if errors:
                        return
                    job_id = to_cancel.pop(0)
                controller.cancel(job_id)
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        try:
            while time.monotonic() < deadline:
                with have:
                    ids = list(submitted)
                for job_id in ids:
                    assert journal.get(job_id) is not None
                assert controller.healthy, controller.failure
                journal.jobs()
                if len(ids) == n and all(journal.get(j).finished for j in ids):  # type: ignore[union-attr]
                    return
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=f, daemon=True) for f in (submitter, canceller, reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0) + 5)
    try:
        assert not any(t.is_alive() for t in threads), "the threads did not end before the deadline"
        assert errors == [] and controller.failure is None and controller.healthy, (errors, controller.failure)
        statuses = {e.job_id: e.status for e in journal.jobs()}
        assert len(statuses) == n and set(statuses.values()) <= {"done", "cancelled"}, statuses
        assert sum(s == "done" for s in statuses.values()) >= n // 2  # the ones nobody cancelled
    finally:
        assert controller.stop(30)
        journal.close()
    assert controller.runner.runs == {}
