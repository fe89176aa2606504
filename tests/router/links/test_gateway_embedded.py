"""Embedded mode: engine stubs as child processes on free ports, ready lines read, stopped on shutdown."""

from __future__ import annotations

import sys

import httpx
import pytest

from router.links.embedded_stubs import EmbeddedError, EmbeddedStubs, stub_argv
from router.settings.config import Embedded


def test_stub_command_line_asks_for_ephemeral_loopback_events() -> None:
    argv = stub_argv(Embedded(engines=1, num_gpu_blocks=64, block_size=32), None, ["kvrouter"])
    assert argv[:2] == ["kvrouter", "--log-level"]
    assert argv[argv.index("--port") + 1] == "0"
    assert argv[argv.index("--block-size") + 1] == "32"
    assert argv[argv.index("--num-gpu-blocks") + 1] == "64"
    events = argv[argv.index("--kv-events-config") + 1]
    assert '"endpoint":"tcp://*:0"' in events and '"replay_endpoint":"tcp://*:0"' in events


async def test_two_stubs_start_answer_and_stop() -> None:
    stubs = EmbeddedStubs(Embedded(engines=2, num_gpu_blocks=128))
    try:
        engines = await stubs.start(timeout_s=60.0)
        assert [e.name for e in engines] == ["embedded-0", "embedded-1"]
        assert len({e.url for e in engines}) == 2
        for engine in engines:
            assert engine.url.startswith("http://127.0.0.1:")
            assert engine.events[0].startswith("tcp://127.0.0.1:") and engine.replay[0].startswith(
                "tcp://127.0.0.1:"
            )
            async with httpx.AsyncClient(base_url=engine.url) as client:
                assert (await client.get("/health")).status_code == 200
        processes = list(stubs.processes)
    finally:
        await stubs.stop()
    assert all(p.returncode is not None for p in processes)
    assert stubs.processes == []


async def test_a_stub_that_dies_before_ready_is_a_clear_error() -> None:
    stubs = EmbeddedStubs(Embedded(engines=2), prefix=[sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(EmbeddedError, match="exited with code 3 before it was ready"):
        await stubs.start(timeout_s=30.0)
    assert stubs.processes == []


async def test_a_stub_that_never_gets_ready_times_out_and_is_killed() -> None:
    hang = [sys.executable, "-c", "import sys, time; print('starting', flush=True); time.sleep(600)"]
    stubs = EmbeddedStubs(Embedded(engines=1), prefix=hang)
    with pytest.raises(EmbeddedError, match="no ready line within 1 s"):
        await stubs.start(timeout_s=1.0)
    assert stubs.processes == []
