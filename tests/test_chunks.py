"""Function-level preemption on the real services: a service node run as chunks (`JobConfig.chunks`).

- batches: `Prompts.rows` slices whole prompts (so a group of n samples stays in one chunk), `chunk_rows`
  covers every row once, `Rollouts.concat` re-pads parts with different prompt and response widths and
  drops empty ones;
- a job with `chunks: {rollout: 3}` runs its rollout 3 times per iteration, hands downstream nodes the whole
  batch in prompt order, forgets the parts, and logs the same metrics in two runs;
- fidelity (docs invariant 4): the chunked job multiplexed with another job on one service (every switch
  swaps) logs exactly what it logs alone, and the other job's node runs between two of its chunks;
- config errors name the field and the fix.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY, local_runner, stable

from plexrl.batch import Prompts, Rewards, Rollouts, chunk_rows
from plexrl.errors import ConfigError
from plexrl.hooks.base import Hook
from plexrl.job.load import load_job
from plexrl.job.spec import JobRun, JobSpec, prepare_job
from plexrl.operator import OpContext, operator, resolve_operator
from plexrl.planner import Planner
from plexrl.runtime import Budgets, NodeTask, Runner

PAD = 9


# -- batches -------------------------------------------------------------------------------------------
def test_chunk_rows_cover_every_prompt_once_in_order() -> None:
    for rows in range(0, 9):
        for chunks in range(1, 6):
            bounds = [chunk_rows(rows, k, chunks) for k in range(chunks)]
            assert bounds[0][0] == 0 and bounds[-1][1] == rows
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            sizes = [stop - start for start, stop in bounds]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="chunk 3 of 3"):
        chunk_rows(4, 3, 3)


def test_prompts_rows_slice_every_column_and_may_be_empty() -> None:
    p = Prompts(texts=["a", "b", "c"], token_ids=[[1], [1, 2], [1, 2, 3]], answers=["x", "y", "z"])
    part = p.rows(1, 3)
    assert (part.texts, part.token_ids, part.answers) == (["b", "c"], [[1, 2], [1, 2, 3]], ["y", "z"])
    empty = p.rows(0, 0)
    assert len(empty) == 0 and empty.token_ids == [] and empty.answers == []


def make_rollouts(prompts: list[list[int]], responses: list[list[int]], g: int = 1, version: int = 0) -> Rollouts:
    """Rows laid out as the rollout operator lays them out: prompts left-padded, responses right-padded."""
    n = len(responses)
    lp = max((len(p) for p in prompts), default=0)
    t = max((len(r) for r in responses), default=0)
    ids = torch.full((n, lp + t), PAD, dtype=torch.long)
    att = torch.zeros(n, lp + t, dtype=torch.long)
    resp = torch.zeros(n, lp + t)
    lps = torch.zeros(n, lp + t)
    for i, (p, r) in enumerate(zip([pp for pp in prompts for _ in range(g)], responses, strict=True)):
        ids[i, lp - len(p) : lp] = torch.tensor(p)
        att[i, lp - len(p) : lp + len(r)] = 1
        ids[i, lp : lp + len(r)] = torch.tensor(r)
        resp[i, lp : lp + len(r)] = 1
        lps[i, lp : lp + len(r)] = -0.5 * (i + 1)
    return Rollouts(
        input_ids=ids, attention_mask=att, response_mask=resp, behaviour_logprobs=lps, prompt_len=lp,
        response_lengths=torch.tensor([len(r) for r in responses], dtype=torch.long),
        finish_reasons=["stop"] * n, completions=[str(r) for r in responses],
        answers=[str(p) for p in prompts for _ in range(g)], group_size=g, temperature=1.0, weight_version=version,
    )  # fmt: skip


def rows_of(ro: Rollouts) -> list[tuple[list[int], list[int], list[float]]]:
    """Each row's real prompt tokens, response tokens and response log-probs (padding stripped)."""
    out = []
    for i in range(len(ro)):
        att, resp = ro.attention_mask[i].bool(), ro.response_mask[i].bool()
        prompt = ro.input_ids[i, : ro.prompt_len][att[: ro.prompt_len]].tolist()
        out.append((prompt, ro.input_ids[i][resp].tolist(), ro.behaviour_logprobs[i][resp].tolist()))
    return out


