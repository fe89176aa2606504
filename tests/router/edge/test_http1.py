"""The upstream HTTP/1.1 client against real servers on 127.0.0.1:0: framing, keep-alive, timeouts,
cancellation, broken engines, and one write per request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager

import pytest
import uvloop
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from router.edge import http1, http1_connection
from router.edge.http1 import ClientSettings, Http1Client, Http1Response
from router.edge.http1_connection import Connection
from tests.gateway_helpers import fake_engine

WAIT = 5.0  # generous bound for every wait on an event; none is expected to come close
RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """A TCP server on 127.0.0.1:0 running `handler` per connection; counts connections."""

    def __init__(self, handler: RawHandler) -> None:
        self.handler = handler
        self.connections = 0
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        finally:
            writer.close()


@asynccontextmanager
async def raw_server(handler: RawHandler) -> AsyncIterator[RawServer]:
    state = RawServer(handler)
    server = await asyncio.start_server(state._serve, "127.0.0.1", 0)
    state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield state
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and its Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


@asynccontextmanager
async def client(**overrides: float) -> AsyncIterator[Http1Client]:
    c = Http1Client(ClientSettings(**overrides))  # type: ignore[arg-type]
    try:
        yield c
    finally:
        c.close()


async def body_of(response: Http1Response) -> bytes:
    out = b""
    while chunk := await response.next_chunk():
        out += chunk
    return out


async def test_keep_alive_reuses_one_connection_for_sequential_requests() -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async with fake_engine(answer) as url, client() as c:
        peers = set()
        for i in range(3):
            response = await c.request("POST", url, "/v1/x", [("Host", "e")], b"body %d" % i)
            assert response.status == 200 and await body_of(response) == b"body %d" % i
            peers.add(response._conn.transport.get_extra_info("sockname"))  # type: ignore[union-attr]
        assert len(peers) == 1


async def test_a_kept_connection_parses_each_answer_with_its_one_parser() -> None:
    """The parser is not rebuilt per exchange: each answer on a kept connection still gets its own
    status, headers and body, whatever the framing of the one before."""
    answers = [
        b"HTTP/1.1 200 OK\r\nX-A: 1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\nno",
        b"HTTP/1.1 204 No Content\r\nX-C: 3\r\n\r\n",
        b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\n\r\nfifth",
    ]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            await read_request(reader)
            writer.write(answer)
            await writer.drain()

    expected = [
        (200, [("X-A", "1"), ("Transfer-Encoding", "chunked")], b"abc"),
        (404, [("Content-Length", "2")], b"no"),
        (204, [("X-C", "3")], b""),
        (201, [("Content-Length", "5")], b"fifth"),
    ]
    async with raw_server(handler) as server, client() as c:
        parsers = []
        for status, headers, body in expected:
            response = await c.request("POST", server.url, "/", [], b"{}")
            parsers.append(response._conn.parser)
            assert (response.status, response.headers, await body_of(response)) == (status, headers, body)
        assert server.connections == 1 and all(p is parsers[0] for p in parsers)


async def test_chunked_and_eof_framed_bodies_are_decoded() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        if b"/chunked" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
            await writer.drain()
            await read_request(reader)  # the connection was kept: a second request arrives on it
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        await writer.drain()

    async with raw_server(handler) as server, client() as c:
        response = await c.request("POST", server.url, "/chunked", [], b"{}")
        assert await body_of(response) == b"abcde"
        assert ("Transfer-Encoding", "chunked") in response.headers
        again = await c.request("POST", server.url, "/chunked", [], b"{}")
        assert again.status == 204 and await body_of(again) == b""
        assert server.connections == 1
        eof = await c.request("GET", server.url, "/eof", [], b"")
        assert await body_of(eof) == b"until the end"


async def test_head_and_body_go_out_in_one_write_without_copying_the_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[list[bytes]] = []  # the pieces of each transport call (write: one; writelines: several)
    made = http1_connection.Connection.connection_made

    def counting(self: http1_connection.Connection, transport: asyncio.BaseTransport) -> None:
        made(self, transport)
        assert isinstance(transport, asyncio.Transport)
        real_write, real_lines = transport.write, transport.writelines

        inside = [False]  # asyncio's writelines calls write: that is still the one call

        def write(data: bytes | bytearray | memoryview) -> None:
            if not inside[0]:
                calls.append([bytes(data)])
            real_write(data)

        def writelines(pieces: Iterable[bytes | bytearray | memoryview]) -> None:
            kept = list(pieces)
            calls.append(kept)  # type: ignore[arg-type]
            inside[0] = True
            try:
                real_lines(kept)
            finally:
                inside[0] = False

        transport.write = write  # type: ignore[method-assign]
        transport.writelines = writelines  # type: ignore[method-assign,assignment]

    monkeypatch.setattr(http1_connection.Connection, "connection_made", counting)
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, body = await read_request(reader)
        seen.append(head + body)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    body = b'{"prompt": "' + b"x" * 100_000 + b'"}'
    async with raw_server(handler) as server, client() as c:
        response = await c.request("POST", server.url + "/base/", "/v1/completions", [("Host", "e")], body)
        assert await body_of(response) == b"ok"
    head = b"POST /base/v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 100014\r\n\r\n"
    assert len(calls) == 1 and [b"".join(calls[0])] == seen
    assert calls[0][0] == head and calls[0][1] is body  # handed over as given, not joined to the head


async def test_first_byte_and_read_timeouts_name_their_phase() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        if b"/partial" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await writer.drain()
        await reader.read()  # then silence until the client goes away

    async with raw_server(handler) as server, client(first_byte_s=0.05, read_s=0.05) as c:
        with pytest.raises(http1.TimedOut) as silent:
            await c.request("POST", server.url, "/silent", [], b"{}")
        response = await c.request("POST", server.url, "/partial", [], b"{}")
        assert await response.next_chunk() == b"abc"
        with pytest.raises(http1.TimedOut) as stalled:
            await response.next_chunk()
    assert (silent.value.phase, stalled.value.phase) == ("first byte", "read")


async def test_connect_failures_and_broken_engines_raise_their_kind() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        if b"/garbage" in head:
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        elif b"/cut" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()  # and close (also what "/silent-close" gets: no answer at all)

    async with raw_server(handler) as server, client() as c:
        with pytest.raises(http1.BadResponse):
            await c.request("POST", server.url, "/garbage", [], b"{}")
        with pytest.raises(http1.ServerDisconnected):
            await c.request("POST", server.url, "/silent-close", [], b"{}")
        response = await c.request("POST", server.url, "/cut", [], b"{}")
        with pytest.raises(http1.ResponseCut):
            await body_of(response)
        closed = server.url
    with pytest.raises(http1.ConnectFailed):
        async with client() as c:
            await c.request("POST", closed, "/", [], b"{}")


async def test_cancelling_a_read_mid_stream_drops_the_connection() -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 0\n\n\r\n")
        await writer.drain()
        assert await reader.read() == b""  # EOF: the client dropped the connection
        gone.set()

    async with raw_server(handler) as server, client() as c:
        response = await c.request("POST", server.url, "/", [], b"{}")
        assert await response.next_chunk() == b"data: 0\n\n"
        reader = asyncio.ensure_future(response.next_chunk())
        await asyncio.sleep(0)  # one scheduling turn: the read blocks on the socket
        reader.cancel()  # what a client disconnect does to the relay
        with pytest.raises(asyncio.CancelledError):
            await reader
        await asyncio.wait_for(gone.wait(), WAIT)
        assert c._pools[server.url].idle == [] and c._in_use == 0


async def test_cancelling_a_request_waiting_for_its_head_drops_the_connection_and_its_timer() -> None:
    gone, asked = asyncio.Event(), asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        asked.set()
        assert await reader.read() == b""  # no answer, then EOF: the client dropped the connection
        gone.set()

    async with raw_server(handler) as server, client() as c:
        task = asyncio.ensure_future(c.request("POST", server.url, "/", [], b"{}"))
        await asyncio.wait_for(asked.wait(), WAIT)
        task.cancel()  # what a client disconnect does while the engine prefills
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(gone.wait(), WAIT)
        assert c._pools[server.url].idle == [] and c._in_use == 0


async def test_an_answered_request_leaves_no_wait_armed() -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=b"ok")

    async with fake_engine(answer) as url, client() as c:
        response = await c.request("POST", url, "/", [("Host", "e")], b"{}")
        conn = response._conn
        assert conn.waiter is None and conn._armed is None  # nothing expires: the timer will lapse
        assert await body_of(response) == b"ok"
        assert conn.waiter is None and conn._armed is None


async def test_arming_on_a_failed_connection_resolves_at_once() -> None:
    loop = asyncio.get_running_loop()
    conn = http1_connection.Connection(loop)
    conn._fail(http1.ServerDisconnected("gone"))
    waiter = conn.arm(WAIT, "first byte")
    assert waiter.done() and waiter.exception() is None  # the caller reads conn.error: no wait
    conn.disarm()
    assert conn.waiter is None and conn._armed is None
    conn.close()
    assert conn.timer is None  # a connection done with lets go of its timer


def holding_engine(release: asyncio.Event, holding: asyncio.Event) -> RawHandler:
    """An engine answering "ok" to each request, but holding a `/hold` one (setting `holding`) until
    `release` is set."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            if b"/hold" in head:
                holding.set()
                await release.wait()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    return handler


