"""The vocabulary a cluster's device-budget check counts for a built model (`cluster.estimate_weight_bytes`)
is the size of the tokenizer actually built for the job's task (`tasks.tokenizer_size`), for every task."""

from __future__ import annotations

from pathlib import Path

import pytest

from plexrl.job.config import TaskConfig
from plexrl.job.models import build_tokenizer
from plexrl.job.tasks import make_task, tokenizer_size


@pytest.mark.parametrize("name", ["arithmetic", "tool_arithmetic", "code", "copy"])
def test_the_counted_vocabulary_is_the_built_tokenizers(tmp_path: Path, name: str) -> None:
    task = make_task(TaskConfig.model_validate({"name": name}))
    assert tokenizer_size(name) == len(build_tokenizer(tmp_path, task.alphabet, task.special_tokens))