def test_rollouts_concat_repads_prompts_left_and_responses_right() -> None:
    a = make_rollouts([[1, 2]], [[5], [5, 6, 7]], g=2)  # prompt_len 2, response width 3
    b = make_rollouts([[1, 2, 3, 4], [3]], [[8], [8], [6, 6], [7]], g=2)  # prompt_len 4, width 2
    empty = make_rollouts([], [], g=2)
    joined = Rollouts.concat([empty, a, empty, b, empty], PAD)
    assert joined.prompt_len == 4 and joined.input_ids.shape == (6, 4 + 3)
    for name in ("attention_mask", "response_mask", "behaviour_logprobs"):
        assert getattr(joined, name).shape == (6, 7)
    assert rows_of(joined) == rows_of(a) + rows_of(b)  # every row's tokens and log-probs, in order
    assert joined.input_ids[0].tolist() == [PAD, PAD, 1, 2, 5, PAD, PAD]  # left- and right-padding
    assert joined.attention_mask[0].tolist() == [0, 0, 1, 1, 1, 0, 0]
    assert (joined.response_mask * (1 - joined.attention_mask)).sum() == 0  # responses only on real tokens
    assert joined.response_lengths.tolist() == [1, 3, 1, 1, 2, 1]
    assert joined.answers == a.answers + b.answers and joined.completions == a.completions + b.completions
    assert joined.finish_reasons == ["stop"] * 6 and joined.group_size == 2 and len(joined) == 6


def test_rollouts_concat_of_empty_parts_and_of_one_part() -> None:
    a = make_rollouts([[1, 2]], [[5], [5, 6]], g=2)
    empty = make_rollouts([], [], g=2)
    assert Rollouts.concat([a], PAD) is a
    assert Rollouts.concat([empty, a], PAD) is a
    both_empty = Rollouts.concat([empty, empty], PAD)
    assert len(both_empty) == 0 and both_empty.input_ids.shape[0] == 0


def test_rollouts_concat_refuses_parts_of_different_samplers() -> None:
    a = make_rollouts([[1, 2]], [[5], [5, 6]], g=2)
    with pytest.raises(ValueError, match="weight version 0 vs 1"):
        Rollouts.concat([a, make_rollouts([[1]], [[5], [6]], g=2, version=1)], PAD)
    with pytest.raises(ValueError, match="group size 2 vs 1"):
        Rollouts.concat([a, make_rollouts([[1]], [[5]], g=1)], PAD)


def test_a_chunkable_operator_declares_a_sliceable_input_and_a_concatenable_output() -> None:
    assert resolve_operator("rollout").chunkable and resolve_operator("rollout").chunk_input == "prompts"
    assert not resolve_operator("train").chunkable and not resolve_operator("verify").chunkable

    def gen(prompts: Prompts, ctx: OpContext) -> Rollouts: ...
    def score(rollouts: Rollouts, ctx: OpContext) -> Rewards: ...

    with pytest.raises(TypeError, match="only service operators run in chunks"):
        operator("cpu", chunk_input="prompts")(gen)
    with pytest.raises(TypeError, match="'prompt' is not one of its inputs"):
        operator("service", chunk_input="prompt")(gen)
    with pytest.raises(TypeError, match="no rows"):
        operator("service", chunk_input="rollouts")(score)


# -- config --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("chunks", "where", "says"),
    [
        ({"rollotu": 2}, "chunks.rollotu", "did you mean 'rollout'"),
        ({"verify": 2}, "chunks.verify", "runs on the CPU pool; only service nodes"),
        ({"train": 2}, "chunks.train", "cannot run in chunks (it declares no chunk_input); remove it. Chunkable "
                                       "nodes here: rollout"),
        ({"rollout": 0}, "chunks.rollout", "greater than or equal to 1"),
    ],
)  # fmt: skip
def test_bad_chunks_name_the_field_and_the_fix(
    tiny_config: dict[str, Any], chunks: dict[str, int], where: str, says: str
) -> None:
    tiny_config["chunks"] = chunks
    with pytest.raises(ConfigError) as err:
        load_job(tiny_config)
    assert [p.where for p in err.value.problems] == [where], err.value
    assert says in str(err.value)


def test_chunks_reach_the_plan(tiny_config: dict[str, Any], tmp_path: Path) -> None:
    tiny_config["chunks"] = {"rollout": 3, "train": 1}
    loaded = load_job(tiny_config)
    assert loaded.config.chunks == {"rollout": 3, "train": 1}
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(16)}, str(tmp_path / "model.safetensors"))  # the plan sizes the state from it
    spec = JobSpec("x", loaded.config, loaded.graph, loaded.raw, None, None, tmp_path, tmp_path)
    plan = spec.plan()
    assert plan.nodes["rollout"].chunks == 3 and plan.nodes["train"].chunks == 1 and plan.nodes["verify"].chunks == 1


