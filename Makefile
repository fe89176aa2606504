# kvrouter: two commands get you going. `make run` starts the gateway with embedded engine stubs;
# `make test` installs everything into .venv and runs lint, types and the whole test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint typecheck pytest bench peer-bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
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

bench: install
	$(BIN)/python bench/events_bench.py
	$(BIN)/python bench/tokenize_bench.py
	$(BIN)/python bench/index_bench.py

# kvrouter vs sglang-router and vllm-router (installed into .bench-venvs/ from PyPI; root, netns, wrk).
peer-bench: install
	$(BIN)/python bench/peer_proxy_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
