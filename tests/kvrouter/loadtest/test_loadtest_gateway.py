"""A policy's gateway that does not become ready in time is a clear error and is stopped, not left behind."""

from __future__ import annotations

import pytest

from kvrouter.loadtest.harness import GatewayProcess
from router.settings.config import EngineConfig, ModelConfig


async def test_a_gateway_that_never_becomes_ready_is_stopped_and_named() -> None:
    # an engine without KV events is never trusted, so /ready never answers 200
    engine = EngineConfig(name="e0", url="http://127.0.0.1:9", model="m")
    gateway = GatewayProcess("kv", [engine], ModelConfig(name="m"))
    with pytest.raises(RuntimeError, match="gateway for policy 'kv' was not ready within 1 s"):
        await gateway.start(timeout_s=1.0)
    assert gateway.process is not None and gateway.process.returncode is not None
