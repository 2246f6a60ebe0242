"""Datasets from files (plexrl/data/), prompts through a chat template, and the task over them."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from plexrl.data import ColumnMap, DataConfig, DataError, open_dataset, render_prompt, special_ids
from plexrl.data.prompts import prompt_ids
from plexrl.job.tasks.dataset import DatasetTask, make_dataset_task

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = "what is 2 + 3 ? 4 5 9 be brief the answer system user assistant how many apples # a b c q"
WORDS = TEXT.split()


def make_tokenizer(out: Path, template: bool = True) -> Any:
    """A word-level tokenizer built locally (bos added to plain text), with a chat template if asked."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate([*specials, *dict.fromkeys(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if template:
        fast.chat_template = TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return path


def write_verl_parquet(path: Path, rows: int, null_at: int | None = None) -> Path:
    """verl's RL layout: prompt as messages, reward_model {ground_truth, style}, data_source, extra_info."""
    table = pa.table(
        {
            "data_source": ["openai/gsm8k"] * rows,
            "prompt": [[{"role": "user", "content": f"what is 2 + {i} ?"}] for i in range(rows)],
            "ability": ["math"] * rows,
            "reward_model": [
                {"ground_truth": None if i == null_at else str(2 + i), "style": "rule"} for i in range(rows)
            ],
            "extra_info": [{"split": "train", "index": i} for i in range(rows)],
        }
    )
    pq.write_table(table, str(path))
    return path


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def open_cfg(tmp_path: Path, **kw: Any) -> Any:
    return open_dataset(DataConfig.model_validate(kw), tmp_path / "cache")


# ---- layouts --------------------------------------------------------------------------------------------


def test_verl_parquet_is_read_as_it_is(tmp_path: Path) -> None:
    path = write_verl_parquet(tmp_path / "train.parquet", 5)
    data = open_cfg(tmp_path, train=str(path))
    assert len(data.train) == 5 and len(data.held_out) == 0
    row = data.train[3]
    assert row.prompt == [{"role": "user", "content": "what is 2 + 3 ?"}]
    assert row.ground_truth == "5"
    assert row.extra == {
        "split": "train",
        "index": 3,
        "data_source": "openai/gsm8k",
        "ability": "math",
        "style": "rule",
    }
    assert data.train[-1].ground_truth == "6"
    with pytest.raises(IndexError):
        data.train[5]


def test_trl_style_jsonl_with_each_answer_column(tmp_path: Path) -> None:
    for column, value, want in (("answer", "3 + 4 = 7\n#### 7", "3 + 4 = 7\n#### 7"), ("solution", 42, "42"),
                                ("ground_truth", [1, 2], "[1, 2]")):  # fmt: skip
        path = write_jsonl(tmp_path / f"{column}.jsonl", [{"prompt": "how many apples ?", column: value, "id": 7}] * 3)
        data = open_cfg(tmp_path, train=str(path))
        assert data.train[1].prompt == "how many apples ?"
        assert data.train[1].ground_truth == want
        assert data.train[1].extra == {"id": 7}


def test_trl_messages_prompt_and_blank_lines(tmp_path: Path) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 4 ?"}]
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"prompt": msgs, "answer": "4"}) + "\n\n" + json.dumps({"prompt": "q", "answer": 5}) + "\n"
    )
    data = open_cfg(tmp_path, train=str(path))
    assert len(data.train) == 2
    assert data.train[0].prompt == msgs and data.train[1].ground_truth == "5"


def test_mapped_columns_in_csv_and_nested_jsonl(tmp_path: Path) -> None:
    csv = tmp_path / "q.csv"
    csv.write_text("question,final,level\nwhat is 2 + 3 ?,5,easy\nwhat is 4 + 5 ?,9,hard\n", encoding="utf-8")
    data = open_cfg(tmp_path, train=str(csv), columns={"prompt": "question", "answer": "final"})
    assert [r.ground_truth for r in data.train] == ["5", "9"]  # csv infers integers: written back as text
    assert data.train[1].extra == {"level": "hard"}
    nested = write_jsonl(tmp_path / "n.jsonl", [{"q": "a", "meta": {"gold": "b"}}])
    data = open_cfg(tmp_path, train=str(nested), columns={"prompt": "q", "answer": "meta.gold"})
    assert data.train[0].ground_truth == "b"


