# make setup: .venv with everything (idempotent; quick when nothing changed)
# make demo:  setup, then the main job          make test: setup, lint, then the tests (make test-all: and the matrix)
# make lint:  ruff check + ruff format --check + pyright (library)   make test-fast: the in-process tests alone (under a minute)
# make bench: setup, then the benchmark suite (JSON + report in benchmarks/results/)
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
PIP := $(BIN)/pip --disable-pip-version-check -q
export HF_DATASETS_OFFLINE := 1
export HF_HUB_OFFLINE := 1
export WANDB_MODE := disabled
export PYTHONUNBUFFERED := 1

.PHONY: setup demo lint test test-fast test-all bench clean

AZURITE := .azurite/node_modules/.bin/azurite-blob

setup: $(STAMP) $(AZURITE)

# Azurite (Azure Blob emulator) for the object-store tests; 3.35 is the last release that runs on node 20.
$(AZURITE):
	@echo "[setup] installing Azurite 3.35.0 (npm) into .azurite/"
	npm install --prefix .azurite azurite@3.35.0 --no-audit --no-fund --loglevel=error

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "[setup] installing torch==2.13.0 (CPU) and the project's dependencies into $(VENV)"
	$(PIP) install -c constraints.txt torch==2.13.0 2>&1 | sed '/is ignored: it is neither/d'
	$(PIP) install -c constraints.txt -e '.[dev,titan,s3,azure,tensorstore,hf]' 2>&1 | sed '/is ignored: it is neither/d'
	@$(BIN)/python -c "import torch, torchtitan, s3fs, moto, tensorstore, transformers; print('[setup] ok: torch', torch.__version__)"
	@touch $(STAMP)

demo: setup
	$(BIN)/python -m titan_integration.recovery_demo $(DEMO_ARGS)

# pyright -p .: this checkout's config, never a pyrightconfig.json found in a directory above it
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pyright -p .

# Bytecode first: with PYTHONDONTWRITEBYTECODE set (as in this project's images) every worker process the tests
# start would compile the library again (0.2 s of CPU each, some 300 processes per run).
BYTECODE := $(BIN)/python -m compileall -q torchmoe_ckpt titan_integration torchmoe_harness

# --durations: CI's log names the slowest tests (each must stay well inside the 60 s per-test limit)
test: setup lint
	$(BYTECODE)
	$(BIN)/python -m pytest -q --durations=15 tests

# in-process tests only, by marker: `torchrun` tests start torchrun/gloo processes or servers, `titan` ones TorchTitan
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not torchrun and not titan and not matrix" tests

# the default suite plus the `matrix` cases (more of each kind; ~20 minutes more)
test-all: setup
	$(BYTECODE)
	$(BIN)/python -m pytest -q -m "" tests

bench: setup
	$(BIN)/torchmoe-ckpt bench --out benchmarks/results

clean:
	rm -rf $(VENV) build *.egg-info
