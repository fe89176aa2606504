"""Slow and idle clients, over raw sockets against a real uvicorn gateway: they time out, are counted,
and never hold an admission slot (#10 item 6)."""

from __future__ import annotations

import asyncio

import msgspec

from router.core.errors import ErrorBody
from router.settings.config import Limits, Timeouts
from tests.e2e.test_gateway_http import BODY
from tests.gateway_helpers import (
    Gateway,
    engine_of,
    gateway_config,
    metric,
    running_gateway,
    running_stubs,
    wait_for,
)

HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
PARTIAL = b'{"model": "kvrouter-stub", "prompt": "'
# Short client timeouts so the test is quick; the slow clients below never finish, so any value works.
# The body timeout is the longer one: all four slow bodies must still be under way together when
# the normal request is sent, and on a loaded machine their four connects can take longer than 0.3 s.
TIMEOUTS = Timeouts(client_header_s=0.3, client_body_s=2.0, client_keepalive_s=1.0)
LIMITS = Limits(max_in_flight_total=4, max_in_flight_per_engine=4)


async def connect(gw: Gateway, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    return reader, writer


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the gateway sends before it closes the connection."""
    async with asyncio.timeout(10.0):
        return await reader.read()


async def counted(gw: Gateway, name: str, value: float, **labels: str) -> None:
    async def reached() -> bool:
        return metric((await gw.client.get("/metrics")).text, name, **labels) == value

    await wait_for(reached)


async def test_slow_bodies_and_idle_connections_time_out_counted_and_hold_no_slot() -> None:
    async with running_stubs(1) as stubs:
        config = gateway_config([engine_of("e0", stubs[0])], limits=LIMITS, timeouts=TIMEOUTS)
        async with running_gateway(config) as gw:
            # As many unfinished bodies as the gateway has admission slots: Content-Length and chunked.
            slow = [await connect(gw, HEAD + b"content-length: 10000\r\n\r\n" + PARTIAL) for _ in range(2)]
            chunked = HEAD + b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(PARTIAL), PARTIAL)
            slow += [await connect(gw, chunked) for _ in range(2)]
            idle = await connect(gw, b"")  # connected, nothing sent
            half_head = await connect(gw, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            await wait_for(lambda: _now(len(gw.server.server_state.tasks) >= 4))  # every body read began

            # A normal request is served while every slow client is still sending.
            answer = await gw.client.post("/v1/completions", json=BODY)
            assert answer.status_code == 200, answer.text

            for reader, writer in slow:
                head, _, body = (await until_closed(reader)).partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 408 "), head
                assert b"connection: close" in head.lower()
                error = msgspec.json.decode(body, type=ErrorBody).error
                assert error.type == "invalid_request_error" and error.code == "request_timeout"
                writer.close()
            for reader, writer in (idle, half_head):
                assert await until_closed(reader) == b""  # no request to answer: the connection is closed
                writer.close()

            # A kept-alive connection left idle after its answer is closed too.
            request = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
            reader, writer = await connect(gw, request)
            assert (await until_closed(reader)).startswith(b"HTTP/1.1 200 ")
            writer.close()

            # And one that starts a second request but never finishes its headers.
            reader, writer = await connect(gw, request)
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
            writer.write(b"GET /health HTTP/1.1\r\nhost:")
            await until_closed(reader)
            writer.close()

            await counted(gw, "kvrouter_client_timeouts_total", 4, phase="body")
            await counted(gw, "kvrouter_client_timeouts_total", 3, phase="header")
            await wait_for(lambda: idle_closed(gw))  # this one, and maybe an idle connection of gw.client
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_requests_total", engine="none", status="408") == 4
            assert metric(text, "kvrouter_requests_total", engine="e0", status="200") == 1
            assert gw.parts.fleet.admission.total == 0


async def test_a_slow_body_on_a_passthrough_path_times_out_too() -> None:
    async with running_stubs(1) as stubs:
        timeouts = Timeouts(client_header_s=0.3, client_body_s=0.3, client_keepalive_s=1.0)  # one body
        config = gateway_config([engine_of("e0", stubs[0])], limits=LIMITS, timeouts=timeouts)
        async with running_gateway(config) as gw:
            head = b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            reader, writer = await connect(gw, head + b"content-length: 100\r\n\r\n{")
            assert (await until_closed(reader)).startswith(b"HTTP/1.1 408 ")
            writer.close()
            await counted(gw, "kvrouter_client_timeouts_total", 1, phase="body")
            assert gw.parts.fleet.admission.total == 0


async def _now(value: bool) -> bool:
    return value


async def idle_closed(gw: Gateway) -> bool:
    return metric((await gw.client.get("/metrics")).text, "kvrouter_client_timeouts_total", phase="idle") >= 1


async def test_a_busy_kept_alive_connection_outlives_the_header_timeout() -> None:
    """The header deadline is each head's own: a connection sending one request after another for
    several header timeouts is never closed for the first head's deadline (the connection keeps one
    timer, re-armed to the latest head's deadline), and nothing is counted."""
    async with running_stubs(1) as stubs:
        config = gateway_config([engine_of("e0", stubs[0])], timeouts=TIMEOUTS)
        async with running_gateway(config) as gw:
            request = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
            reader, writer = await connect(gw, b"")
            loop = asyncio.get_running_loop()
            until, answered = loop.time() + 4 * TIMEOUTS.client_header_s, 0
            while loop.time() < until or answered < 3:
                writer.write(request)
                async with asyncio.timeout(10.0):
                    head = await reader.readuntil(b"\r\n\r\n")
                    await reader.readexactly(15)  # {"status":"ok"}
                assert head.startswith(b"HTTP/1.1 200 "), head
                answered += 1
            writer.close()
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_client_timeouts_total", phase="header") == 0


async def test_a_keep_alive_wait_shorter_than_the_header_timeout_still_ends_on_its_own() -> None:
    """The head and keep-alive deadlines share the connection's one timer: a keep-alive wait much
    shorter than the header timeout ends (counted "idle") long before the header timeout could."""
    timeouts = Timeouts(client_header_s=600.0, client_body_s=600.0, client_keepalive_s=0.2)
    async with running_stubs(1) as stubs:
        config = gateway_config([engine_of("e0", stubs[0])], timeouts=timeouts)
        async with running_gateway(config) as gw:
            reader, writer = await connect(gw, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = await until_closed(reader)  # the answer, then the idle close
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"status":"ok"}')
            writer.close()
            await counted(gw, "kvrouter_client_timeouts_total", 1, phase="idle")
            assert (
                metric(
                    (await gw.client.get("/metrics")).text, "kvrouter_client_timeouts_total", phase="header"
                )
                == 0
            )