async def test_pool_limit_makes_requests_wait_for_a_connection() -> None:
    release, holding = asyncio.Event(), asyncio.Event()

    handler = holding_engine(release, holding)

    async with raw_server(handler) as server, client(pool_per_host=1) as c:
        held = asyncio.ensure_future(c.request("POST", server.url, "/hold", [], b"{}"))
        await asyncio.wait_for(holding.wait(), WAIT)
        waiting = asyncio.ensure_future(c.request("POST", server.url, "/next", [], b"{}"))
        await asyncio.sleep(0)
        assert not waiting.done() and server.connections == 1
        release.set()
        assert await body_of(await asyncio.wait_for(held, WAIT)) == b"ok"
        assert await body_of(await asyncio.wait_for(waiting, WAIT)) == b"ok"
        assert server.connections == 1  # the second request took the first one's kept connection


async def test_a_full_pool_is_waited_for_at_most_pool_wait_s() -> None:
    """No room in the pool within `pool_wait_s`: `PoolFull` naming the limit (the config key), the
    waiter gone from the queue and the pool's counts unchanged; room made later serves the next."""
    release, holding = asyncio.Event(), asyncio.Event()

    handler = holding_engine(release, holding)

    async with raw_server(handler) as server, client(pool_per_host=1, pool_wait_s=0.05) as c:
        held = asyncio.ensure_future(c.request("POST", server.url, "/hold", [], b"{}"))
        await asyncio.wait_for(holding.wait(), WAIT)
        with pytest.raises(http1.PoolFull) as full:
            await asyncio.wait_for(c.request("POST", server.url, "/next", [], b"{}"), WAIT)
        assert (full.value.limit, full.value.size) == ("pool_per_engine", 1)
        assert not c._waiting and c._in_use == 1 and c._pools[server.url].in_use == 1
        release.set()
        assert await body_of(await asyncio.wait_for(held, WAIT)) == b"ok"
        answer = await c.request("POST", server.url, "/next", [], b"{}")
        assert await body_of(answer) == b"ok" and server.connections == 1