# -- real jobs -----------------------------------------------------------------------------------------
def job_config(run_dir: Path, name: str, seed: int, chunks: dict[str, int]) -> dict[str, Any]:
    cfg = copy.deepcopy(TINY)
    cfg.update(name=name, seed=seed, iterations=2, run_dir=str(run_dir), chunks=chunks)
    cfg["tracking"]["mlflow"] = False
    return cfg


class Watch(Hook):
    """Records node starts (job, iteration, node, lane) in order, and checks at each iteration end of the
    watched job that the executor holds none of that job's outputs of the iteration any more."""

    def __init__(self, runner: Runner, job_id: str) -> None:
        self.starts: list[tuple[str, int, str, str]] = []
        self.runner, self.job_id = runner, job_id
        self.tasks: dict[int, NodeTask] = {}
        self.last_rollouts: list[tuple[Any, Any]] = []  # (the rollout node's output, its prompts)
        self.leaks: list[int] = []
        executor = runner.executor
        submit = executor.submit

        def watching(task: NodeTask) -> int:
            handle = submit(task)
            self.tasks[handle] = task
            inline = hasattr(executor, "outputs")
            if inline and task.job_id == job_id and task.node == "rollout" and task.chunk == task.chunks - 1:
                prompts = executor.outputs[task.inputs["prompts"]]  # type: ignore[attr-defined]
                self.last_rollouts.append((executor.outputs[handle], prompts))  # type: ignore[attr-defined]
            return handle

        executor.submit = watching  # type: ignore[method-assign]

    def before_node(self, run: JobRun, iteration: int, node: str, lane: str, start: float) -> None:
        self.starts.append((run.job_id, iteration, node, lane))

    def on_iteration_end(self, run: JobRun, iteration: int, metrics: dict[str, float]) -> None:
        if run.job_id != self.job_id:
            return
        executor: Any = self.runner.executor
        held = executor.outputs if hasattr(executor, "outputs") else executor._work  # inline | Dask
        mine = [h for h, t in self.tasks.items() if t.job_id == run.job_id and t.iteration <= iteration]
        self.leaks += [h for h in mine if h in held]


def run_jobs(
    cfgs: list[dict[str, Any]], watched: str, budgets: Budgets | None = None, runner: Runner | None = None
) -> tuple[list[JobRun], Watch]:
    specs = [prepare_job(load_job(cfg)) for cfg in cfgs]
    runner = runner or local_runner(budgets=budgets or Budgets())
    watch = Watch(runner, watched)
    runner.hooks.hooks.append(watch)
    runs = runner.run(specs)
    for run in runs:
        assert run.status == "done", run.error
    return runs, watch


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chunks") / "runs"


@pytest.fixture(scope="module")
def alone(run_dir: Path) -> tuple[JobRun, Watch]:
    (run,), watch = run_jobs([job_config(run_dir, "a", 0, {"rollout": 3})], "a")
    return run, watch


def test_a_chunked_rollout_runs_three_times_per_iteration_and_hands_on_the_whole_batch(
    alone: tuple[JobRun, Watch],
) -> None:
    run, watch = alone
    for it in range(2):
        assert [n for j, i, n, _ in watch.starts if i == it and n == "rollout"] == ["rollout"] * 3
    chunk_tasks = [t for t in watch.tasks.values() if t.node == "rollout"]
    assert [(t.chunk, t.chunks, len(t.parts)) for t in chunk_tasks] == [(0, 3, 0), (1, 3, 0), (2, 3, 2)] * 2
    assert len(watch.last_rollouts) == 2
    for ro, prompts in watch.last_rollouts:  # 4 prompts (chunks of 1, 1 and 2) x n = 4, in prompt order
        assert len(ro) == 16 and ro.input_ids.shape[0] == 16 and ro.group_size == 4
        assert ro.answers == [a for a in prompts.answers for _ in range(4)]
        for i, ids in enumerate(prompts.token_ids):
            row = ro.input_ids[4 * i][ro.attention_mask[4 * i].bool()][: len(ids)].tolist()
            assert row == ids
    assert watch.leaks == []  # the parts were forgotten with the iteration (or when the last chunk ended)
    row = run.history[-1]
    assert row["rollout/tokens"] > 0 and "train/loss" in row
    assert row["time/rollout"] > 0


def test_a_chunked_job_is_deterministic(run_dir: Path, alone: tuple[JobRun, Watch]) -> None:
    (again,), _ = run_jobs([job_config(run_dir, "a", 0, {"rollout": 3})], "a")
    assert stable(again.history) == stable(alone[0].history)


