"""Shared fixtures: paths to the vLLM fixtures in ../shared."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
VLLM_FIXTURES = SHARED / "fixtures" / "vllm-0.33.0"


@pytest.fixture(scope="session")
def vllm_fixtures() -> Path:
    """The directory of frames, hash vectors and manager traces captured from vLLM 0.33.0."""
    assert VLLM_FIXTURES.is_dir(), f"missing {VLLM_FIXTURES}: shared/ must sit beside the clone"
    return VLLM_FIXTURES


@pytest.fixture(autouse=True)
def _restore_root_logger() -> Iterator[None]:
    """Commands run in-process (`kvrouter.cli.main`) reconfigure the root logger; undo it after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
