"""The proxy against real upstream servers on 127.0.0.1 (aiohttp.web handlers defined inline)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import uvicorn
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from router.core.errors import (
    BadRequest,
    ErrorBody,
    RequestTooLarge,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from router.core.ids import EngineId
from router.core.policy.breaker import Breakers
from router.core.policy.retry import Outcome, OutcomeKind, RetryPolicy, counts_as_failure, is_retryable
from router.edge.headers import response_headers, upstream_headers, upstream_url
from router.edge.http1 import Http1Response
from router.edge.proxy import _VERDICTS, Proxy, ProxySettings, _verdicts
from router.edge.upstream import ProxyRequest, Target, UpstreamResponse
from tests.gateway_helpers import Handler, fake_engine, uvicorn_on_port_0

WAIT = 5.0  # generous bound for every wait on an event; none is expected to come close


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@asynccontextmanager
async def proxy(**overrides: object) -> AsyncIterator[Proxy]:
    settings = msgspec.structs.replace(
        ProxySettings(retry=RetryPolicy(attempts=3, backoff_s=0.001)), **overrides
    )
    p = Proxy(settings, Breakers(failure_threshold=2, open_seconds=60.0))
    await p.start()
    try:
        yield p
    finally:
        await p.close()


class Fleet:
    """A chooser over named engines in order, skipping tried ones and those whose breaker refuses."""

    def __init__(self, proxy: Proxy, urls: dict[str, str]) -> None:
        self.proxy = proxy
        self.targets = [Target(EngineId(name), url) for name, url in urls.items()]
        self.asked: list[frozenset[EngineId]] = []

    def __call__(self, tried: frozenset[EngineId]) -> Target | None:
        self.asked.append(tried)
        for target in self.targets:
            breaker = self.proxy.breakers.get(target.engine)
            if target.engine not in tried and breaker.available(self.proxy.clock()):
                return target
        return None


def post(path: str = "/v1/completions", body: bytes = b'{"prompt": "hi"}', **headers: str) -> ProxyRequest:
    pairs = [("Content-Type", "application/json"), *headers.items()]
    return ProxyRequest("POST", path, [(k.replace("_", "-"), v) for k, v in pairs], body)


def error_of(exc: Exception) -> ErrorBody:
    from router.core.errors import RouterError

    assert isinstance(exc, RouterError)
    return msgspec.json.decode(exc.body(), type=ErrorBody)


# ---- pure header and URL rules ----


def test_hop_by_hop_headers_are_stripped_both_ways() -> None:
    client = [
        ("Connection", "keep-alive, X-Private"),
        ("Keep-Alive", "timeout=5"),
        ("Proxy-Authorization", "Basic x"),
        ("TE", "trailers"),
        ("Trailer", "X-T"),
        ("Transfer-Encoding", "chunked"),
        ("Upgrade", "h2c"),
        ("X-Private", "secret"),
        ("Host", "evil.example"),
        ("Content-Length", "99"),
        ("Authorization", "Bearer k"),
        ("X-Request-Id", "r1"),
    ]
    assert upstream_headers(client, "http://10.0.0.7:8100") == [
        ("Authorization", "Bearer k"),
        ("X-Request-Id", "r1"),
        ("Host", "10.0.0.7:8100"),
    ]
    engine = [
        ("Connection", "close"),
        ("Transfer-Encoding", "chunked"),
        ("Content-Type", "text/event-stream"),
    ]
    assert response_headers(engine) == [("Content-Type", "text/event-stream")]


@pytest.mark.parametrize("path", ["http://evil/x", "//evil/x", "v1/x", "/v1/x#frag", "/v1 x", "/v1\\x"])
def test_request_cannot_choose_the_host(path: str) -> None:
    with pytest.raises(ValueError):
        upstream_url("http://engine:1", path)


def test_upstream_url_keeps_path_and_query() -> None:
    assert upstream_url("http://e:1/", "/v1/models?x=1&y=%2F") == "http://e:1/v1/models?x=1&y=%2F"


# ---- against real servers ----


def endless_stream(cancelled: asyncio.Event, first: bytes | None = None, sse: bool = False) -> Handler:
    """An engine answer that never ends: headers (SSE's when `sse`), then `first` if given, then
    nothing until the client goes away, which sets `cancelled`."""

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"} if sse else None)
        await response.prepare(request)
        if first is not None:
            await response.write(first)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return response

    return endless


async def test_json_forwarded_byte_for_byte() -> None:
    seen: dict[str, object] = {}

    async def echo(request: web.Request) -> web.Response:
        seen["body"] = await request.read()
        seen["headers"] = dict(request.headers)
        seen["target"] = (request.method, request.path_qs)
        return web.json_response({"ok": True}, headers={"X-Engine": "a"})

    body = b'{"prompt":  "caf\xc3\xa9",\n "max_tokens": 1 }'
    async with fake_engine(echo) as url, proxy() as p:
        request = post("/v1/completions?trace=1", body, Connection="X-Private", X_Private="no", X_Keep="yes")
        answer = await p.forward(request, Fleet(p, {"a": url}))
        assert answer.status == 200 and answer.engine == "a"
        assert msgspec.json.decode(await answer.read()) == {"ok": True}
        assert ("X-Engine", "a") in answer.headers
    assert seen["body"] == body
    assert seen["target"] == ("POST", "/v1/completions?trace=1")
    headers = seen["headers"]
    assert isinstance(headers, dict)
    assert headers["X-Keep"] == "yes" and "X-Private" not in headers
    assert headers["Host"] == url.removeprefix("http://")
    assert "User-Agent" not in headers and headers["Content-Type"] == "application/json"


async def test_sse_chunks_arrive_one_by_one_with_nodelay() -> None:
    release = [asyncio.Event() for _ in range(3)]

    async def sse(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, gate in enumerate(release):
            await response.write(f"data: {i}\n\n".encode())
            await gate.wait()
        await response.write(b"data: [DONE]\n\n")
        return response

    async with fake_engine(sse) as url, proxy() as p:
        answer = await p.forward(post(), Fleet(p, {"a": url}))
        assert answer.status == 200
        assert isinstance(answer.response, Http1Response)  # the real client: a socket under it
        transport = answer.response._conn.transport
        assert transport is not None
        sock = transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        for i, gate in enumerate(release):
            # Chunk i is delivered while the upstream is still blocked before writing chunk i+1.
            chunk = await asyncio.wait_for(anext(answer.body), WAIT)
            assert chunk == f"data: {i}\n\n".encode()
            gate.set()
        assert await answer.read() == b"data: [DONE]\n\n"


async def test_5xx_retried_on_another_engine() -> None:
    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def fine(request: web.Request) -> web.Response:
        return web.json_response({"engine": "b"})

    async with fake_engine(broken) as bad, fake_engine(fine) as good, proxy() as p:
        fleet = Fleet(p, {"a": bad, "b": good})
        answer = await p.forward(post(), fleet)
        assert (answer.engine, answer.status) == ("b", 200)
        assert [(a.engine, a.status) for a in answer.attempts] == [("a", 500), ("b", 200)]
        assert fleet.asked == [frozenset(), frozenset({EngineId("a")})]
        assert p.breakers.get(EngineId("a")).failures == 1
        assert p.breakers.get(EngineId("b")).failures == 0


async def test_5xx_everywhere_maps_to_502_within_the_attempt_budget() -> None:
    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=503, text="engine draining")

    async with fake_engine(broken) as u1, fake_engine(broken) as u2, fake_engine(broken) as u3, proxy() as p:
        p.settings = msgspec.structs.replace(p.settings, retry=RetryPolicy(attempts=2, backoff_s=0.001))
        fleet = Fleet(p, {"a": u1, "b": u2, "c": u3})
        with pytest.raises(UpstreamStatusError) as info:
            await p.forward(post(), fleet)
        assert len(fleet.asked) == 2
    assert info.value.http_status() == 502
    error = error_of(info.value).error
    assert "engine b answered 503: engine draining" in error.message
    assert (error.type, error.code) == ("upstream_error", "upstream_server_error")


async def test_429_retried_then_passed_through() -> None:
    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy"}}, status=429, headers={"Retry-After": "7"})

    async def fine(request: web.Request) -> web.Response:
        return web.json_response({"ok": 1})

    async with fake_engine(busy) as b1, fake_engine(busy) as b2, fake_engine(fine) as ok, proxy() as p:
        answer = await p.forward(post(), Fleet(p, {"a": b1, "b": ok}))
        assert (answer.engine, answer.status) == ("b", 200)
        answer = await p.forward(post(), Fleet(p, {"a": b1, "c": b2}))
        assert (answer.engine, answer.status) == ("c", 429)
        assert ("Retry-After", "7") in answer.headers
        assert msgspec.json.decode(await answer.read()) == {"error": {"message": "busy"}}
        assert p.breakers.get(EngineId("a")).failures == 0  # overload is not a fault


async def test_engine_4xx_passes_through() -> None:
    async def reject(request: web.Request) -> web.Response:
        return web.json_response(
            {"error": {"message": "bad model", "type": "invalid_request_error"}}, status=404
        )

    async with fake_engine(reject) as url, proxy() as p:
        fleet = Fleet(p, {"a": url, "b": url})
        answer = await p.forward(post(), fleet)
        assert (answer.engine, answer.status) == ("a", 404)
        assert b"bad model" in await answer.read()
        assert len(fleet.asked) == 1


async def test_connect_failure_retried_then_mapped_to_502() -> None:
    async def fine(request: web.Request) -> web.Response:
        return web.json_response({"ok": 1})

    closed = closed_port_url()
    async with fake_engine(fine) as ok, proxy() as p:
        answer = await p.forward(post(), Fleet(p, {"dead": closed, "b": ok}))
        assert answer.engine == "b"
        assert answer.attempts[0].outcome is OutcomeKind.CONNECT_FAILED
        with pytest.raises(UpstreamConnectError) as info:
            await p.forward(post(), Fleet(p, {"dead": closed}))
        # Two consecutive failures opened its breaker: the chooser no longer offers it.
        assert not p.breakers.get(EngineId("dead")).available(p.clock())
    assert info.value.http_status() == 502
    assert "cannot connect to engine dead" in error_of(info.value).error.message


async def test_each_attempt_is_chosen_once_in_order() -> None:
    """`choose` (which counts the attempt, router.edge.decider.Exchange.choose) runs once per attempt:
    after an open breaker's refusal, after a 500, and before the engine answers."""

    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def fine(request: web.Request) -> web.Response:
        log.append("engine answers")
        return web.json_response({"ok": 1})

    log: list[str] = []
    async with fake_engine(broken) as bad, fake_engine(fine) as good, proxy() as p:
        targets = {"open": closed_port_url(), "bad": bad, "good": good}
        for _ in range(2):
            p.breakers.get(EngineId("open")).record_failure(p.clock())  # its breaker refuses it

        def choose(tried: frozenset[EngineId]) -> Target | None:
            name = next(n for n in targets if n not in tried)
            log.append(f"choose {name}")
            return Target(EngineId(name), targets[name])

        answer = await p.forward(post(), choose)
        assert answer.engine == "good" and [a.engine for a in answer.attempts] == ["open", "bad", "good"]
        assert log == ["choose open", "choose bad", "choose good", "engine answers"]
        answer.close()


async def test_no_engine_left_is_503() -> None:
    from router.core.errors import NoEngineAvailable

    async with proxy() as p:
        with pytest.raises(NoEngineAvailable) as info:
            await p.forward(post(), lambda tried: None)
    assert info.value.http_status() == 503 and info.value.headers["Retry-After"] == "1"


async def test_first_byte_timeout_is_504_not_retried_and_cancels_upstream() -> None:
    cancelled = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    async with fake_engine(slow) as url, proxy(first_byte_s=0.2) as p:
        fleet = Fleet(p, {"a": url, "b": url})
        with pytest.raises(UpstreamTimeout) as info:
            await p.forward(post(), fleet)
        await asyncio.wait_for(cancelled.wait(), WAIT)
    assert len(fleet.asked) == 1
    assert info.value.http_status() == 504
    assert "first byte timeout" in error_of(info.value).error.message


async def test_client_stopping_mid_stream_disconnects_upstream() -> None:
    cancelled = asyncio.Event()

    async with fake_engine(endless_stream(cancelled, b"data: 0\n\n", sse=True)) as url, proxy() as p:
        answer = await p.forward(post(), Fleet(p, {"a": url}))
        assert await asyncio.wait_for(anext(answer.body), WAIT) == b"data: 0\n\n"
        reader = asyncio.ensure_future(anext(answer.body))
        # One scheduling turn (not a timed wait): the reader runs until it blocks on the socket.
        await asyncio.sleep(0)
        reader.cancel()  # what the ASGI server does when its client goes away
        with pytest.raises(asyncio.CancelledError):
            await reader
        await asyncio.wait_for(cancelled.wait(), WAIT)
        assert p.breakers.get(EngineId("a")).failures == 0


async def test_close_before_iterating_releases_upstream() -> None:
    cancelled = asyncio.Event()

    async with fake_engine(endless_stream(cancelled)) as url, proxy() as p:
        answer = await p.forward(post(), Fleet(p, {"a": url}))
        answer.close()
        await asyncio.wait_for(cancelled.wait(), WAIT)


async def test_upstream_breaking_mid_stream_raises_broken() -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b"data: 0\n\n")
        assert request.transport is not None
        request.transport.close()
        return response

    async with fake_engine(cut) as url, proxy() as p:
        answer = await p.forward(post(), Fleet(p, {"a": url}))
        assert await asyncio.wait_for(anext(answer.body), WAIT) == b"data: 0\n\n"
        with pytest.raises(UpstreamBroken):
            await asyncio.wait_for(answer.read(), WAIT)
        assert p.breakers.get(EngineId("a")).failures == 1