def test_multiplexed_chunked_job_logs_what_it_logs_alone_and_lets_the_other_in_between_chunks(
    run_dir: Path, alone: tuple[JobRun, Watch]
) -> None:
    cfgs = [job_config(run_dir, "a", 0, {"rollout": 3}), job_config(run_dir, "b", 1, {})]
    size = max(prepare_job(load_job(c)).state_bytes() for c in cfgs)
    (a, _b), watch = run_jobs(cfgs, "a", Budgets(device=size))  # one state on device: every switch swaps
    assert stable(a.history) == stable(alone[0].history)
    assert watch.leaks == []
    # between two chunks of a's rollout, b's service node ran (function-level preemption, for real)
    service = [(j, i, n) for j, i, n, lane in watch.starts if lane != "cpu"]
    between = []
    for k, (j, i, n) in enumerate(service):
        if (j, n) == ("a", "rollout"):
            nxt = next((k2 for k2 in range(k + 1, len(service)) if service[k2][:2] == ("a", i)), None)
            if nxt is not None and service[nxt][2] == "rollout":
                between += [s for s in service[k + 1 : nxt] if s[0] == "b"]
    assert between, service


def test_a_service_runs_one_chunk_per_task_and_the_last_joins_them(run_dir: Path) -> None:
    """5 chunks of 4 prompts: chunk 0 has none (an empty rollout, no engine call); the earlier chunks report
    no metrics; the last chunk's output holds every chunk's rows in order, with the whole node's metrics.
    A node whose operator is not chunkable refuses to run in chunks."""
    from plexrl.services.service import Service, run_cpu_node

    spec = prepare_job(load_job(job_config(run_dir, "a", 0, {"rollout": 5})))
    svc = Service("s")
    try:
        svc.load_job(spec)
        prompts = run_cpu_node(spec, 0, "prompts", {}, svc.clock).output
        assert isinstance(prompts, Prompts) and len(prompts) == 4
        parts: list[Any] = []
        for k in range(5):
            res = svc.run_node(
                "a", 0, "rollout", {"prompts": prompts}, chunk=k, chunks=5, parts=parts if k == 4 else ()
            )
            assert res.report.ok, res.report.error
            if k < 4:
                assert res.report.metrics == {}
                parts.append(res.output)
        assert [len(p) for p in parts] == [0, 4, 4, 4]  # prompts (0, 1, 1, 1) x n = 4; the last chunk has 1
        whole = res.output
        assert isinstance(whole, Rollouts) and len(whole) == 16
        last = whole.answers[12:]
        assert rows_of(whole)[:12] == [r for p in parts for r in rows_of(p)] and last == [prompts.answers[3]] * 4
        assert res.report.metrics["tokens"] == float(whole.response_lengths.sum())
        bad = svc.run_node("a", 0, "train", {}, chunk=0, chunks=2)
        assert bad.output is None and "cannot run in chunks" in (bad.report.error or "")
    finally:
        svc.close()


def test_on_dask_the_parts_stay_on_the_service_and_the_job_logs_what_it_logs_alone(
    run_dir: Path, alone: tuple[JobRun, Watch]
) -> None:
    """The same two jobs on a local Dask cluster (one service worker, one CPU-pool worker, lookahead): the
    last chunk's task gets the earlier chunks' futures (resolved on the service worker that made them), the
    runner forgets them, and the chunked job's metrics equal its inline run alone."""
    from plexrl.runtime.dask import DaskExecutor

    cfgs = [job_config(run_dir, "a", 0, {"rollout": 3}), job_config(run_dir, "b", 1, {})]
    size = max(prepare_job(load_job(c)).state_bytes() for c in cfgs)
    executor = DaskExecutor(services=1, cpu_threads=1, validate=True)
    runner = Runner(
        executor, Planner(clock=executor.clock, validate=True, lookahead=True), budgets=Budgets(device=size)
    )
    (a, _b), watch = run_jobs(cfgs, "a", runner=runner)
    assert stable(a.history) == stable(alone[0].history)
    assert watch.leaks == []
    assert [t.parts != () for t in watch.tasks.values() if t.job_id == "a" and t.node == "rollout"] == [
        False, False, True,
    ] * 2  # fmt: skip


def test_a_damaged_weight_file_is_named(tmp_path: Path) -> None:
    from plexrl.sizes import count_parameters

    (tmp_path / "model.safetensors").write_bytes(b"0" * 64)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a safetensors file"):
        count_parameters(tmp_path)
