"""Every state move is accounted for (`plexrl.reports.MoveRecord`): tiers, bytes, copy calls, buffers made vs
reused, page faults, queued / copy / wait seconds, the thread it ran on and why it was not one copy; the
records reach the node reports, the service's report and the timeline. A job's state stays one flat buffer
across training, so a steady-state move is one copy into a reused buffer and allocates nothing."""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from conftest import TINY

from plexrl.hooks.timeline import TimelineRecorder
from plexrl.job.load import load_job
from plexrl.job.spec import JobSpec, prepare_job
from plexrl.planner.state import Move
from plexrl.reports import MoveRecord, NodeReport
from plexrl.services.host import Layout
from plexrl.services.records import format_summary, summarize
from plexrl.services.service import Service


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> JobSpec:
    cfg: dict[str, Any] = copy.deepcopy(TINY)
    cfg["run_dir"] = str(tmp_path_factory.mktemp("moves") / "runs")
    cfg["tracking"]["mlflow"] = False
    return prepare_job(load_job(cfg))


def train(svc: Service, job_id: str, steps: int = 2) -> None:
    """`steps` AdamW steps of the job's engine on a fixed batch (the optimizer's moments appear at the first)."""
    engine = svc.engines[job_id]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (4, 6), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mask": torch.ones_like(ids).float()}

    def loss_fn(mb: dict[str, torch.Tensor], logp: torch.Tensor, *_: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return -(logp * mb["mask"]).mean(), {}

    engine.train_step(batch, loss_fn, temperature=1.0, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0,
                      minibatches=steps)  # fmt: skip


def cycle(svc: Service, job_id: str) -> list[MoveRecord]:
    svc.apply([Move(job_id, "device", "host", 0)])
    svc.apply([Move(job_id, "host", "device", 0)])
    return svc.move_log.drain()


def flat(svc: Service, job_id: str) -> bool:
    live = svc.engines[job_id].state_tensors()
    return Layout.of(live).flat_of(live) is not None


def test_each_move_is_recorded_with_its_tiers_bytes_copies_and_buffers(job: JobSpec, tmp_path: Path) -> None:
    svc = Service("s0", spill_dir=tmp_path / "spill")
    j = job.job_id
    nbytes = svc.load_job(job)
    assert flat(svc, j)  # one flat buffer from its load, optimizer moments included
    svc.apply([Move(j, "device", "host", 0), Move(j, "host", "disk", 0), Move(j, "disk", "device", 0)])
    out, to_disk, back = svc.move_log.drain()
    assert [(r.src, r.dst) for r in (out, to_disk, back)] == [("device", "host"), ("host", "disk"), ("disk", "device")]
    assert all(r.job == j and r.nbytes == nbytes and not r.background for r in (out, to_disk, back))
    assert (out.copies, out.why, out.made) == (1, "", 1)  # one copy into a fresh host buffer
    assert to_disk.copies == 1 and to_disk.why == ""  # one write of the flat host buffer
    assert back.copies == 2 and "through a host buffer" in back.why  # read into host, one copy to device
    assert all(r.copy > 0 and r.wait >= 0 and r.queued >= 0 and r.lane for r in (out, to_disk, back))
    assert all(0 < r.cpu <= r.copy + r.wait + 0.01 for r in (out, to_disk, back))  # its thread's seconds on a core
    assert svc.move_log.drain() == []
    totals = svc.report()["move_records"]
    assert totals["moves"] == 3 and totals["bytes"] == 3 * nbytes and totals["copies"] == 4
    svc.close()


def test_a_state_that_is_not_one_buffer_moves_tensor_by_tensor_and_says_why() -> None:
    from plexrl.services.swap import StateLocation

    svc = Service("s0")
    svc.engines["x"] = Tensors({"w": torch.ones(1000), "m": torch.zeros(10, 10)})
    svc.states["x"] = StateLocation("device", nbytes=4400)
    out, back = cycle(svc, "x")
    assert out.copies == 2 and out.why == "state in 2 buffers, 2 tensors (first out of place: m)"
    assert back.copies == 1 and back.why == ""  # swapped in as one buffer
    assert cycle(svc, "x")[0].copies == 1
    svc.close()


def test_training_keeps_the_state_one_flat_buffer_and_steady_moves_allocate_nothing(job: JobSpec) -> None:
    """The optimizer's moments exist from the load (`TorchEngine.init_optimizer_state`) as views of the job's
    one buffer; AdamW, clipping and the bf16 master copy write into them in place. A training step that put a
    tensor outside the buffer (a re-allocated parameter, a new moment) fails here."""
    svc = Service("s0")
    j = job.job_id
    svc.load_job(job)
    assert flat(svc, j)
    for _ in range(3):
        train(svc, j)
        assert flat(svc, j), "training moved a tensor out of the job's flat buffer"
        out, back = cycle(svc, j)
        assert (out.copies, out.why, back.copies, back.why) == (1, "", 1, "")
    for _ in range(2):
        train(svc, j)
        out, back = cycle(svc, j)
        assert out.made == back.made == 0 and out.reused == back.reused == 1, "a steady-state move allocated"
    svc.close()


def test_eager_optimizer_state_trains_bit_identically(job: JobSpec) -> None:
    """Moments made before the first step (zeros, step 0) give the same numbers as AdamW making them at its
    first step (the tiny job's engine carries its warm start's moments: both copies drop them)."""
    svc = Service("s0")
    svc.load_job(job)
    eager, lazy = copy.deepcopy(svc.engines[job.job_id]), copy.deepcopy(svc.engines[job.job_id])
    eager.optimizer = lazy.optimizer = None
    eager.init_optimizer_state()
    for e in (eager, lazy):
        svc.engines["t"] = e
        train(svc, "t", steps=3)
    a, b = eager.state_tensors(), lazy.state_tensors()
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    svc.close()


class Tensors:
    """An engine stand-in whose state is `tensors` (what a service's moves read)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.tensors


def test_a_fresh_buffer_shows_its_page_faults_and_a_reused_one_takes_fewer() -> None:
    from plexrl.services.swap import StateLocation

    svc = Service("s0")
    size = 48 << 20  # above glibc's largest mmap threshold: a fresh buffer is fresh pages
    svc.engines["x"] = Tensors({"w": torch.ones(size // 8), "m": torch.ones(size // 8)})
    svc.states["x"] = StateLocation("device", nbytes=size)
    first = cycle(svc, "x")  # fresh host and device buffers: first touches of their pages
    steady = cycle(svc, "x")
    if first[0].faults < 0:
        pytest.skip("no per-thread page-fault count on this platform")
    assert first[0].faults >= 16 and first[1].faults >= 16  # (one a page or two here; fewer with huge pages)
    assert (steady[0].made, steady[1].made) == (0, 0)
    assert steady[0].faults + steady[1].faults < (first[0].faults + first[1].faults) / 4
    svc.close()


def test_a_large_fresh_buffer_faults_in_huge_pages_where_the_kernel_offers_them() -> None:
    """A fresh buffer of `HUGE_MIN` or more is advised for transparent huge pages: its first copy faults per 2 MiB,
    not per 4 KiB (a 2.15 GB state: 525,449 faults and 0.91 s here without the advice, 1,674 and 0.30 s with)."""
    from plexrl.services.host import HUGE_MIN
    from plexrl.services.records import thread_faults
    from plexrl.services.swap import StateLocation

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.is_file() or "[never]" in thp.read_text() or thread_faults() < 0:
        pytest.skip("no transparent huge pages or no per-thread page-fault count on this platform")
    svc = Service("s0")
    size = 2 * HUGE_MIN
    svc.engines["x"] = Tensors({"w": torch.ones(size // 4)})
    svc.states["x"] = StateLocation("device", nbytes=size)
    out, back = cycle(svc, "x")  # a fresh host buffer, then a fresh device one
    assert (out.made, back.made) == (1, 1)
    small = size // 4096  # 32,768 faults in 4 KiB pages
    assert out.faults < small // 8 and back.faults < small // 8, (out.faults, back.faults)
    svc.close()


def test_background_moves_record_their_queueing_and_reach_the_next_node_report(job: JobSpec) -> None:
    svc = Service("s0")
    j = job.job_id
    svc.load_job(job, tier="host")
    svc.move_log.drain()
    svc._start_prefetch([Move(j, "host", "device", 0)])
    res = svc.run_node(j, -1, "evaluate", {})
    assert res.report.ok, res.report.error
    (rec,) = res.report.moves
    assert rec.background and rec.lane.startswith("s0-prefetch") and rec.dst == "device" and rec.queued >= 0
    # a report that crossed a process as plain data gets its records back (`dataclasses.asdict`)
    again = NodeReport(**dataclasses.asdict(res.report))
    assert again.moves == [rec]
    svc.close()


def test_a_cpu_services_background_moves_run_ahead_of_its_nodes_where_the_system_permits(job: JobSpec) -> None:
    """On a CPU the background thread copies on the node threads' cores: it asks to run `MOVES_AHEAD` nice levels
    above the thread that made the service; where that is not permitted it stays level and says so."""
    from plexrl.services.moves import run_ahead, thread_nice
    from plexrl.services.service import MOVES_AHEAD

    base = thread_nice()
    assert base is not None  # (Linux)
    permitted: list[bool] = []
    probe = threading.Thread(target=lambda: permitted.append(run_ahead(1, base)))  # what this process may do
    probe.start()
    probe.join(30)
    svc = Service("s0")
    j = job.job_id
    svc.load_job(job, tier="host")
    svc._start_prefetch([Move(j, "host", "device", 0)])
    svc.background.wait_all()
    tid = svc.background.native_id
    assert tid > 0 and svc.background.lifted == permitted[0]
    assert thread_nice(tid) == (max(base - MOVES_AHEAD, -20) if permitted[0] else base)
    assert svc.report()["moves_ahead"] == (MOVES_AHEAD if permitted[0] else 0)
    assert thread_nice() == base  # the caller's own thread is left as it was
    svc.close()


def test_summaries_and_the_timeline_keep_the_records(tmp_path: Path) -> None:
    recs = [
        MoveRecord("a", "device", "host", 2_000_000_000, 1, 0, 1, 3, 0.5, 1.0, 0.1, "t", False, "", 10.0),
        MoveRecord("b", "host", "device", 1_000_000_000, 9, 1, 0, 250, 0.0, 1.0, 0.0, "t", True, "state in 9", 11.0),
    ]
    s = summarize(recs)
    assert (s["moves"], s["bytes"], s["copies"], s["made"], s["reused"], s["faults"]) == (2, 3e9, 10, 1, 1, 253)
    assert (s["one_copy"], s["background"], s["copy_s"]) == (1, 1, 2.0) and s["gbps"] == pytest.approx(1.5)
    assert (s["background_bytes"], s["background_copy_s"]) == (1e9, 1.0)  # (what a copy beside compute bounds)
    assert summarize([json.loads(json.dumps(r.__class__.__dict__ and _plain(r))) for r in recs]) == s
    assert (s["fresh"], s["fresh_bytes"], s["fresh_copy_s"]) == (1, 1e9, 1.0)  # b's move made its buffer
    line = format_summary(s, bound_gbps=6.0)
    assert "moves 2 (1 one copy, 1 background)" in line and "4.0x" in line
    assert "1 into fresh buffers 1.00 s (1.00 GB/s), the rest 2.00 GB/s (3.0x the bound)" in line
    against = format_summary(s, bound_gbps=6.0, fresh_gbps=0.5)  # a first touch measured at half that speed
    assert "1 into fresh buffers 1.00 s (1.00 GB/s, a copy into fresh memory here 0.50 GB/s: 0.5x)" in against
    assert "on a core" not in line  # records from before the CPU seconds were kept say nothing of them
    timed = summarize([*recs, dataclasses.replace(recs[0], copy=2.0, wait=0.0, cpu=0.5)])
    assert (timed["cpu_s"], timed["timed_s"]) == (0.5, 2.0) and "on a core 25% of it" in format_summary(timed)

    class Run:
        job_id = "a"
        artifacts: ClassVar[dict[str, Path]] = {}

    tl = TimelineRecorder(tmp_path, draw=False)
    tl.on_start(5.0)
    tl.on_move(Run(), "s0", recs[0])  # type: ignore[arg-type]
    tl.on_job_end(Run())  # type: ignore[arg-type]
    written = json.loads((tmp_path / "a" / "moves.json").read_text())
    assert written[0]["service"] == "s0" and written[0]["start"] == 5.0 and written[0]["nbytes"] == 2_000_000_000


def _plain(r: MoveRecord) -> dict[str, Any]:
    return dataclasses.asdict(r)


def test_the_simulators_swap_constants_fit_from_recorded_moves() -> None:
    from plexrl.sim.costs import fit_swap

    def rec(nbytes: int, seconds: float, background: bool = False) -> dict[str, Any]:
        r = MoveRecord("a", "device", "host", nbytes, 1, 0, 1, 0, 0.0, seconds * 0.9, seconds * 0.1, "t", background)
        return _plain(r)

    line = [rec(n, n / 5e9 + 0.02) for n in (10**8, 5 * 10**8, 2 * 10**9)]  # 5 GB/s and 20 ms a move
    fit = fit_swap(line)
    assert fit.bandwidth == pytest.approx(5e9, rel=1e-6) and fit.fixed_s == pytest.approx(0.02, rel=1e-6)
    assert (fit.moves, fit.nbytes) == (3, 26 * 10**8)
    one = fit_swap([rec(10**9, 0.5), rec(10**9, 0.3, background=True)])  # one size: through the origin
    assert one.fixed_s == 0.0 and one.bandwidth == pytest.approx(2e9 / 0.8)
    assert fit_swap([rec(10**9, 0.5), rec(10**9, 0.3, background=True)], background=True).bandwidth == (
        pytest.approx(10**9 / 0.3)
    )
    assert fit_swap([]).bandwidth == float("inf")


def test_a_multiplexed_run_keeps_every_move_in_its_timeline(tmp_path: Path) -> None:
    """Through the runner: every move a service made (blocking and background) reaches the timeline once, with
    its service, and each job's records are written beside its timeline (the MLflow artifact)."""
    from conftest import local_runner

    from plexrl.runtime import Budgets

    jobs = []
    for name, seed in (("a", 0), ("b", 1)):
        cfg: dict[str, Any] = copy.deepcopy(TINY)
        cfg.update(name=name, seed=seed, iterations=2, run_dir=str(tmp_path / "runs"))
        cfg["tracking"]["mlflow"] = False
        jobs.append(prepare_job(load_job(cfg)))
    size = max(j.state_bytes() for j in jobs)
    timeline = TimelineRecorder(tmp_path / "timelines", draw=False)
    runner = local_runner(services=1, budgets=Budgets(device=size), hooks=[timeline])
    runs = runner.run(jobs)
    assert [r.status for r in runs] == ["done", "done"], [r.error for r in runs]
    report = runner.service_reports["service-0"]
    assert report["moves"] > 0 and report["move_records"]["moves"] == report["moves"]
    assert len(timeline.moves) == report["moves"]  # each move once, none lost between reports
    assert sum(m["nbytes"] for m in timeline.moves) == report["bytes_moved"]
    assert {m["service"] for m in timeline.moves} == {"service-0"} and {m["job"] for m in timeline.moves} == {"a", "b"}
    for run in runs:
        written = json.loads(run.artifacts["moves.json"].read_text())
        assert written and all(m["job"] == run.job_id for m in written)
