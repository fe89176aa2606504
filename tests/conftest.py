"""Shared fixtures: vLLM fixtures (tests/data), traces (../shared); hypothesis without timing checks."""

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

SHARED = Path(__file__).resolve().parents[1].parent / "shared"  # the Mooncake traces, beside the clone
VLLM_FIXTURES = Path(__file__).resolve().parent / "data" / "vllm-0.33.0"  # in the repository: see its README


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
