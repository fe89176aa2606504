"""Discovery's /v1/models question (router.edge.model_probe) over real sockets on 127.0.0.1, on the
gateway's own HTTP client: the served model found, and every failure answered None and counted by
reason, the probe going on for the next engine."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from router.edge.model_probe import MAX_BYTES, MODEL_PROBE_ERRORS, ModelProbe
from router.settings.config import EngineConfig
from tests.gateway_helpers import fake_engine

LISTED = [{"id": "lora-a", "parent": "llama-3"}, {"id": "llama-3", "parent": None}]


def engine(url: str) -> EngineConfig:
    return EngineConfig(name="e", url=url)


@asynccontextmanager
async def probing(timeout_s: float = 5.0) -> AsyncIterator[ModelProbe]:
    probe = ModelProbe(timeout_s)
    try:
        yield probe
    finally:
        probe.close()


async def test_the_first_model_that_is_not_an_adapter_is_the_answer() -> None:
    seen: list[tuple[str, str]] = []

    async def models(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Accept-Encoding", "")))
        return web.json_response({"object": "list", "data": LISTED})

    async with fake_engine(models) as url, probing() as probe:
        assert await probe(engine(url)) == "llama-3"
        assert await probe(engine(url)) == "llama-3"  # its connection kept and used again
    assert seen == [("/v1/models", "identity")] * 2
    assert sum(probe.errors.values()) == 0


async def status(request: web.Request) -> web.StreamResponse:
    return web.Response(status=503)  # still loading


async def redirect(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("http://127.0.0.1:1/v1/models")


async def declared_huge(request: web.Request) -> web.StreamResponse:
    return web.Response(body=b" " * (MAX_BYTES + 1), content_type="application/json")


async def streamed_huge(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()  # chunked: no length declared, the body grows past the bound
    await response.prepare(request)
    for _ in range(MAX_BYTES // 65536 + 2):
        await response.write(b" " * 65536)
    await response.write_eof()
    return response


async def malformed(request: web.Request) -> web.StreamResponse:
    return web.Response(body=b"<html>not a list</html>", content_type="text/html")


async def adapters_only(request: web.Request) -> web.StreamResponse:
    return web.json_response({"object": "list", "data": LISTED[:1]})


async def silent(request: web.Request) -> web.StreamResponse:
    await asyncio.Event().wait()  # never answers (cancelled when the client goes)
    raise AssertionError("unreachable")


async def test_each_failed_answer_is_none_and_counted_by_its_reason() -> None:
    handlers = (status, redirect, declared_huge, streamed_huge, malformed, adapters_only)
    async with probing() as probe:
        for handler in handlers:
            async with fake_engine(handler) as url:
                assert await probe(engine(url)) is None, handler.__name__
    expected = {"status": 1, "redirect": 1, "too_large": 2, "malformed": 1, "no_model": 1}
    assert probe.errors == {reason: expected.get(reason, 0) for reason in MODEL_PROBE_ERRORS}


async def test_a_silent_engine_is_a_timeout_and_a_closed_port_a_connection_failure() -> None:
    async with probing(timeout_s=0.2) as probe, fake_engine(silent) as url:
        assert await probe(engine(url)) is None
        assert probe.errors["timeout"] == 1
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    async with probing() as probe, fake_engine(status) as other:
        assert await probe(engine(closed)) is None
        assert probe.errors["connection"] == 1
        assert await probe(engine(other)) is None and probe.errors["status"] == 1  # the next one is asked