async def test_request_limits_checked_before_connecting() -> None:
    async with proxy(max_body_bytes=8) as p:
        fleet = Fleet(p, {"a": closed_port_url()})
        with pytest.raises(RequestTooLarge) as too_large:
            await p.forward(post(body=b"x" * 9), fleet)
        with pytest.raises(BadRequest):
            await p.forward(post(path="http://evil.example/v1/x", body=b"{}"), fleet)
        assert fleet.asked == []
    assert too_large.value.http_status() == 413


async def test_consumer_closing_the_iterator_disconnects_upstream() -> None:
    cancelled = asyncio.Event()

    async with fake_engine(endless_stream(cancelled, b"data: 0\n\n")) as url, proxy() as p:
        answer = await p.forward(post(), Fleet(p, {"a": url}))
        assert await asyncio.wait_for(anext(answer.body), WAIT) == b"data: 0\n\n"
        await answer.body.aclose()  # type: ignore[attr-defined]
        await asyncio.wait_for(cancelled.wait(), WAIT)


class ClosingStreamingResponse(StreamingResponse):
    """How the gateway wraps an answer: the upstream is closed in a finally, not a background task."""

    def __init__(self, upstream: UpstreamResponse) -> None:
        super().__init__(upstream.body, status_code=upstream.status, headers=dict(upstream.headers))
        self.upstream = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.upstream.close()


