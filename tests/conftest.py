"""Shared fixtures: vLLM fixtures and traces (tests/data), the unit mark, hypothesis without timing checks."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
        "test_max_examples.py",
        "events",
        "tokenization",
        "router/core",
        "router/prepare",
        "engine_stub/core",
    )
)
# Under a unit path, but not unit: whole-fleet simulations (a minute; and every `test_*_sim.py`: ~27 s of
# CPU together, half of the rest of the unit tests), and a test against a real stub server.
NOT_UNIT = (
    TESTS / "router/core/policy/test_decode_heavy_routing.py",
    TESTS / "router/prepare/test_remote_tokenize.py",
)


def is_unit(path: Path) -> bool:
    """Whether the tests in `path` (a test file) are unit tests."""
    if path in NOT_UNIT or path.name.endswith("_sim.py"):
        return False
    return any(path.is_relative_to(p) for p in UNIT_PATHS)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--max-examples",
        type=int,
        default=None,
        help="run each property test with at most this many examples (`make unit`; `make test` runs all)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    most: int | None = config.getoption("max_examples")
    for item in items:
        if is_unit(item.path):
            item.add_marker(pytest.mark.unit)
        if most is not None:
            cap_examples(getattr(item, "obj", None), most)


def cap_examples(test: Any, most: int) -> None:
    """At most `most` examples for the property test `test` (anything else is left alone). A test's
    own `@settings(max_examples=...)` outranks any profile, so the cap goes on the settings
    hypothesis keeps on the `@given` test and reads when it runs (`_hypothesis_internal_use_settings`,
    hypothesis' own attribute: it offers no public way to scale every test's count;
    tests/test_max_examples.py fails if the cap stops holding)."""
    current = getattr(test, "_hypothesis_internal_use_settings", None)
    if isinstance(current, settings) and current.max_examples > most:
        test._hypothesis_internal_use_settings = settings(current, max_examples=most)


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