def test_save_to_disk_directory_read_with_pyarrow_alone(tmp_path: Path) -> None:
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow stream shards listed in state.json."""
    d = tmp_path / "saved"
    d.mkdir()
    for k in range(2):
        table = pa.table({"prompt": [f"q{k}{i}" for i in range(3)], "answer": [f"a{k}{i}" for i in range(3)]})
        with (
            pa.OSFile(str(d / f"data-0000{k}-of-00002.arrow"), "wb") as sink,
            pa.ipc.new_stream(sink, table.schema) as w,
        ):
            w.write_table(table)
    files = [{"filename": f"data-0000{k}-of-00002.arrow"} for k in range(2)]
    (d / "state.json").write_text(json.dumps({"_data_files": files}))
    data = open_cfg(tmp_path, train=str(d))
    assert [r.ground_truth for r in data.train] == ["a00", "a01", "a02", "a10", "a11", "a12"]


def test_a_real_save_to_disk_directory(tmp_path: Path) -> None:
    import datasets  # a dev dependency (pyproject.toml): the user's own `save_to_disk` output, read back

    datasets.Dataset.from_dict({"prompt": ["p0", "p1"], "solution": ["s0", "s1"]}).save_to_disk(str(tmp_path / "d"))
    data = open_cfg(tmp_path, train=str(tmp_path / "d"))
    assert data.train[1].ground_truth == "s1"


def test_held_out_fraction_is_seeded_and_disjoint(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(100)])
    a = open_cfg(tmp_path, train=str(path), held_out_fraction=0.2, split_seed=3)
    b = open_cfg(tmp_path, train=str(path), held_out_fraction=0.2, split_seed=3)
    c = open_cfg(tmp_path, train=str(path), held_out_fraction=0.2, split_seed=4)
    held = {r.ground_truth for r in a.held_out}
    train = {r.ground_truth for r in a.train}
    assert len(held) == 20 and len(train) == 80 and not held & train and held | train == {str(i) for i in range(100)}
    assert held == {r.ground_truth for r in b.held_out} != {r.ground_truth for r in c.held_out}


def test_held_out_file(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "answer": "1"}] * 4)
    held = write_verl_parquet(tmp_path / "h.parquet", 2)
    data = open_cfg(tmp_path, train=str(train), held_out=str(held))
    assert len(data.train) == 4 and data.held_out[1].ground_truth == "3"


def test_long_prompts_are_dropped_and_counted(tmp_path: Path, tok_dir: Path) -> None:
    rows = [{"prompt": " ".join(["a"] * n), "answer": str(n)} for n in (1, 2, 8, 3, 20)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    cfg = DataConfig(train=str(path), held_out_fraction=0.4, max_prompt_tokens=4)
    data = open_dataset(cfg, tmp_path / "cache", lambda row: len(str(row.prompt).split()), "words")
    kept = sorted(r.ground_truth for s in (data.train, data.held_out) for r in s)
    assert kept == ["1", "2", "3"] and data.dropped["train"] + data.dropped["held_out"] == 2
    with pytest.raises(ValueError, match="count_tokens"):
        open_dataset(cfg, tmp_path / "cache")
    task = make_dataset_task(
        DataConfig(train=str(path), max_prompt_tokens=9), tokenizer_dir=tok_dir, cache_dir=tmp_path / "c2"
    )
    # rendered: <|im_start|> user \n ... <|im_end|> \n <|im_start|> assistant \n = n + 6 tokens
    assert [p.answer for p in task.train] == ["1", "2", "3"] and task.dropped == {"train": 2, "held_out": 0}


# ---- bad data -----------------------------------------------------------------------------------------------


def error(tmp_path: Path, **kw: Any) -> str:
    with pytest.raises(DataError) as info:
        open_cfg(tmp_path, **kw)
    return str(info.value)


def test_missing_column_names_file_and_column(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "nocol.jsonl", [{"prompt": "q", "reply": "a"}])
    msg = error(tmp_path, train=str(path))
    assert "nocol.jsonl" in msg and "column 'answer'" in msg and "data.columns.answer" in msg
    path = write_jsonl(tmp_path / "noprompt.jsonl", [{"question": "q", "answer": "a"}])
    msg = error(tmp_path, train=str(path))
    assert "noprompt.jsonl, row 0, column 'prompt'" in msg and "data.columns.prompt" in msg
    pq.write_table(pa.table({"prompt": ["q"], "answer": ["a"]}), str(tmp_path / "m.parquet"))
    msg = error(tmp_path, train=str(tmp_path / "m.parquet"), columns={"answer": "gold"})
    assert "m.parquet" in msg and "'gold'" in msg
    msg = error(tmp_path, train=str(tmp_path / "m.parquet"), columns={"answer": "answer.inner"})
    assert "no field 'inner'" in msg


def test_wrong_type_names_the_row(tmp_path: Path) -> None:
    rows: list[Any] = [
        {"prompt": "q", "answer": "1"},
        {"prompt": "q", "answer": "2"},
        {"prompt": 12, "answer": "3"},
        {"prompt": [{"role": "user"}], "answer": "4"},
        {"prompt": "q", "answer": True},
        ["not", "a dict"],
    ]
    msg = error(tmp_path, train=str(write_jsonl(tmp_path / "types.jsonl", rows)))
    assert "types.jsonl, row 2, column 'prompt': the prompt is int" in msg
    assert "row 3, column 'prompt': the prompt is message 0 is not {role: str, content: str}" in msg
    assert "row 4, column 'answer': the ground truth is bool" in msg
    assert "row 5: a row must be a JSON object, not list" in msg
    pq.write_table(pa.table({"prompt": [1, 2], "answer": ["a", "b"]}), str(tmp_path / "t.parquet"))
    assert "column 'prompt': the prompt column has type int64" in error(tmp_path, train=str(tmp_path / "t.parquet"))


def test_null_ground_truth_names_the_row(tmp_path: Path) -> None:
    path = write_verl_parquet(tmp_path / "null.parquet", 6, null_at=4)
    msg = error(tmp_path, train=str(path))
    assert "null.parquet, row 4, column 'reward_model.ground_truth': the ground truth is null" in msg
    path = write_jsonl(tmp_path / "null.jsonl", [{"prompt": "q", "answer": "1"}, {"prompt": "q", "answer": None}])
    assert "null.jsonl, row 1, column 'answer': the ground truth is null" in error(tmp_path, train=str(path))


def test_empty_files(tmp_path: Path) -> None:
    for name in ("e.jsonl", "e.csv", "e.parquet"):
        (tmp_path / name).write_bytes(b"")
        msg = error(tmp_path, train=str(tmp_path / name))
        assert name in msg and ("empty" in msg or "no rows" in msg)
    (tmp_path / "blank.jsonl").write_text("\n\n")
    assert "no rows" in error(tmp_path, train=str(tmp_path / "blank.jsonl"))
    (tmp_path / "header.csv").write_text("prompt,answer\n")
    assert "header.csv" in error(tmp_path, train=str(tmp_path / "header.csv"))
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   str(tmp_path / "zero.parquet"))  # fmt: skip
    assert "zero.parquet: the file has no rows" in error(tmp_path, train=str(tmp_path / "zero.parquet"))


def test_non_utf8_names_the_line(tmp_path: Path) -> None:
    good = json.dumps({"prompt": "q", "answer": "1"}).encode()
    (tmp_path / "bad.jsonl").write_bytes(good + b"\n" + b'{"prompt": "caf\xe9", "answer": "1"}\n')
    msg = error(tmp_path, train=str(tmp_path / "bad.jsonl"))
    assert "bad.jsonl, row 1: line 2 is not UTF-8" in msg and "re-encode" in msg
    (tmp_path / "bad.csv").write_bytes(b"prompt,answer\nq,1\ncaf\xe9,2\n")
    assert "bad.csv, row 1: line 3 is not UTF-8" in error(tmp_path, train=str(tmp_path / "bad.csv"))
    (tmp_path / "notjson.jsonl").write_bytes(good + b"\n{oops\n")
    assert "notjson.jsonl, row 1: line 2 is not JSON" in error(tmp_path, train=str(tmp_path / "notjson.jsonl"))


def test_config_errors_name_the_field() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="not both"):
        DataConfig(train="t.jsonl", held_out="h.jsonl", held_out_fraction=0.1)
    with pytest.raises(ValidationError, match="extra"):
        DataConfig.model_validate({"train": "t.jsonl", "colums": {}})
    with pytest.raises(ValidationError, match="prompt"):
        ColumnMap(prompt="")
    with pytest.raises(DataError, match="unknown data file kind"):
        open_dataset(DataConfig(train=__file__), Path("/tmp"))


# ---- the spec stays small -------------------------------------------------------------------------------------


def test_a_20k_row_task_pickles_small_and_reads_the_same_rows(tmp_path: Path, tok_dir: Path) -> None:
    # 20k rows of ~80 bytes: a task that pickled its rows would take ~1.5 MB, 150x the bound below
    n = 20_000
    path = tmp_path / "big.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            fh.write(f'{{"prompt": "what is 2 + {i} ?", "answer": "{i + 2}", "pad": "{"x" * 40}"}}\n')
    pq.write_table(pa.table({"prompt": [f"q {i}" for i in range(n)], "answer": [str(i) for i in range(n)]}),
                   str(tmp_path / "big.parquet"))  # fmt: skip
    for train in (path, tmp_path / "big.parquet"):
        cfg = DataConfig(train=str(train), held_out_fraction=0.01)
        task = make_dataset_task(cfg, tokenizer_dir=tok_dir, cache_dir=tmp_path / "cache")
        blob = pickle.dumps(task)
        assert len(blob) < 10_000, len(blob)
        back = pickle.loads(blob)
        assert isinstance(back, DatasetTask) and len(back.train) == len(task.train) == n - n // 100
        assert back.train[12345] == task.train[12345] and back.held_out[-1] == task.held_out[-1]


# ---- prompts through the tokenizer ---------------------------------------------------------------------------


def test_render_with_chat_template_then_tokens_without_specials(tok_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    text = render_prompt(tok, "what is 2 + 3 ?", system_prompt="be brief", format_instruction="the answer #")
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is 2 + 3 ?\n\nthe answer #<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = prompt_ids(tok, text)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.bos_token_id not in ids  # no bos added
    assert tok.convert_tokens_to_ids("<unk>") not in ids
    # a row with its own system message keeps it
    own = [{"role": "system", "content": "how"}, {"role": "user", "content": "q"}]
    assert render_prompt(tok, own, system_prompt="be brief").startswith("<|im_start|>system\nhow<|im_end|>")


def test_plain_text_without_a_template_keeps_the_tokenizers_specials(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "plain", template=False)
    text = render_prompt(tok, [{"role": "user", "content": "what is 4 ?"}], format_instruction="be brief")
    assert text == "what is 4 ?\n\nbe brief"
    assert prompt_ids(tok, text)[0] == tok.bos_token_id


def test_special_ids_prefer_generation_config(tmp_path: Path, tok_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    assert special_ids(tmp_path, tok).eos == (tok.eos_token_id,) and special_ids(tmp_path, tok).pad == tok.pad_token_id
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 3], "pad_token_id": 1}))
    ids = special_ids(tmp_path, tok)
    assert ids.eos == (5, 3) and ids.pad == 1


# ---- the task ----------------------------------------------------------------------------------------------


def test_dataset_task_feeds_the_operators(tmp_path: Path, tok_dir: Path) -> None:
    from plexrl.job.tasks.dataset import load_tokenizer
    from plexrl.operator import OpContext
    from plexrl.operators.data import sample_prompts

    path = write_verl_parquet(tmp_path / "train.parquet", 10)
    cfg = DataConfig(train=str(path), held_out_fraction=0.2, format_instruction="the answer #")
    task = make_dataset_task(cfg, tokenizer_dir=tok_dir, cache_dir=tmp_path / "cache")
    tok = load_tokenizer(str(tok_dir))
    p = task.train[0]
    assert p.prompt.startswith("<|im_start|>user\nwhat is 2 +") and p.prompt.endswith("<|im_start|>assistant\n")
    assert p.prompt_ids == tok(p.prompt, add_special_tokens=False)["input_ids"] and p.row == 0
    assert [q.answer for q in task.held_out[:5]] == [q.answer for q in task.held_out]  # slices, 2 rows
    ctx = OpContext(job_id="j", iteration=0, node="data", job_seed=0, task=task, tokenizer=tok)
    prompts = sample_prompts.fn(ctx, batch_size=4)
    assert len(prompts) == 4 and all(t.endswith("assistant\n") for t in prompts.texts)
    by_text = {q.prompt: q.answer for q in task.train}
    assert [by_text[t] for t in prompts.texts] == prompts.answers
    # the first reward term (math by default) decides `verify`; the whole reward comes from `score`
    assert task.verify(["so \\boxed{4}", "5"], ["4", "4"]) == [1.0, 0.0]
    result = task.score(["#### 4"], ["4"], rows=[0])
    assert result.total == [1.0] and result.metrics()["reward/math"] == 1.0
    with pytest.raises(ValueError, match=r"warm_start\.enabled: false"):
        task.demonstration(p, False)


def test_rollout_verify_and_evaluate_run_on_a_dataset_task(tmp_path: Path, tok_dir: Path) -> None:
    """The existing operators, unchanged, on a tiny Llama with the chat-template tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from plexrl.engines.torch_engine import TorchEngine
    from plexrl.job.construction import model_construction
    from plexrl.job.tasks.dataset import load_tokenizer
    from plexrl.operator import OpContext
    from plexrl.operators.data import sample_prompts
    from plexrl.operators.evaluate import evaluate
    from plexrl.operators.rollout import rollout
    from plexrl.operators.verify import verify

    tok = load_tokenizer(str(tok_dir))
    sizes = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    config = LlamaConfig(vocab_size=len(tok), num_key_value_heads=2, max_position_embeddings=64, **sizes, **ids)
    with model_construction(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(str(tmp_path / "model"))
    special = special_ids(tmp_path / "model", tok)  # generation_config.json, written by save_pretrained
    engine = TorchEngine(tmp_path / "model", eos_id=special.eos[0], pad_id=special.pad, attention="eager")
    path = write_verl_parquet(tmp_path / "train.parquet", 8)
    task = make_dataset_task(DataConfig(train=str(path), held_out_fraction=0.25), tok, cache_dir=tmp_path / "c")
    ctx = OpContext(job_id="j", iteration=0, node="n", job_seed=0, task=task, tokenizer=tok, engine=engine)
    prompts = sample_prompts.fn(ctx, batch_size=2)
    rollouts = rollout.fn(prompts, ctx, n=2, max_new_tokens=3)
    assert len(rollouts) == 4 and rollouts.answers == [a for a in prompts.answers for _ in range(2)]
    rewards = verify.fn(rollouts, ctx)
    assert rewards.values.shape == (4,)
    stats = evaluate.fn(ctx, size=2, max_new_tokens=3)
    assert stats.size == 2 and 0.0 <= stats.accuracy <= 1.0


def test_a_checked_jsonl_is_not_parsed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import plexrl.data.files as files

    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)])
    first = open_cfg(tmp_path, train=str(path))
    monkeypatch.setattr(files, "to_row", None)  # the check would call it: it must not run
    again = files.open_rows(str(path), tmp_path / "cache", ColumnMap())
    assert len(again) == len(first.train) == 5
    monkeypatch.undo()
    assert again.row(4).ground_truth == "4"
    with pytest.raises(DataError, match="no answer column 'gold'"):  # another mapping: checked again
        open_cfg(tmp_path, train=str(path), columns={"answer": "gold"})
