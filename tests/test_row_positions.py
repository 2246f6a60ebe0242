"""Prompts and rollouts carry each row's train-split position, so a user reward inside a job gets the row's
real rendered prompt and extra fields (verl's `extra_info`, `data_source`), through chunks and DAPO's pool."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY
from test_data_files import write_verl_parquet

from plexrl.batch import Prompts, Rollouts
from plexrl.job.load import load_job
from plexrl.job.spec import prepare_job
from plexrl.roles import declare


@declare("reward")
def row_check(prompt: str, response: str, ground_truth: str, extra: dict[str, Any]) -> float:
    """1.0 when the reward sees the row it scores: its rendered prompt, ground truth and extra fields agree."""
    i = extra["index"]  # KeyError (an error, counted) when the reward is given {}
    ok = (
        f"what is 2 + {i} ?" in prompt
        and prompt.endswith("<|im_start|>assistant\n")  # the chat template was applied
        and ground_truth == str(2 + i)
        and extra["data_source"] == "openai/gsm8k"
    )
    return 1.0 if ok else 0.0


def a_job(smol_tiny: Path, tmp_path: Path, **over: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(TINY)
    data = write_verl_parquet(tmp_path / "train.parquet", 40)
    cfg.update(run_dir=str(tmp_path / "runs"), model={"path": str(smol_tiny)}, warm_start={"enabled": False})
    cfg.update(engine="torch", iterations=2)
    cfg["tracking"] = {"mlflow": False, "progress": False, "log_model": False}
    cfg["data"] = {
        "train": str(data),
        "held_out_fraction": 0.1,
        "rewards": [{"name": "exact"}, {"ref": "test_row_positions:row_check"}],
    }
    cfg["pipeline"] = {"name": "grpo", "params": {"batch_size": 3, "n": 2, "max_new_tokens": 3, "eval_every": 100}}
    cfg.update(over)
    return cfg


def test_a_user_reward_gets_each_rows_prompt_and_extra_inside_a_job(smol_tiny: Path, tmp_path: Path) -> None:
    from plexrl.runtime.jobs import run_jobs

    cfg = a_job(smol_tiny, tmp_path, chunks={"rollout": 2})  # chunked: positions survive the concatenation
    (job,) = run_jobs([load_job(cfg)], progress=False)
    assert job.status == "done", job.error
    iterations = [it for it in job.history if "verify/reward_mean" in it]  # (the first entry: the evaluation)
    assert len(iterations) == 2
    for it in iterations:
        assert it["verify/reward_errors"] == 0 and it["verify/reward_timeouts"] == 0
        assert it["verify/reward/row_check"] == 1.0, it


def test_positions_follow_rows_through_slices_concat_and_selection() -> None:
    from plexrl.operators.sampling import select_rows

    prompts = Prompts(["a", "b", "c"], [[1], [2], [3]], ["1", "2", "3"], [7, 3, 9])
    assert prompts.rows(1, 3).positions == [3, 9]

    def part(positions: list[int], width: int) -> Rollouts:
        n = len(positions)
        z = torch.zeros(n, width, dtype=torch.long)
        return Rollouts(
            input_ids=z, attention_mask=z, response_mask=z.float(), behaviour_logprobs=z.float(), prompt_len=1,
            response_lengths=torch.zeros(n, dtype=torch.long), finish_reasons=["stop"] * n, completions=[""] * n,
            answers=[""] * n, group_size=2, temperature=1.0, positions=positions,
        )  # fmt: skip

    both = Rollouts.concat([part([7, 7], 3), part([3, 3, 9, 9], 4)], pad_id=0)
    assert both.positions == [7, 7, 3, 3, 9, 9]
    assert select_rows(both, torch.tensor([2, 3])).positions == [3, 3]
    assert Rollouts.concat([part([7, 7], 3), part([], 2)], pad_id=0).positions == [7, 7]  # an empty part
    unknown = part([1, 1], 2)
    unknown.positions = []
    assert Rollouts.concat([part([7, 7], 3), unknown], pad_id=0).positions == []  # unknown in one: none


@pytest.mark.parametrize("positions", [[0, 1], None])
def test_score_without_positions_gives_an_empty_prompt(tmp_path: Path, positions: list[int] | None) -> None:
    from test_data_files import make_tokenizer

    from plexrl.data import DataConfig
    from plexrl.job.tasks.dataset import make_dataset_task

    tok = make_tokenizer(tmp_path / "tok")
    train = str(write_verl_parquet(tmp_path / "t.parquet", 4))
    cfg = DataConfig.model_validate({"train": train, "rewards": [{"ref": "test_row_positions:row_check"}]})
    task = make_dataset_task(cfg, tok, cache_dir=tmp_path / "cache")
    result = task.score(["x", "y"], [task.train[0].answer, task.train[1].answer], rows=positions)
    assert (result.total, result.errors) == (([1.0, 1.0], 0) if positions else ([0.0, 0.0], 2))
    with pytest.raises(ValueError, match="3 row positions for 2 completions"):
        task.score(["x", "y"], ["2", "3"], rows=[0, 1, 2])


def test_a_user_reward_first_scores_the_held_out_rows_it_is_asked_about(smol_tiny: Path, tmp_path: Path) -> None:
    """The held-out accuracy is the first reward term's verdict: a user reward there gets each held-out row's
    prompt and extra fields (row_check scores 1 exactly when it does; given '' and {} it raises, scoring 0)."""
    from plexrl.runtime.jobs import run_jobs

    cfg = a_job(smol_tiny, tmp_path, iterations=1)
    cfg["data"]["rewards"] = [{"ref": "test_row_positions:row_check"}]
    cfg["pipeline"]["params"].update(eval_every=1, eval_size=4)
    (job,) = run_jobs([load_job(cfg)], progress=False)
    assert job.status == "done", job.error
    evaluations = [it["evaluate/accuracy"] for it in job.history if "evaluate/accuracy" in it]
    assert evaluations and all(a == 1.0 for a in evaluations), evaluations


def test_reward_workers_run_inside_dask_workers(smol_tiny: Path, tmp_path: Path) -> None:
    """The reward's worker processes start from a CPU-pool worker of a local Dask cluster (a daemonic process
    may not start `multiprocessing` children; `subprocess` works) and score as inline."""
    from plexrl.runtime.dask import DaskExecutor
    from plexrl.runtime.runner import Runner

    cfg = a_job(smol_tiny, tmp_path, iterations=1)
    spec = prepare_job(load_job(cfg))
    (job,) = Runner(DaskExecutor(services=1, cpu_threads=1), validate=True).run([spec])
    assert job.status == "done", job.error
    it = [h for h in job.history if "verify/reward_mean" in h][-1]
    assert it["verify/reward_errors"] == 0 and it["verify/reward_timeouts"] == 0
    assert it["verify/reward/row_check"] == 1.0
