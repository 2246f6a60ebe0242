"""A `Service` hosts the engines of every job placed on it, carries out the StateManager's moves, and runs
the jobs' service nodes one at a time (the planner guarantees that; the service does not schedule).

Before a node it applies the blocking moves the planner attached (evictions, then the job's swap-in), then
starts the attached prefetch in a background thread (a separate CUDA stream on GPU) so that the next job's
state arrives while this node computes, and runs the node. It reports the node's own run time and the time
it spent moving state (blocking swaps plus any wait for unfinished background moves) separately: the first
is `busy`, the second `swap` in the accounting. A node ends when its device work does (`StreamOrder.node_end`,
`plexrl/services/streams.py`): on CUDA its queued kernels count as its own time, and no copy of its jobs'
tensors starts before them. In validate mode it checksums a job's state at swap-out and checks it at
swap-in. Host copies are flat per-job buffers from the service's `HostPool` (pinned on CUDA, counted in
`report()`).

Early swaps (lookahead): an executor that sends a service's next node while one runs may start that node's
swaps at once (`start_early`); they run on the background thread once the node before has applied its own
swaps, and the node then only waits for what has not finished (`plexrl/services/moves.py`).

Strict affinity: a job's engine is created here and stays here until the job ends; only its tensors move.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plexrl.engines.slicing import SlicePaused
from plexrl.operator import OpContext
from plexrl.planner.state import Move
from plexrl.reports import MoveRecord, NodeReport
from plexrl.services import swap as sw
from plexrl.services.build import build_engine
from plexrl.services.generators import Generators
from plexrl.services.host import DeviceCache, HostPool
from plexrl.services.moves import BackgroundMoves, SwapStats, hidden_share
from plexrl.services.nodes import NodeResult, chunk_inputs, finish, run_cpu_node
from plexrl.services.records import MoveLog, queued, recorded
from plexrl.services.streams import StreamOrder, stream_order
from plexrl.sizes import uses_critic

if TYPE_CHECKING:
    from plexrl.batch import Batch
    from plexrl.job.spec import JobSpec

__all__ = ["NodeResult", "Service", "chunk_inputs", "run_cpu_node"]  # NodeResult, run_cpu_node: plexrl.services.nodes

log = logging.getLogger(__name__)

MOVES_AHEAD = 5  # a CPU service's background moves run this many nice levels above its nodes, where permitted


class Service:
    def __init__(
        self,
        service_id: str,
        device: str = "cpu",
        *,
        spill_dir: str | Path | None = None,
        validate: bool = False,
        clock: Callable[[], float] = time.time,
        host_memory: int | None = None,
        order: StreamOrder | None = None,
    ) -> None:
        """`host_memory`: the host tier's budget (the host pool stays within it); `order`: the stream order
        (None: the device's, `stream_order`; tests pass a `RecordingOrder`)."""
        import torch

        self.service_id = service_id
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # one GPU per worker: its cuda:0
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.clock = clock
        self.validate = validate
        self._own_spill = spill_dir is None
        self.spill_dir = Path(spill_dir) if spill_dir is not None else Path(tempfile.mkdtemp(prefix="plexrl-spill-"))
        self.jobs: dict[str, JobSpec] = {}
        self.engines: dict[str, Any] = {}
        self.generators = Generators(self.device, clock)  # shared vLLM engines by generator key
        self.bases: dict[str, Any] = {}  # shared LoRA bases by base key (plexrl/engines/lora.py)
        self.states: dict[str, sw.StateLocation] = {}
        self.stats = SwapStats()
        self.move_log = MoveLog()  # every move's record (`plexrl.services.records`), drained into node reports
        self._lock = threading.Lock()  # stats
        self._released: set[str] = set()
        self.paused: dict[tuple[str, int, str, int], Any] = {}  # (job, iteration, node, chunk) -> paused SliceSlot
        self.order = order if order is not None else stream_order(self.device)
        self.host_pool = HostPool(pin=self.device.type == "cuda", limit=host_memory)
        # CUDA: its caching allocator; CPU: one memory, so the cache and the host pool take each other's kept buffers
        self.device_cache = DeviceCache(pool=self.host_pool) if self.device.type == "cpu" else None
        # prefetch and early swaps; `lambda`: a replaced `_move` (a subclass, a test) is the one called
        self.background = BackgroundMoves(service_id, lambda m: self._move(m), self.stats, self._lock, self.order,
                                          ahead=MOVES_AHEAD if self.device.type == "cpu" else 0)  # fmt: skip

    # -- jobs ---------------------------------------------------------------------------------------
    def load_job(self, job: JobSpec, tier: str = "device") -> int:
        """Create the job's engine from its starting model and put its state in `tier` (strict affinity: it
        stays on this service). Returns the state's size in bytes. A job admitted to host or disk is built on
        the host and its tensors go straight to that tier: the device never holds them before the planner
        brings the job in (`plexrl.devices.build_device`; a LoRA job's adapter is made beside its shared base,
        which the planner reserved on the device, and moved out)."""
        engine, built_on = build_engine(job, self.device, tier, self.bases)
        if hasattr(engine, "init_optimizer_state"):  # every tensor of the state exists from the start: the size
            engine.init_optimizer_state(critic=uses_critic(job.graph))  # reported below is the size it keeps
        engine = getattr(job, "session_engine", lambda e: e)(engine)  # a session's (`plexrl.sessions.spec`)
        if job.resume_state is not None:  # the state a checkpoint saved (weights, optimizer, reference, version)
            engine.load_state(sw.load_checkpoint(job.resume_state)["engine"])
        if job.generation == "vllm":
            engine = self._vllm_engine(job, engine)
        self.jobs[job.job_id], self.engines[job.job_id] = job, engine
        self._released.discard(job.job_id)
        self.states[job.job_id] = sw.StateLocation("device", nbytes=sw.nbytes(engine.state_tensors()))
        self.order.node_end([job.job_id])  # its build's kernels come before any move of it
        if built_on == str(self.device):  # one flat buffer from the start: every move is one copy
            sw.flatten(job.job_id, engine.state_tensors(), self.device, self.host_pool, self.order, self.device_cache)
        if tier != "device" and built_on != str(self.device):
            self._adopt(job.job_id, tier)
        elif tier != "device":
            self._move(Move(job.job_id, "device", tier, 0))  # type: ignore[arg-type]
        return self.states[job.job_id].nbytes

    def _adopt(self, job_id: str, tier: str) -> None:
        """The state of a job built on the host becomes its host copy (pinned on CUDA, as a swap-out's), then
        goes on to `tier`; its live tensors are left empty on the device until the planner brings it in."""
        state = self.states[job_id]
        live = self.engines[job_id].state_tensors()
        state.host, _ = sw.device_to_host(job_id, live, self.device, self.host_pool, self.order)
        if self.validate:
            state.checksum = sw.checksum(state.host.tensors())
        state.tier = "host"
        if tier != "host":
            self._move(Move(job_id, "host", tier, 0))  # type: ignore[arg-type]

    def _vllm_engine(self, job: JobSpec, trainer: Any) -> Any:
        """The job's engine on the service's shared vLLM engine for it (`Generators.engine_for`)."""
        return self.generators.engine_for(job, trainer)

    def _drop_generators(self, *, only_broken: bool = False) -> None:
        """Retire the shared vLLM engines no job uses any more, shut down those that failed and give their jobs
        fresh ones (`Generators.drop`)."""
        self.generators.drop(self.engines, self.jobs, only_broken=only_broken)

    def tier(self, job_id: str) -> str:
        return self.states[job_id].tier

    def context(self, job: JobSpec, iteration: int, node: str, chunk: int = 0, chunks: int = 1) -> OpContext:
        engine = self.engines[job.job_id]
        return OpContext(job.job_id, iteration, node, job.config.seed, job.task, job.tokenizer, engine, chunk=chunk,
                         chunks=chunks)  # fmt: skip

    def run_node(
        self,
        job_id: str,
        iteration: int,
        node_name: str,
        inputs: dict[str, Batch],
        swaps: Sequence[Move] = (),
        prefetch: Sequence[Move] = (),
        chunk: int = 0,
        chunks: int = 1,
        parts: Sequence[Batch] = (),
        seq: int | None = None,
        call: Any = None,
    ) -> NodeResult:
        """Apply `swaps`, start `prefetch` in the background, run the node. Errors are returned.

        `seq`: the node's number among the service's nodes in the order they were sent (None: no early
        starts). If `start_early(seq, swaps)` queued its swaps already, the node waits for them instead of
        applying them (that wait is its swap span); then it marks `seq` passed, which lets node `seq + 1`'s
        early swaps start.

        A chunked node (`chunks` > 1, a chunkable operator: `Operator.chunk_input`) runs chunk `chunk` only: on
        rows `chunk_rows(P, chunk, chunks)` of its chunk input, with per-chunk seeds. An earlier chunk's output
        is a part (its report carries no metrics); the last chunk gets the earlier parts (`parts`, in order,
        where they were made: this service) and its output is the concatenation of every chunk, the node's
        output, with the whole node's metrics. `call`: a session's call (`plexrl.sessions.calls`), which the
        node's operator runs (`OpContext.extra`); its reply comes back in the report (`NodeReport.reply`)."""
        job = self.jobs[job_id]
        swap_start = self.clock()
        moved = 0
        measured: dict[str, int] = {}
        try:
            try:
                early = self.background.claim(seq)
                if early is None:
                    moved += self.apply(swaps)
                else:  # queued by start_early: wait for what has not finished yet
                    self.background.wait(early)
                    for m in swaps:
                        self._wait_for(m.job_id)
                measured = {m.job_id: self.states[m.job_id].nbytes for m in swaps if m.src == "device"}
                self._wait_for(job_id)
                if self.states[job_id].tier != "device":
                    raise sw.StateCorrupted(f"job {job_id} is on {self.states[job_id].tier}, not device, at run time")
            except Exception as exc:
                now = self.clock()
                with self._lock:
                    self.stats.blocking_seconds += now - swap_start
                error = f"swap failed: {type(exc).__name__}: {exc}"
                report = NodeReport(job_id, iteration, node_name, error, now, now, swap_start, now, moved)
                report.moves = self.move_log.drain()
                return NodeResult(report)
            swap_end = self.clock()
            with self._lock:
                self.stats.blocking_seconds += swap_end - swap_start
            if prefetch:
                self._start_prefetch(list(prefetch))
            self.background.computing = seq  # from here the node computes (cleared when its operator returns)
        finally:
            self.background.passed(seq)  # also after a failed swap: a later early start must not wait forever
        node = job.graph.node(node_name)
        start = self.clock()
        slot = self._slice_slot(job, (job_id, iteration, node_name, chunk))
        out: Any = None
        failed: str | None = None
        paused = False
        try:
            if chunks > 1:
                inputs = chunk_inputs(node.operator, inputs, chunk, chunks, len(parts))
            ctx = self.context(job, iteration, node_name, chunk, chunks)
            ctx.slice = slot
            ctx.extra["call"] = call  # (a session's, else None)
            out = node.operator.run(ctx, inputs, node.params)
            if chunks > 1 and chunk == chunks - 1:
                pad_id = getattr(job.tokenizer, "pad_token_id", None) or 0
                out = node.operator.output.concat([*parts, out], pad_id)  # type: ignore[attr-defined]
        except SlicePaused:  # its slice of decode steps ran; the generation waits here for the next slice
            self.paused[slot.key] = slot
            paused = True
        except Exception as exc:
            log.error("job %s node %s (iteration %d) failed: %s", job_id, node_name, iteration, exc,
                      exc_info=log.isEnabledFor(logging.INFO))  # fmt: skip
            self._drop_generators(only_broken=True)
            failed = f"{type(exc).__name__}: {exc}"
        finally:
            self.background.computing = None
        failed = self.node_end([job_id], failed)
        if paused and failed is not None:
            self.paused.pop(slot.key, None)
        paused = paused and failed is None
        report = NodeReport(job_id, iteration, node_name, failed, start, self.clock(), swap_start, swap_end, moved,
                            self._weight_loads(job_id), measured=measured, paused=paused,
                            moves=self.move_log.drain())  # fmt: skip
        if failed is not None or paused or chunk < chunks - 1:  # a part: the last chunk reports the node's metrics
            return NodeResult(report, None if failed or paused else out)
        result = finish(report, out)
        if slot is not None and result.report.ok:
            result.report.metrics["slices"] = float(slot.slices)
        return result

    def node_end(self, job_ids: Sequence[str], error: str | None) -> str | None:
        """A node of `job_ids` returned: wait for its device work (`StreamOrder.node_end`), so that the caller's
        clock reads its real end; returns the node's error, or the device's if the wait raised one."""
        try:
            self.order.node_end(job_ids)
        except Exception as exc:  # an asynchronous device error surfaces here
            log.error("jobs %s: the node's device work failed: %s", list(job_ids), exc)
            return error or f"{type(exc).__name__}: {exc}"
        return error

    def _slice_slot(self, job: JobSpec, key: tuple[str, int, str, int]) -> Any:
        """The SliceSlot of node `key` (job, iteration, node, chunk) if its job slices that node
        (`JobConfig.slices`): the one paused here (taken: a failing slice leaves nothing behind), or a new one;
        None for a node that runs whole."""
        from plexrl.engines.slicing import SliceSlot

        steps = job.config.slices.get(key[2])
        if steps is None:
            return None
        kept = self.paused.pop(key, None)
        return kept if kept is not None else SliceSlot(steps, key)

    def _weight_loads(self, job_id: str) -> list[tuple[str, float, float, int]]:
        take = getattr(self.engines.get(job_id), "take_loads", None)
        return [(w.kind, w.start, w.end, w.nbytes) for w in take()] if take else []

    def save_model(self, job_id: str, path: Path) -> Path:
        """Save the job's policy as a Hugging Face model directory at `path`, from whichever tier holds its
        state and without moving it (the StateManager's budgets stay true)."""
        self._wait_for(job_id, count=False)
        with self._state_in_place(job_id):
            self.engines[job_id].save_pretrained(path)
        self.jobs[job_id].tokenizer.save_pretrained(str(path))
        return path

    @contextlib.contextmanager
    def _state_in_place(self, job_id: str) -> Iterator[None]:
        """Point the job's live tensors at its host copy (or its spill file's) while the body reads them, then
        back; a no-op for a state on device. Not thread-safe with a node or a move of the same job."""
        place = self.states[job_id]
        if place.tier == "device":
            yield
            return
        tensors = place.host.tensors() if place.host is not None else sw.read_spill(place.disk, place.layout)
        with sw.pointed_at(self.engines[job_id].state_tensors(), tensors):
            yield

    def checkpoint(self, job_id: str, path: Path, extra: dict[str, Any]) -> Path:
        """Save the job's engine state (`export_state`: weights, optimizer with its step counts, reference,
        critic, weight version) and `extra` to `path`, from whichever tier holds it and without moving it
        (the StateManager's budgets stay true). Atomic: written to a temp file, fsynced, renamed; an error
        (disk full, unwritable directory) leaves an earlier checkpoint at `path` intact. Not thread-safe with
        a node of the same job: call it between nodes (the runner's thread does; on Dask it is numbered among
        the service's nodes, `in_order`, so no early start moves a state while it is read)."""
        self._wait_for(job_id, count=False)
        with self._state_in_place(job_id):
            state = self.engines[job_id].export_state()
        return sw.save_checkpoint({"engine": state, **extra}, path)

    def release(self, job_id: str) -> None:
        """Forget the job: engine, host copies and spill file. A background move of it queued later (a
        lookahead node's early eviction sent before the job ended) is skipped."""
        try:
            self._wait_for(job_id, count=False)
        except Exception as exc:  # the node that needed that move failed with it already; the state goes anyway
            log.warning("job %s: a background move failed before its release: %s", job_id, exc)
        self._released.add(job_id)
        for paused in [k for k in self.paused if k[0] == job_id]:  # a paused generation (its KV cache) goes too
            del self.paused[paused]
        state = self.states.pop(job_id, None)
        if state is not None and state.disk is not None:
            state.disk.unlink(missing_ok=True)
        if state is not None and state.host is not None:
            self.host_pool.give(state.host.buffer)
        engine = self.engines.pop(job_id, None)
        if engine is not None and state is not None and state.tier == "device" and self.device_cache is not None:
            sw.recycle(engine.state_tensors(), self.device_cache)  # its buffer serves the next move, not the OS
        self.jobs.pop(job_id, None)
        if engine is not None and hasattr(engine, "shared"):  # a LoRA job: its adapter leaves the shared base
            engine.release()
            for key, base in list(self.bases.items()):
                if base.unused:
                    del self.bases[key]
        self._drop_generators()

    def close(self) -> None:
        self.background.shutdown()
        for job_id in list(self.states):
            self.release(job_id)
        self.generators.close()
        self.host_pool.clear()
        if self._own_spill:
            shutil.rmtree(self.spill_dir, ignore_errors=True)

    def report(self) -> dict[str, Any]:
        s = self.stats
        return {
            "service": self.service_id,
            "device": str(self.device),
            "blocking_swap_seconds": s.blocking_seconds,
            "prefetch_seconds": s.prefetch_seconds,
            "prefetch_wait_seconds": s.prefetch_wait_seconds,
            "early_swap_seconds": s.early_seconds,
            "early_starts": s.early_starts,
            "early_during_previous": s.early_during_previous,
            "hidden_share": hidden_share(s.blocking_seconds, s.prefetch_seconds, s.prefetch_wait_seconds),
            "bytes_moved": s.bytes_moved,
            "moves": s.moves,
            "copies": s.copies,  # copy calls of those moves (one each way per state once it is flat)
            "host_bytes_held": self.host_pool.held_bytes,  # host buffers' pages, in use and kept
            "pinned_bytes": self.host_pool.pinned_bytes,
            "pinned_peak_bytes": self.host_pool.peak_bytes if self.host_pool.pin else 0,
            "bytes_to_tier": dict(s.per_tier),
            "generation_engines": self.generators.awake(),
            "sleeping_engines": len(self.generators) - self.generators.awake(),
            "weight_loads": self.generators.loads(),
            "moves_ahead": self.background.ahead if self.background.lifted else 0,  # nice levels, where permitted
            "move_records": self.move_log.totals(),  # every move's sums (`plexrl.services.records.summarize`)
        }

    # -- moves --------------------------------------------------------------------------------------
    def apply(self, moves: Sequence[Move]) -> int:
        """Carry out `moves` in order (blocking), after every background move queued before them
        (`BackgroundMoves.wait_all`: the planner's order, so no tier goes over budget). Returns bytes moved."""
        total = 0
        since = time.perf_counter()  # the moves' records count their waits for background moves as queued
        if moves:
            self.background.wait_all()
        with queued(since, background=False):
            for move in moves:
                self._wait_for(move.job_id)
                total += self._move(move)
        return total

    def _start_prefetch(self, moves: list[Move]) -> None:
        """Queue `moves` on the background thread (behind every move queued before: the planner's order)."""
        self.background.queue(moves)

    def start_early(self, seq: int, moves: Sequence[Move]) -> str:
        """Start node `seq`'s swaps in the background before it runs (`BackgroundMoves.start_early`)."""
        return self.background.start_early(seq, moves)

    def in_order(self, seq: int | None) -> contextlib.AbstractContextManager[None]:
        """Run a task numbered among the service's nodes (a checkpoint) in its place."""
        return self.background.in_order(seq)

    def _wait_for(self, job_id: str, *, count: bool = True) -> None:
        self.background.wait_for(job_id, count=count)

    def _move(self, move: Move) -> int:
        import torch

        if move.job_id in self._released and move.job_id not in self.states:
            return 0  # the job ended after this move was sent: its state is gone, the planner forgot it
        state = self.states[move.job_id]
        if state.tier != move.src:
            raise sw.StateCorrupted(
                f"job {move.job_id}: the planner moves it from {move.src} but it is on {state.tier} "
                f"(service {self.service_id})"
            )
        if move.src == move.dst:
            return 0
        live = self.engines[move.job_id].state_tensors()

        def carry(tally: Any) -> int:
            sw.carry_out(move.job_id, move.src, move.dst, state, live, device=self.device, pool=self.host_pool,
                         order=self.order, spill_dir=self.spill_dir, validate=self.validate, cache=self.device_cache,
                         tally=tally)  # fmt: skip
            return state.nbytes

        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        return self._counted(recorded(move.job_id, move.src, move.dst, carry, clock=self.clock, stream=stream))

    def _counted(self, rec: MoveRecord) -> int:
        """Keep a carried move's record (drained into the next node report) and add it to the stats; returns the
        bytes moved."""
        self.move_log.add(rec)
        with self._lock:
            self.stats.bytes_moved += rec.nbytes
            self.stats.moves += 1
            self.stats.copies += rec.copies
            self.stats.per_tier[rec.dst] = self.stats.per_tier.get(rec.dst, 0) + rec.nbytes
        return rec.nbytes