@asynccontextmanager
async def serve_gateway(p: Proxy, fleet: Fleet) -> AsyncIterator[int]:
    """A real uvicorn server running a one-route ASGI gateway over the proxy."""

    async def route(request: Request) -> ClosingStreamingResponse:
        body = await request.body()
        upstream = await p.forward(
            ProxyRequest("POST", request.url.path, list(request.headers.items()), body), fleet
        )
        return ClosingStreamingResponse(upstream)

    app = Starlette(routes=[Route("/v1/completions", route, methods=["POST"])])
    async with uvicorn_on_port_0(uvicorn.Config(app, log_level="warning", lifespan="off")) as port:
        yield port


async def test_client_disconnect_through_uvicorn_cancels_upstream() -> None:
    cancelled = asyncio.Event()

    async with fake_engine(endless_stream(cancelled, b"data: first\n\n", sse=True)) as url, proxy() as p:
        async with serve_gateway(p, Fleet(p, {"a": url})) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            received = b""
            async with asyncio.timeout(WAIT):
                while b"data: first" not in received:
                    received += await reader.read(4096)
            assert received.startswith(b"HTTP/1.1 200")
            writer.close()  # the client goes away mid-stream
            await writer.wait_closed()
            await asyncio.wait_for(cancelled.wait(), WAIT)


async def test_the_body_iterator_is_made_once_on_first_use() -> None:
    answer = UpstreamResponse(Target(EngineId("e1"), "http://e1"), 200, [], [])
    answer._buffered = b"whole answer"
    assert answer._body is None  # the relay reads next_chunk: no iterator per answer
    assert answer.body is answer.body
    assert await answer.read() == b"whole answer"


@given(st.lists(st.one_of(st.integers(100, 599), st.integers(-5, 2000)), max_size=20))
def test_an_answers_kept_verdicts_are_the_retry_policys(statuses: list[int]) -> None:
    """Kept per status (three digits only), asked any number of times: the policy's own answers."""
    for status in statuses:
        outcome = Outcome(OutcomeKind.ANSWERED, status)
        expected = (counts_as_failure(outcome), is_retryable(outcome))
        assert (_VERDICTS.get(status) or _verdicts(status)) == expected == _verdicts(status)
    assert all(0 <= status < 1000 for status in _VERDICTS)
