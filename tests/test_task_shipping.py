"""Tasks cross process boundaries with their job's spec (Dask ships it to the workers): they pickle their
problem lists column by column (`plexrl/job/tasks/_columns.py`), and come back equal."""

from __future__ import annotations

import pickle
from typing import Any

import cloudpickle
import pytest

from plexrl.job.config import TaskConfig
from plexrl.job.tasks import make_task
from plexrl.job.tasks._columns import _Columns, columnar_reduce


@pytest.mark.parametrize("name", ["arithmetic", "tool_arithmetic", "code", "copy"])
def test_a_task_round_trips_through_pickle_column_by_column(name: str) -> None:
    task = make_task(TaskConfig(name=name, train_size=300, eval_size=40))
    _, (cls, state) = columnar_reduce(task)
    assert cls is type(task)
    for split in ("train", "held_out"):
        columns = state[split]
        assert isinstance(columns, _Columns) and columns.cls is type(task.train[0])
        assert all(isinstance(v, (str, int)) for column in columns.columns for v in column)  # no problem objects
    for dumps in (pickle.dumps, cloudpickle.dumps):
        back = pickle.loads(dumps(task))
        assert back == task and type(back) is type(task)
        assert [type(p) for p in back.train] == [type(p) for p in task.train]
        assert back.verify(["1"], ["1"]) == task.verify(["1"], ["1"])


def test_a_list_of_mixed_types_is_kept_as_it_is() -> None:
    from dataclasses import dataclass

    from plexrl.job.tasks.arithmetic import Problem

    @dataclass(frozen=True)
    class Other:
        prompt: str
        answer: str

    task = make_task(TaskConfig(name="arithmetic", train_size=20, eval_size=10))
    task.train.append(Other("x", "y"))  # type: ignore[arg-type]
    _, (_, state) = columnar_reduce(task)
    assert isinstance(state["train"], list) and isinstance(state["held_out"], _Columns)
    assert isinstance(task.held_out[0], Problem)


def test_a_built_in_jobs_spec_pickles_with_plain_pickle_and_operators_by_reference(
    tiny_config: dict[str, Any],
) -> None:
    """PlexRL's operators and their params models pickle by reference: a spec no longer needs cloudpickle,
    which copied each operator's function and dynamic params model by value (and once failed with
    "dictionary changed size during iteration" while a worker sent a spec on)."""
    from plexrl.job.load import load_job
    from plexrl.job.spec import prepare_job

    spec = prepare_job(load_job(tiny_config))
    back = pickle.loads(pickle.dumps(spec))
    for a, b in zip(spec.graph.nodes, back.graph.nodes, strict=True):
        assert b.operator is a.operator and b.params == a.params and type(b.params) is type(a.params)
    assert back.task == spec.task and back.config == spec.config
