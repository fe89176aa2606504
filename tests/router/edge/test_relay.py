"""The relay through the real gateway under uvicorn on 127.0.0.1:0, counting the client leg's writes: what
the engine sent together leaves together (the stream's end with its last bytes), nothing waits for more,
and a stream the engine breaks or the client leaves still ends as before.

The engine is a raw asyncio server, so the test decides which bytes arrive in one segment."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from router.edge import http1, http1_connection
from router.settings.config import EngineConfig, Listen
from tests.gateway_helpers import gateway_config, record_client_writes, running_gateway
from tests.router.edge.test_client_writes import WAIT

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
REQUEST = b'{"model": "m", "prompt": "hi", "max_tokens": 2, "stream": true}'
Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


def chunked(*events: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)


def event(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"text":"%d"}]}\n\n' % i


@asynccontextmanager
async def raw_engine(script: Script) -> AsyncIterator[str]:
    """An engine that reads one request per connection and answers it with `script`; yields its URL."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(v)
            for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
            if k.lower() == b"content-length"
        )
        await reader.readexactly(length)
        try:
            await script(writer)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@asynccontextmanager
async def gateway_writes(
    url: str, monkeypatch: pytest.MonkeyPatch, coalesce_s: float = 0.0
) -> AsyncIterator[tuple[str, list[bytes]]]:
    """The gateway in front of `url` (with `[listen] stream_coalesce_s`), and every write it makes on
    its client connections."""
    writes: list[bytes] = []
    record_client_writes(monkeypatch, writes)
    listen = Listen(port=0, stream_coalesce_s=coalesce_s)  # not decoded: the window's cap not applied
    config = gateway_config([EngineConfig(name="e0", url=url, model="m")], listen=listen)
    async with running_gateway(config) as gw:
        yield gw.url, writes


