"""Fixtures of the real-engine tests: the vLLM virtualenv (built by `make test-vllm`) and engine pairs.

These tests never skip: without a working vLLM virtualenv they fail and say how to get one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.engine_pair import EnginePair, engine_pair
from tests.vllm.vllm_venv import VenvError, check_venv, venv_python

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVROUTER_VLLM_VENV", REPO / ".venv-vllm"))


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The interpreter that runs vLLM; the session fails (not skips) if vLLM is not usable."""
    try:
        check_venv(VENV)
    except VenvError as exc:
        pytest.fail(f"real-engine tests need vLLM: {exc}", pytrace=False)
    return venv_python(VENV)


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the engines' logs go (printed in a failing start's message)."""
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="module", params=["llama-fa", "gemma2-swa"])
def pair(request: pytest.FixtureRequest, vllm_python: Path, engine_logs: Path) -> Iterator[EnginePair]:
    """Two engines of one tiny model (full attention, then the FA+SWA hybrid), shared by a module's tests."""
    with engine_pair(str(request.param), vllm_python, engine_logs) as started:
        yield started
