"""Shared fixtures: vLLM fixtures and traces (tests/data), the unit mark, hypothesis without timing checks."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Hypothesis' per-example deadline (200 ms) and its too-slow health check are timing assertions: on a
# shared 2-core machine a property test failed one run in a few under load and passed alone. Every
# property keeps its examples; only the clock is no longer part of the verdict.
settings.register_profile("kvrouter", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvrouter")

TESTS = Path(__file__).resolve().parent
VLLM_FIXTURES = TESTS / "data" / "vllm-0.33.0"  # captured from vLLM: see its README
TRACES = TESTS / "data" / "mooncake-traces"  # the first 200 requests of each Mooncake trace: see its README

# `make unit` (`pytest -m unit`): the tests of modules that run on their own, with no server started (the
# pure core, events, tokenization, preparation, the stub's core): the fast half. `make e2e` runs the rest.
UNIT_PATHS = tuple(
    TESTS / p
    for p in (
        "test_layering.py",
        "test_doc_links.py",
        "events",
        "tokenization",
        "router/core",
        "router/prepare",
        "engine_stub/core",
    )
)
# Under a unit path, but not unit: a whole-fleet simulation (a minute), and a test against a real stub server.
NOT_UNIT = (
    TESTS / "router/core/policy/test_decode_heavy_routing.py",
    TESTS / "router/prepare/test_remote_tokenize.py",
)


def is_unit(path: Path) -> bool:
    """Whether the tests in `path` (a test file) are unit tests."""
    return path not in NOT_UNIT and any(path.is_relative_to(p) for p in UNIT_PATHS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if is_unit(item.path):
            item.add_marker(pytest.mark.unit)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under `-m unit`, the other test files are not even imported (importing them takes seconds)."""
    if config.option.markexpr != "unit" or collection_path.is_dir():
        return None
    return True if collection_path.suffix == ".py" and not is_unit(collection_path) else None


@pytest.fixture(scope="session")
def vllm_fixtures() -> Path:
    """The directory of frames, hash vectors and manager traces captured from vLLM 0.33.0."""
    assert VLLM_FIXTURES.is_dir(), f"missing {VLLM_FIXTURES}"
    return VLLM_FIXTURES


@pytest.fixture(autouse=True)
def _restore_root_logger() -> Iterator[None]:
    """Commands run in-process (`kvrouter.cli.main`) reconfigure the root logger; undo it after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