async def post(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n")
    writer.write(b"Content-Length: %d\r\n\r\n%s" % (len(REQUEST), REQUEST))
    return reader, writer


FLOOD_WAIT = 60.0
"""The bound on a whole 16 MB relay: a liveness check, which a loaded 2-core machine took over WAIT for."""


async def read_until(
    reader: asyncio.StreamReader, received: bytes, marker: bytes, wait: float = WAIT
) -> bytes:
    async with asyncio.timeout(wait):
        while marker not in received:
            data = await reader.read(65536)
            if not data:
                break
            received += data
    return received


async def test_chunks_that_arrive_together_leave_in_one_write_with_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def all_at_once(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(event(0), event(1), b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async with raw_engine(all_at_once) as url, gateway_writes(url, monkeypatch) as (gw, writes):
        reader, writer = await post(gw)
        received = await read_until(reader, b"", b"\r\n0\r\n\r\n")
        writer.close()
    assert received.startswith(b"HTTP/1.1 200") and received.endswith(b"\r\n0\r\n\r\n")
    body = received.partition(b"\r\n\r\n")[2]
    assert body == chunked(event(0) + event(1) + b"data: [DONE]\n\n") + b"0\r\n\r\n"
    assert len(writes) == 1  # head, every event and the end of the stream


async def test_an_answer_that_arrived_whole_is_read_with_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bytes | None] = []
    awaited: list[bytes] = []
    real, real_ready = http1.Http1Response.next_chunk, http1.Http1Response.ready

    async def counted(self: http1.Http1Response) -> bytes:
        awaited.append(chunk := await real(self))
        return chunk

    def counted_ready(self: http1.Http1Response) -> bytes | None:
        calls.append(chunk := real_ready(self))
        return chunk

    monkeypatch.setattr(http1.Http1Response, "next_chunk", counted)
    monkeypatch.setattr(http1.Http1Response, "ready", counted_ready)

    async def all_at_once(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(event(0), b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async with raw_engine(all_at_once) as url, gateway_writes(url, monkeypatch) as (gw, _):
        reader, writer = await post(gw)
        received = await read_until(reader, b"", b"\r\n0\r\n\r\n")
        writer.close()
    assert received.endswith(chunked(event(0) + b"data: [DONE]\n\n") + b"0\r\n\r\n")
    assert calls == [event(0) + b"data: [DONE]\n\n"]  # its last bytes ended it: no call for b"" after
    assert awaited == []  # and it was there: taken with no coroutine, nothing awaited


async def test_a_first_chunk_leaves_before_the_rest_exists_and_the_end_rides_the_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    go = asyncio.Event()

    async def first_then_rest(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(event(0)))
        await writer.drain()
        await go.wait()  # the engine decodes the next token only once the client holds the first
        writer.write(chunked(event(1), b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async with raw_engine(first_then_rest) as url, gateway_writes(url, monkeypatch) as (gw, writes):
        reader, writer = await post(gw)
        received = await read_until(reader, b"", event(0))
        assert not go.is_set() and len(writes) == 1  # the head and the first chunk, together
        go.set()
        received = await read_until(reader, received, b"\r\n0\r\n\r\n")
        writer.close()
    assert received.endswith(chunked(event(1) + b"data: [DONE]\n\n") + b"0\r\n\r\n")
    assert len(writes) == 2  # the rest and the end of the stream in one


async def test_an_engine_breaking_mid_stream_cuts_the_client_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def breaks(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(event(0)))
        await writer.drain()  # then the connection closes with the stream unfinished

    async with raw_engine(breaks) as url, gateway_writes(url, monkeypatch) as (gw, _):
        reader, writer = await post(gw)
        received = await read_until(reader, b"", b"\r\n0\r\n\r\n")  # returns at EOF
        writer.close()
    assert event(0) in received and not received.endswith(b"0\r\n\r\n")  # cut, never a clean end


async def test_a_client_leaving_mid_stream_drops_the_engine_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dropped = asyncio.Event()

    async def endless(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(event(0)))
        try:
            while True:  # an engine decoding until its client is gone
                await asyncio.sleep(0.01)  # the engine's pace, not synchronisation
                writer.write(chunked(event(1)))
                await writer.drain()
        except ConnectionError:
            dropped.set()

    async with raw_engine(endless) as url, gateway_writes(url, monkeypatch) as (gw, _):
        reader, writer = await post(gw)
        await read_until(reader, b"", event(0))
        writer.close()
        await asyncio.wait_for(dropped.wait(), WAIT)


def count_asgi_sends(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, the type of every ASGI message any request cycle sends is appended to the list."""
    sent: list[str] = []
    real = RequestResponseCycle.send

    async def send(self: RequestResponseCycle, message: Any) -> None:
        sent.append(message["type"])
        await real(self, message)

    monkeypatch.setattr(RequestResponseCycle, "send", send)
    return sent


async def test_after_the_first_chunk_each_engine_read_is_one_write_with_no_asgi_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent = count_asgi_sends(monkeypatch)
    held = [asyncio.Event() for _ in range(6)]

    async def one_event_per_read(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(event(0)))
        await writer.drain()
        for i in range(1, 6):
            await held[i - 1].wait()  # the client holds the previous event: this one is a read of its own
            writer.write(chunked(event(i)))
            await writer.drain()
        await held[5].wait()
        writer.write(chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async with raw_engine(one_event_per_read) as url, gateway_writes(url, monkeypatch) as (gw, writes):
        reader, writer = await post(gw)
        received = b""
        for i in range(6):
            received = await read_until(reader, received, event(i))
            held[i].set()
        received = await read_until(reader, received, b"\r\n0\r\n\r\n")
        writer.close()
    body = received.partition(b"\r\n\r\n")[2]
    assert body == b"".join(chunked(event(i)) for i in range(6)) + chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    assert len(writes) == 7  # head with event 0, events 1-5 one write each, [DONE] with the end
    # The head, the first chunk, and [DONE] with the end: events 1-5 went from the engine's reads
    # straight to the client transport (one ASGI send per chunk before).
    assert sent == ["http.response.start", "http.response.body", "http.response.body"]


async def test_a_client_that_stops_reading_pauses_the_engine_read_and_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = [b"data: %d %s\n\n" % (i, b"x" * 16_000) for i in range(1024)]  # ~16 MB in 16 kB events
    paused = asyncio.Event()
    pause = http1_connection.Connection.pause

    def spied(self: http1_connection.Connection) -> None:
        if self.sink_full:
            paused.set()  # the client's transport is full: the engine's socket is no longer read
        pause(self)

    monkeypatch.setattr(http1_connection.Connection, "pause", spied)

    async def flood(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(events[0]))
        await writer.drain()
        for e in events[1:]:
            writer.write(chunked(e))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with raw_engine(flood) as url, gateway_writes(url, monkeypatch) as (gw, _):
        reader, writer = await post(gw)
        await asyncio.wait_for(paused.wait(), WAIT)  # the client has read nothing yet
        received = await read_until(reader, b"", b"\r\n0\r\n\r\n", FLOOD_WAIT)
        writer.close()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    decoded, rest = [], body
    while rest != b"0\r\n\r\n":
        size, _, rest = rest.partition(b"\r\n")
        decoded.append(rest[: int(size, 16)])
        rest = rest[int(size, 16) + 2 :]
    assert b"".join(decoded) == b"".join(events)  # every byte, in order, and a clean end


async def test_a_coalescing_window_reads_what_came_during_it_at_once_and_writes_it_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first_in, second_in, last_in = asyncio.Event(), asyncio.Event(), asyncio.Event()
    done = chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    async def during_the_window(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(event(0)))
        await writer.drain()
        await first_in.wait()  # the first chunk is never held: the client has it already
        writer.write(chunked(event(1)))
        await writer.drain()
        await second_in.wait()  # written at once: it came after a quiet spell
        writer.write(chunked(event(2)))  # two writes within the window of event 1's client write
        await writer.drain()
        writer.write(chunked(event(3)))
        await writer.drain()
        await last_in.wait()
        writer.write(done)
        await writer.drain()

    async with (
        raw_engine(during_the_window) as url,
        gateway_writes(url, monkeypatch, coalesce_s=1.0) as (gw, writes),
    ):
        reader, writer = await post(gw)
        received = await read_until(reader, b"", event(0))
        first_in.set()
        received = await read_until(reader, received, event(1))
        second_in.set()
        received = await read_until(reader, received, event(3))
        last_in.set()
        received = await read_until(reader, received, b"\r\n0\r\n\r\n")
        writer.close()
    assert received.endswith(chunked(event(0)) + chunked(event(1)) + chunked(event(2) + event(3)) + done)
    assert writes[1:] == [chunked(event(1)), chunked(event(2) + event(3)), done]