def test_keep_alive_on_uvloop() -> None:
    """The gateway runs on uvloop, whose transports are not asyncio's classes."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async def main() -> int:
        async with raw_server(handler) as server, client() as c:
            for _ in range(2):
                assert await body_of(await c.request("POST", server.url, "/", [], b"{}")) == b"ok"
            return server.connections

    assert uvloop.run(main()) == 1


async def test_a_head_answer_ends_at_its_headers() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n")  # the length of a GET's body
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as server, client(read_s=WAIT) as c:
        response = await c.request("HEAD", server.url, "/v1/responses/r1", [], b"")
        assert response.status == 200 and await asyncio.wait_for(body_of(response), WAIT) == b""
        assert c._pools[server.url].idle == [] and c._in_use == 0  # not reused: its framing is unknown


async def test_a_closed_kept_connection_and_a_refused_retry_leave_the_pool_consistent() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()  # then close: the kept connection dies while idle

    async with client() as c:
        async with raw_server(handler) as server:
            assert await body_of(await c.request("POST", server.url, "/", [], b"{}")) == b"ok"
            url = server.url
        with pytest.raises((http1.ConnectFailed, http1.ServerDisconnected)):
            await c.request("POST", url, "/", [], b"{}")  # the kept one is gone, a new one refused
        assert c._in_use == 0 and c._pools[url].in_use == 0


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


async def test_a_pump_gets_each_read_whole_and_leaves_the_end_for_next_chunk() -> None:
    got: list[bytes] = []
    took = [asyncio.Event() for _ in range(3)]

    def sink(data: bytes) -> bool:
        took[len(got)].set()
        got.append(data)
        return True

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"a"))
        await writer.drain()
        for i, data in enumerate((chunk(b"b") + chunk(b"c"), chunk(b"d"))):
            await took[i].wait()  # the next bytes are a read of their own
            writer.write(data)
            await writer.drain()
        await took[2].wait()
        writer.write(chunk(b"e") + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as server, client() as c:
        response = await c.request("POST", server.url, "/", [], b"{}")
        assert await response.next_chunk() == b"a"
        took[0].set()  # "a" went the ordinary way; the pump starts with the next read
        got.append(b"a")
        await asyncio.wait_for(response.pump(sink, _never_called), WAIT)
        assert got == [b"a", b"bc", b"d"]  # one call per read, the events of a read joined
        assert await response.next_chunk() == b"e" and response.at_end()
        assert await response.next_chunk() == b""
        assert c._pools[server.url].idle != []  # read to its end: the connection is kept


async def _never_called() -> None:
    raise AssertionError("the sink never asked to pause")


async def test_a_full_sink_pauses_reading_until_drained() -> None:
    full, drained, done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    got: list[bytes] = []

    def sink(data: bytes) -> bool:
        got.append(data)
        return len(got) > 1  # the first read fills the consumer

    async def drain() -> None:
        full.set()
        await drained.wait()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"a"))
        await writer.drain()
        await full.wait()
        writer.write(chunk(b"b") + b"0\r\n\r\n")
        await writer.drain()
        done.set()
        await reader.read()

    async with raw_server(handler) as server, client() as c:
        response = await c.request("POST", server.url, "/", [], b"{}")
        conn = response._conn
        pump = asyncio.ensure_future(response.pump(sink, drain))
        await asyncio.wait_for(full.wait(), WAIT)
        assert got == [b"a"] and conn.paused  # the socket is not read while the consumer is full
        await asyncio.wait_for(done.wait(), WAIT)
        drained.set()
        await asyncio.wait_for(pump, WAIT)
        assert not conn.paused and await body_of(response) == b"b"


async def test_a_pumped_body_times_out_only_after_read_s_of_silence() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"a"))
        for _ in range(12):  # bytes for longer than read_s, never read_s apart
            await asyncio.sleep(0.05)  # the engine's pace, not synchronisation
            writer.write(chunk(b"b"))
            await writer.drain()
        await reader.read()  # then silence

    got: list[bytes] = []

    def sink(data: bytes) -> bool:
        got.append(data)
        return True

    async with raw_server(handler) as server, client(read_s=0.4) as c:
        response = await c.request("POST", server.url, "/", [], b"{}")
        with pytest.raises(http1.TimedOut) as silent:
            await response.pump(sink, _never_called)
    assert silent.value.phase == "read" and b"".join(got).count(b"b") == 12


async def test_an_engine_breaking_mid_pump_raises_and_drops_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"a"))
        await writer.drain()  # and close, the body unfinished

    async with raw_server(handler) as server, client() as c:
        response = await c.request("POST", server.url, "/", [], b"{}")
        with pytest.raises(http1.ResponseCut):
            await response.pump(lambda data: True, _never_called)
        assert c._pools[server.url].idle == [] and c._in_use == 0


async def test_the_last_bytes_release_the_connection_and_a_later_call_takes_nothing_of_the_next() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in (b"first", b"second"):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
            await writer.drain()

    async with raw_server(handler) as server, client() as c:
        first = await c.request("POST", server.url, "/", [], b"{}")
        got = b""
        while not first.at_end():
            got += await first.next_chunk()
        assert got == b"first"  # no call returned b"": the last bytes alone handed the connection back
        second = await c.request("POST", server.url, "/", [], b"{}")
        assert server.connections == 1
        assert await first.next_chunk() == b""  # the kept connection's bytes are the second answer's
        assert await body_of(second) == b"second"


@pytest.mark.parametrize(
    ("method", "body", "length"),
    [("POST", b"{}", b"Content-Length: 2\r\n"), ("POST", b"", b"Content-Length: 0\r\n"), ("GET", b"", b"")],
)
def test_the_request_head_names_the_body_length_unless_a_bodiless_method_sends_none(
    method: str, body: bytes, length: bytes
) -> None:
    head = http1._head(method, "/v1/x?a=1", [("Host", "e:1"), ("x-request-id", "r")], body)
    assert head == b"%s /v1/x?a=1 HTTP/1.1\r\nHost: e:1\r\nx-request-id: r\r\n%s\r\n" % (
        method.encode(),
        length,
    )


async def test_a_body_that_paused_reading_leaves_its_pooled_connection_reading_again() -> None:
    big = b"x" * (http1_connection.HIGH_WATER + 1000)  # past the mark only with its last bytes

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in (big, b"next"):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
            await writer.drain()

    async with raw_server(handler) as server, client() as c:
        first = await c.request("POST", server.url, "/", [], b"{}")
        conn = first._conn
        async with asyncio.timeout(WAIT):  # nothing consumed: the bytes pile up until reading pauses
            while not conn.paused:
                await asyncio.sleep(0.001)
        assert await body_of(first) == big
        async with asyncio.timeout(WAIT):
            second = await c.request("POST", server.url, "/", [], b"{}")
            assert await body_of(second) == b"next"
        assert server.connections == 1


_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=255), max_size=6)


@given(
    st.sampled_from(["GET", "POST", "HEAD", "DELETE", "PUT"]),
    st.lists(st.tuples(_TEXT, _TEXT), max_size=6),
    st.binary(max_size=3),
)
def test_the_request_head_is_the_one_first_written(
    method: str, headers: list[tuple[str, str]], body: bytes
) -> None:
    """The head joined by C code (map and str.join) is the f-string comprehension's, byte for byte."""
    fields = "".join([f"{k}: {v}\r\n" for k, v in headers])
    length = (
        f"Content-Length: {len(body)}\r\n"
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS")
        else ""
    )
    expected = f"{method} /v1/x HTTP/1.1\r\n{fields}{length}\r\n".encode("latin-1")
    assert http1._head(method, "/v1/x", headers, body) == expected


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.booleans()), min_size=1, max_size=6))
def test_waits_on_one_timer_expire_at_their_own_deadlines(waits: list[tuple[int, bool]]) -> None:
    """Each wait (`timeout` ms; woken before it, or not) on the connection's one timer ends as a wait
    with a timer of its own would: woken, or `TimedOut` no earlier than its deadline (to the loop
    clock's millisecond); the timer is made again only for a deadline earlier than the one set."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        conn = http1_connection.Connection(loop)
        timer_at = None
        for timeout_ms, woken in waits:
            armed_at = loop.time()
            timer = conn.timer
            waiter = conn.arm(timeout_ms / 1000, "read")
            if timer is not None and timer_at is not None and timer_at <= armed_at + timeout_ms / 1000:
                assert conn.timer is timer  # kept: it fires first, then moves on
            timer_at = conn._timer_at
            if woken:
                conn._wake()
            try:
                await waiter
                assert woken
            except http1.TimedOut as exc:
                assert not woken and exc.phase == "read"
                assert loop.time() + 1e-3 >= armed_at + timeout_ms / 1000
            finally:
                conn.disarm()
        conn.close()
        assert conn.timer is None

    asyncio.run(run())
    uvloop.run(run())  # the gateway's loop, whose clock counts milliseconds


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.floats(min_value=0.0, max_value=20.0)), max_size=8),
    st.floats(min_value=0.0, max_value=20.0),
)
def test_the_pool_takes_the_most_recent_connection_not_lost_nor_kept_past_the_keepalive(
    idle: list[tuple[bool, float]], now: float
) -> None:
    """`_Pool.take` (not lost, idle less than keepalive_s): the most recent such connection, in use,
    every later one popped and closed, the earlier ones left idle."""
    client = Http1Client(ClientSettings(keepalive_s=5.0))
    pool = http1._Pool(client, http1._Origin.of("http://127.0.0.1:1"))
    loop = asyncio.new_event_loop()  # never run: the connections only hold it
    conns = []
    for lost, since in idle:
        conn = Connection(loop)
        conn.park(since)
        if lost:
            conn.close()
        conns.append(conn)
    pool.idle = list(conns)
    taken = pool.take(now)
    loop.close()
    usable = [i for i, (lost, since) in enumerate(idle) if not lost and now - since < 5.0]
    expected = usable[-1] if usable else None
    if expected is None:
        assert taken is None and pool.idle == [] and pool.in_use == 0
        assert all(c.lost for c in conns)
    else:
        assert taken is conns[expected] and pool.in_use == 1
        assert taken.may_send_again() and not taken.lost  # taken: a request on it may go again
        assert pool.idle == conns[:expected]
        lost_before = [lost for lost, _ in idle[:expected]]
        assert [c.lost for c in conns] == [*lost_before, False] + [True] * (len(conns) - expected - 1)


class _Recording:
    """A transport stand-in that records what is written on it (and may be closing)."""

    def __init__(self, name: str, writes: list[tuple[str, tuple[bytes, ...]]], closing: bool = False) -> None:
        self.name, self.writes, self.closing = name, writes, closing

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        self.writes.append((self.name, (data,)))

    def writelines(self, pieces: Iterable[bytes]) -> None:
        self.writes.append((self.name, tuple(pieces)))

    def get_extra_info(self, name: str) -> None:
        return None  # no socket: no TCP_NODELAY to set


def _Queued(loop: asyncio.AbstractEventLoop, transport: _Recording) -> Connection:
    """A connection for `_queue` whose transport records what is written on it."""
    conn = Connection(loop)
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn


async def test_queued_requests_go_out_together_at_the_next_turn_each_in_one_write() -> None:
    """`_queue`: one flush per turn; each request's head and body in one call, in order, its
    connection marked written; a connection that closed meanwhile gets nothing."""
    loop = asyncio.get_running_loop()
    writes: list[tuple[str, tuple[bytes, ...]]] = []
    async with client() as c:
        a, b = _Queued(loop, _Recording("a", writes)), _Queued(loop, _Recording("b", writes))
        gone = _Queued(loop, _Recording("gone", writes, True))
        c._queue(a, b"HA", b"BA")
        c._queue(gone, b"HG", b"BG")
        c._queue(b, b"HB", b"")
        assert writes == [] and not a.written  # nothing before the turn ends
        await _after_queued_callbacks(loop)
        assert writes == [("a", (b"HA", b"BA")), ("b", (b"HB",))]
        assert a.written and b.written and not gone.written
        assert c._batch == [] and c._flush_loop is None
        c._queue(a, b"HA2", b"BA2")
        await _after_queued_callbacks(loop)
        assert writes[-1] == ("a", (b"HA2", b"BA2"))

        stale = _Queued(loop, _Recording("stale", writes))
        c._batch.append((stale, b"HS", b"BS"))
        c._flush_loop = asyncio.new_event_loop()  # a flush scheduled on a loop that stopped first
        c._flush_loop.close()
        c._queue(b, b"HB2", b"")
        await _after_queued_callbacks(loop)
        assert writes[-1:] == [("b", (b"HB2",))] and all(name != "stale" for name, _ in writes)


async def _after_queued_callbacks(loop: asyncio.AbstractEventLoop) -> None:
    """Return once every callback scheduled so far has run (the loop runs them in order)."""
    done = loop.create_future()
    loop.call_soon(done.set_result, None)
    await done


async def test_requests_started_in_one_turn_are_written_after_it_when_others_are_in_flight() -> None:
    """Alone, a request goes out at once; with others in flight, the requests routed in one turn
    are queued, each in its own turn, and go out together once it ends."""
    order: list[str] = []
    release, three_in = asyncio.Event(), asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            order.append("in " + head.split(b" ")[1].decode())
            if len([o for o in order if o.startswith("in /r")]) == 3:
                three_in.set()
            await release.wait()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async with raw_server(handler) as server, client() as c:
        warm = [c.request("POST", server.url, f"/w{i}", [], b"{}") for i in range(3)]
        release.set()
        for response in await asyncio.gather(*warm):  # three kept connections
            assert await body_of(response) == b"ok"
        order.clear()
        release.clear()
        send, queue = Connection.send, Http1Client._queue

        def recorded(conn: Connection, head: bytes, body: bytes) -> None:
            order.append("write " + head.split(b" ")[1].decode())
            send(conn, head, body)

        def queued(client: Http1Client, conn: Connection, head: bytes, body: bytes) -> None:
            order.append("queue " + head.split(b" ")[1].decode())
            queue(client, conn, head, body)

        tasks = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Connection, "send", recorded)
            patch.setattr(Http1Client, "_queue", queued)
            for i in range(3):
                tasks.append(asyncio.ensure_future(c.request("POST", server.url, f"/r{i}", [], b"{}")))
            await asyncio.wait_for(three_in.wait(), WAIT)
        release.set()
        for response in await asyncio.gather(*tasks):
            assert response.status == 200 and await body_of(response) == b"ok"
        assert order[:5] == ["write /r0", "queue /r1", "queue /r2", "write /r1", "write /r2"]
        assert server.connections == 3


async def test_a_request_cancelled_while_its_write_is_queued_is_written_then_dropped() -> None:
    """The flush was scheduled before the cancellation can reach the task: the bytes go out, then
    the connection is dropped, as when the write was the task's own."""
    seen: list[bytes] = []
    first_in = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, _ = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            seen.append(head.split(b" ")[1])
            first_in.set()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async with raw_server(handler) as server, client() as c:
        warm = await asyncio.gather(*[c.request("POST", server.url, "/w", [], b"{}") for _ in range(2)])
        for response in warm:
            assert await body_of(response) == b"ok"
        seen.clear()
        tasks: list[asyncio.Future[Http1Response]] = []
        queue = Http1Client._queue

        def cancel_queued(client: Http1Client, conn: Connection, head: bytes, body: bytes) -> None:
            queue(client, conn, head, body)  # the write queued: cancelled in the task's own turn
            assert c._batch and c._in_use == 2
            tasks[1].cancel()

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Http1Client, "_queue", cancel_queued)
            tasks.append(asyncio.ensure_future(c.request("POST", server.url, "/first", [], b"{}")))
            tasks.append(asyncio.ensure_future(c.request("POST", server.url, "/queued", [], b"{}")))
            with pytest.raises(asyncio.CancelledError):
                await tasks[1]
        assert await body_of(await tasks[0]) == b"ok"
        assert sorted(seen) == [b"/first", b"/queued"] and c._in_use == 0
        assert len(c._pools[server.url].idle) == 1  # the cancelled one's connection was dropped
