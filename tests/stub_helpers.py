"""Helpers for tests that run the engine stub behind real uvicorn on 127.0.0.1 (port 0)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import zmq
import zmq.asyncio

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupSpec
from engine_stub.runtime.cost_model import CostModel
from engine_stub.server.launch import StubServer, running_stub
from engine_stub.stub_config import StubConfig
from events.config import KVEventsConfig
from events.frames import Frame, parse_frame

__all__ = ["BS", "EPHEMERAL", "SOURCES", "RawSub", "live_stub", "stub_config"]

BS = 16
EPHEMERAL = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
SOURCES = msgspec.json.Decoder(dict[int, KVEventsConfig])


def stub_config(**overrides: Any) -> StubConfig:
    """A fast stub on 127.0.0.1:0 with ephemeral event endpoints; keyword arguments override fields."""
    cache = CacheConfig(num_gpu_blocks=256, groups=(GroupSpec(block_size=BS),), max_model_len=4096)
    base = StubConfig(
        host="127.0.0.1",
        port=0,
        host_ip="127.0.0.1",
        engine=EngineCoreConfig(cache=cache),
        cost=CostModel(speed_factor=1000.0),
        kv_events=EPHEMERAL,
    )
    return msgspec.structs.replace(base, **overrides)


@asynccontextmanager
async def live_stub(config: StubConfig | None = None) -> AsyncIterator[tuple[StubServer, httpx.AsyncClient]]:
    """A running stub and an httpx client pointed at it."""
    async with running_stub(config or stub_config()) as server:
        assert server.info is not None
        async with httpx.AsyncClient(base_url=server.info.url, timeout=10.0) as client:
            yield server, client


class RawSub:
    """A plain ZeroMQ SUB socket on one publisher's live stream: sees exactly what was sent live."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.linger = 0
        self.sock.subscribe(b"")
        self.sock.connect(endpoint)

    async def next(self, timeout: float = 5.0) -> Frame:
        """The next live frame; TimeoutError if none arrives in time."""
        parts = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        return parse_frame(parts)

    def close(self) -> None:
        self.sock.close(linger=0)
