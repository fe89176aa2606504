"""The access log and the request id sent upstream, against a real gateway under uvicorn."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec
import pytest
from aiohttp import web
from starlette.types import Receive, Scope, Send

from router.edge.access_log import ACCESS_LOGGER, note_of
from router.edge.asgi_app import GatewayApp
from router.settings.config import EngineConfig, Listen
from tests.gateway_helpers import (
    WAIT,
    engine_of,
    fake_engine,
    gateway_config,
    running_gateway,
    running_stubs,
    wait_for,
)

BODY = {
    "model": "kvrouter-stub",
    "prompt": "The quick brown fox jumps over the lazy dog " * 4,
    "max_tokens": 2,
}


def _access(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ACCESS_LOGGER]


async def test_the_engine_sees_the_gateways_request_id_on_every_route() -> None:
    """Given, replaced or generated, the id the client gets back is the one the engine got."""
    seen: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        seen.append(request.headers.getall("x-request-id", [])[0])
        assert len(request.headers.getall("x-request-id", [])) == 1
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        body = {"object": "text_completion", "choices": [], "usage": usage}
        return web.json_response(body, headers={"x-request-id": "the-engine-echo"})

    async with fake_engine(answer) as url:
        async with running_gateway(gateway_config([EngineConfig(name="echo", url=url)])) as gw:
            ids = []
            for path in ("/v1/completions", "/v1/embeddings"):
                for given in ({}, {"x-request-id": "bad id\t<x>"}, {"x-request-id": "mine-1"}):
                    answered = await gw.client.post(path, json=BODY, headers=given)
                    assert answered.status_code == 200
                    assert len(answered.headers.get_list("x-request-id")) == 1  # the engine's echo dropped
                    ids.append(answered.headers["x-request-id"])
    assert seen == ids
    assert ids[2] == ids[5] == "mine-1" and len(set(ids)) == 5


async def test_one_access_line_per_request_joins_the_engines_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        caplog.clear()
        answered = await gw.client.post("/v1/completions", json=BODY)
        unauthorised = await gw.client.get("/debug/index")
        missing = await gw.client.get("/nowhere")
        models = await gw.client.get("/v1/models", headers={"x-request-id": "list-1"})
        too_big = await gw.client.post(
            "/v1/completions", content=b"x" * (gw.parts.config.limits.max_body_bytes + 1)
        )
    statuses = [r.status_code for r in (answered, unauthorised, missing, models, too_big)]
    assert statuses == [200, 401, 404, 200, 413]
    rid = answered.headers["x-request-id"]
    received = [r for r in caplog.records if r.name == "engine_stub.server.completions"]
    assert [r.__dict__["request_id"] for r in received] == [rid]  # the engine logged the gateway's id
    lines = [r.__dict__ for r in _access(caplog)]
    assert [(x["method"], x["path"], x["status"]) for x in lines] == [
        ("POST", "/v1/completions", 200),
        ("GET", "/debug/index", 401),
        ("GET", "/nowhere", 404),
        ("GET", "/v1/models", 200),
        ("POST", "/v1/completions", 413),
    ]
    first = lines[0]
    cached = msgspec.json.decode(answered.content)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (first["request_id"], first["engine"], first["complete"]) == (rid, "e0", True)
    assert first["predicted_cached_tokens"] == int(answered.headers["x-kvrouter-predicted-cached-tokens"])
    assert first["actual_cached_tokens"] == cached and isinstance(cached, int)
    assert first["duration_ms"] > 0 and first["client"].startswith("127.0.0.1:")
    assert lines[1]["engine"] is None and lines[1]["actual_cached_tokens"] is None
    assert lines[2]["request_id"] is None  # no route took one
    assert lines[3]["request_id"] == "list-1"  # taken, though the union answer does not carry it
    assert lines[4]["request_id"] == too_big.headers["x-request-id"]


async def test_the_access_log_can_be_turned_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with running_stubs(1) as stubs:
        config = gateway_config([engine_of("e0", stubs[0])], listen=Listen(access_log=False))
        async with running_gateway(config) as gw:
            assert (await gw.client.post("/v1/completions", json=BODY)).status_code == 200
            assert (await gw.client.get("/nowhere")).status_code == 404
    assert _access(caplog) == []


def test_requests_without_an_access_line_share_one_unread_note() -> None:
    """No `AccessNote` is made per request while the access log is off (the hot routes' case)."""
    assert note_of({"type": "http"}) is note_of({"type": "http", "path": "/v1/completions"})


def _engine(held: asyncio.Event) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An engine answering completions as JSON or SSE (`stream`), with usage; a prompt of "hold" is
    never answered (`held` is set when it arrives)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("prompt") == "hold":
            held.set()
            await asyncio.Event().wait()  # cancelled when the gateway drops the request
        usage = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
        details = {"prompt_tokens_details": {"cached_tokens": 4}}
        choice = {"index": 0, "text": "x", "finish_reason": "length"}
        answer = {"object": "text_completion", "choices": [choice], "usage": {**usage, **details}}
        if not body.get("stream"):
            return web.json_response(answer)
        stream = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await stream.prepare(request)
        await stream.write(b"data: " + msgspec.json.encode(answer) + b"\n\n")
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    return answer


async def _lines_of_the_same_requests(
    caplog: pytest.LogCaptureFixture, hot: bool
) -> tuple[list[dict[str, object]], list[str]]:
    """The access lines of a JSON, an SSE, a refused (400) answer and a client that leaves before its
    answer, from a gateway serving its hot routes from the protocol (`hot`) or through the ASGI app
    (as when trusted proxies are set); and the paths the ASGI app was called for."""
    called: list[str] = []
    app_call = GatewayApp.__call__

    async def recorded(self: GatewayApp, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            called.append(scope["path"])
        await app_call(self, scope, receive, send)

    listen = Listen() if hot else Listen(forwarded_allow_ips=["127.0.0.1"])
    caplog.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GatewayApp, "__call__", recorded)
        held = asyncio.Event()
        async with fake_engine(_engine(held)) as url:
            config = gateway_config([EngineConfig(name="e0", url=url)], listen=listen)
            async with running_gateway(config) as gw:
                post = gw.client.post
                plain = await post("/v1/completions", json=BODY, headers={"x-request-id": "json"})
                assert plain.status_code == 200
                streamed = {**BODY, "stream": True}
                sse = await post("/v1/completions", json=streamed, headers={"x-request-id": "sse"})
                assert sse.status_code == 200 and sse.text.endswith("data: [DONE]\n\n")
                refused = await post("/v1/completions", content=b"{", headers={"x-request-id": "bad"})
                assert refused.status_code == 400
                await _leave_before_the_answer(gw.url, held)
                await wait_for(_logged(caplog, "left"))
                assert (await gw.client.get("/health")).status_code == 200
    lines = [dict(r.__dict__) for r in _access(caplog) if r.__dict__["path"] == "/v1/completions"]
    for line in lines:
        assert isinstance(line.pop("duration_ms"), float)
        client = line.pop("client")
        assert isinstance(client, str) and client.startswith("127.0.0.1:")
    fields = ("method", "path", "status", "complete", "engine", "predicted_cached_tokens")
    keep = (*fields, "actual_cached_tokens", "request_id", "msg", "args", "levelno")
    return [{key: line[key] for key in keep} for line in lines], called


async def _leave_before_the_answer(url: str, held: asyncio.Event) -> None:
    """POST a held completions request with the id "left" and close the connection once the engine
    has it."""
    host, port = url.removeprefix("http://").split(":")
    body = msgspec.json.encode({**BODY, "prompt": "hold"})
    _, writer = await asyncio.open_connection(host, int(port))
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-request-id: left\r\n"
    writer.write(head + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    async with asyncio.timeout(WAIT):
        await held.wait()
    writer.close()
    await writer.wait_closed()


def _logged(caplog: pytest.LogCaptureFixture, rid: str) -> Callable[[], Awaitable[bool]]:
    async def logged() -> bool:
        return any(r.__dict__.get("request_id") == rid for r in _access(caplog))

    return logged


async def test_hot_requests_write_the_middlewares_access_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With the access log at INFO each hot-route request's line is the one `AccessLog` writes for it
    (200 as JSON and as SSE, a 400, 499 for a client that left), with or without uvicorn's proxy
    headers layer, but for its duration and client port."""
    caplog.set_level(logging.INFO)
    hot, hot_called = await _lines_of_the_same_requests(caplog, hot=True)
    asgi, asgi_called = await _lines_of_the_same_requests(caplog, hot=False)
    assert hot_called.count("/v1/completions") == asgi_called.count("/v1/completions") == 4
    assert [(x["request_id"], x["status"], x["complete"]) for x in hot] == [
        ("json", 200, True),
        ("sse", 200, True),
        ("bad", 400, True),
        ("left", 499, False),
    ]
    assert hot[0]["actual_cached_tokens"] == hot[1]["actual_cached_tokens"] == 4
    assert hot[0]["engine"] == "e0"
    assert hot == asgi
