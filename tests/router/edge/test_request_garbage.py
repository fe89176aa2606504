"""A served request leaves nothing for the cycle collector: the request path frees itself by reference
counting, so no collection has a pile of finished requests to traverse (the c=1 stalls of issue #13).

The real gateway under a real uvicorn on 127.0.0.1:0, in front of a fake engine; the cycle collector
is off while requests are served, and afterwards no request's objects may be left."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import httpx
import pytest
from aiohttp import web
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from router.edge.client_io import ClientWatch
from router.settings.config import EngineConfig
from tests.gateway_helpers import fake_engine, gateway_config, running_gateway, wait_for

BODY = {"model": "m", "prompt": "hello there", "max_tokens": 2}
SSE = [b'data: {"choices":[{"index":0,"text":"x"}]}\n\n', b"data: [DONE]\n\n"]


async def engine(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        return web.json_response({"choices": [{"index": 0, "text": "x"}], "usage": {"prompt_tokens": 2}})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for chunk in SSE:
        await response.write(chunk)
    await response.write_eof()
    return response


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def alive(kind: type) -> int:
    """Objects of `kind` the collector tracks: alive, or garbage waiting for a collection."""
    return sum(1 for obj in gc.get_objects() if type(obj) is kind)


async def _no_requests_left() -> bool:
    return alive(RequestResponseCycle) == alive(ClientWatch) == 0


async def test_finished_requests_are_freed_without_the_cycle_collector(collector_off: None) -> None:
    async with fake_engine(engine) as url:
        config = gateway_config([EngineConfig(name="e0", url=url, model="m")])
        async with running_gateway(config) as gw:
            async with httpx.AsyncClient(base_url=gw.url, timeout=10.0) as client:
                for stream in (False, True, False, True):
                    answer = await client.post("/v1/completions", json={**BODY, "stream": stream})
                    assert answer.status_code == 200 and answer.content
            # The client's connection is closed: uvicorn drops its last cycle once it sees that.
            await wait_for(_no_requests_left)


async def test_a_closed_watch_is_freed_without_the_cycle_collector(collector_off: None) -> None:
    waiting, never = asyncio.Event(), asyncio.Event()

    async def receive() -> dict[str, object]:
        waiting.set()
        await never.wait()
        return {"type": "http.disconnect"}

    watch = ClientWatch(receive)
    await waiting.wait()
    watch.close()
    del watch
    await wait_for(lambda: _gone(ClientWatch))


async def _gone(kind: type) -> bool:
    return alive(kind) == 0
