"""The upstream client never hands one request's answer to another: scripted engines on 127.0.0.1:0
answer each request in their own way (interim 1xx answers first, early, split, with extra bytes or a
forged second answer, short, long, impossible status lines, garbage) over pooled keep-alive
connections, and every request gets exactly its own answer or an error, never another's bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import httptools
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from router.edge.http1 import ClientSettings, Http1Client, HttpClientError

WAIT: Final = 5.0
LATER: Final = 0.005
"""A delay that puts a piece of an answer in a later read than the one before (not a synchronisation:
what is asserted holds whichever read the bytes come in)."""

BEHAVIOURS: Final = (
    "ok",  # a plain answer
    "chunked",  # a chunked answer
    "interim",  # 100 Continue and 103 Early Hints (with headers), then the answer, in one write
    "interim_later",  # 100 Continue now, the answer in a later write: the attack of issue #33
    "early",  # the answer as soon as the head is in, before the body is read
    "split",  # the answer's head and body in writes apart
    "extra",  # the answer and a forged second answer in one write
    "long",  # more body bytes than the Content-Length says
    "garbage_after",  # the answer, then bytes no parser takes, in one write
    "short_close",  # fewer body bytes than the Content-Length says, then the connection closes
    "status_099",  # a status line outside 100-599
    "status_101",  # switching protocols, never asked for
    "status_700",
    "no_content_body",  # 204 with a body after it
    "close",  # Connection: close
)
"""How the scripted engine answers a request (chosen per request)."""


def _answer(rid: bytes, *, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    body = b"answer-to-" + rid
    return b"HTTP/1.1 " + status + b"\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def _script(behaviour: str, rid: bytes) -> list[bytes]:
    """The writes that answer request `rid`, each after the one before by `LATER` (b"" closes)."""
    own = _answer(rid)
    forged = _answer(b"forged")
    if behaviour == "chunked":
        body = b"answer-to-" + rid
        return [
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        ]
    if behaviour == "interim":
        return [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + own]
    if behaviour == "interim_later":
        return [b"HTTP/1.1 100 Continue\r\n\r\n", own]
    if behaviour == "split":
        return [own[: own.index(b"\r\n\r\n") + 4], own[own.index(b"\r\n\r\n") + 4 :]]
    if behaviour == "extra":
        return [own + forged]
    if behaviour == "long":
        return [own + b"-and-more-bytes"]
    if behaviour == "garbage_after":
        return [own + b"\x00\x01 not http at all"]
    if behaviour == "short_close":
        return [own[:-3], b""]
    if behaviour.startswith("status_"):
        return [_answer(rid, status=behaviour[-3:].encode() + b" Odd")]
    if behaviour == "no_content_body":
        return [b"HTTP/1.1 204 No Content\r\n\r\n" + forged]
    if behaviour == "close":
        return [_answer(rid, extra=b"Connection: close\r\n"), b""]
    return [own]


class _Engine(asyncio.Protocol):
    """One connection of the scripted engine: parses requests (httptools) and answers each by its
    `x-id`'s behaviour, in order."""

    def __init__(self, behaviours: dict[bytes, str]) -> None:
        self.behaviours = behaviours
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.rid = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-id":
            self.rid = value

    def on_headers_complete(self) -> None:
        if self.behaviours[self.rid] == "early":
            self._send(_script("ok", self.rid))

    def on_message_complete(self) -> None:
        behaviour = self.behaviours[self.rid]
        if behaviour != "early":
            self._send(_script(behaviour, self.rid))

    def _send(self, writes: list[bytes]) -> None:
        transport = self.transport
        assert transport is not None
        loop = asyncio.get_running_loop()
        for i, data in enumerate(writes):
            loop.call_later(i * LATER, _write_or_close, transport, data)


def _write_or_close(transport: asyncio.Transport, data: bytes) -> None:
    if transport.is_closing():
        return
    if data:
        transport.write(data)
    else:
        transport.close()


@asynccontextmanager
async def scripted_engine(behaviours: dict[bytes, str]) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Engine(behaviours), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def _exchange(c: Http1Client, url: str, rid: bytes, size: int) -> tuple[int, bytes] | HttpClientError:
    """One request: (status, whole body), or the client's error."""
    try:
        async with asyncio.timeout(WAIT):
            answer = await c.request("POST", url, "/v1/x", [("x-id", rid.decode())], b"b" * size)
            body = b""
            while chunk := await answer.next_chunk():
                body += chunk
            return answer.status, body
    except HttpClientError as exc:
        return exc


async def _run(plan: list[tuple[str, int]], parallel: int, pool_per_host: int) -> None:
    behaviours = {b"r%d" % i: behaviour for i, (behaviour, _) in enumerate(plan)}
    c = Http1Client(ClientSettings(pool_per_host=pool_per_host, first_byte_s=WAIT, read_s=WAIT))
    async with scripted_engine(behaviours) as url:
        lanes = [plan[i::parallel] for i in range(parallel)]
        starts = [list(range(i, len(plan), parallel)) for i in range(parallel)]

        async def lane(index: int) -> list[tuple[bytes, tuple[int, bytes] | HttpClientError]]:
            out = []
            for number, (_, size) in zip(starts[index], lanes[index], strict=True):
                rid = b"r%d" % number
                out.append((rid, await _exchange(c, url, rid, size)))
            return out

        results = [r for rs in await asyncio.gather(*(lane(i) for i in range(parallel))) for r in rs]
    c.close()
    for rid, result in results:
        behaviour = behaviours[rid]
        if isinstance(result, HttpClientError):
            # Only an answer that is itself wrong may fail; a sound one never fails for another's.
            assert behaviour not in (
                "ok",
                "chunked",
                "interim",
                "interim_later",
                "early",
                "split",
                "close",
            ), (
                rid,
                behaviour,
                result,
            )
            continue
        status, body = result
        if behaviour == "no_content_body":
            assert (status, body) == (204, b""), (rid, behaviour, result)
        else:
            assert (status, body) == (200, b"answer-to-" + rid), (rid, behaviour, result)


PLANS = st.lists(st.tuples(st.sampled_from(BEHAVIOURS), st.integers(0, 3000)), min_size=1, max_size=10)


@settings(max_examples=60, deadline=None)
@given(PLANS, st.integers(1, 3), st.integers(1, 2))
def test_every_request_gets_its_own_answer_or_an_error(
    plan: list[tuple[str, int]], parallel: int, pool_per_host: int
) -> None:
    """Requests in `parallel` lanes over at most `pool_per_host` pooled connections, each answered as
    its behaviour says: a sound answer is delivered whole to its own request; a broken one fails its
    own request or is cut to its sound first answer; none ever reaches another request."""
    asyncio.run(_run(plan, parallel, pool_per_host))


def test_interim_answers_then_the_answer_on_the_gateways_loop() -> None:
    """The attack of issue #33 on uvloop (the gateway's loop): a 100 Continue, the answer later, and
    the next requests on the same connection each get their own answer."""
    plan = [("interim_later", 10), ("ok", 10), ("interim", 0), ("ok", 5), ("extra", 1), ("ok", 1)]
    uvloop.run(_run(plan, 1, 1))


async def _one_answer(answer: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes] | HttpClientError:
    """The client's reading of `answer` to one request: status, headers, body; or its error."""

    class Engine(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(answer)  # type: ignore[attr-defined]

    loop = asyncio.get_running_loop()
    server = await loop.create_server(Engine, "127.0.0.1", 0)
    c = Http1Client(ClientSettings(first_byte_s=WAIT, read_s=WAIT))
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        got = await c.request("GET", url, "/", [], b"")
        body = b""
        while chunk := await got.next_chunk():
            body += chunk
        return got.status, got.raw_headers, body
    except HttpClientError as exc:
        return exc
    finally:
        c.close()
        server.close()


async def test_an_answers_head_is_bounded_and_its_trailers_are_no_headers() -> None:
    """More than MAX_HEADER_FIELDS fields, or more than MAX_HEAD_BYTES of them, is a BadResponse; a
    chunked answer's trailer fields never join its headers."""
    from router.edge.http1_connection import MAX_HEAD_BYTES, MAX_HEADER_FIELDS
    from router.edge.http1_errors import BadResponse

    many = b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADER_FIELDS + 1))
    assert isinstance(
        await _one_answer(b"HTTP/1.1 200 OK\r\n" + many + b"Content-Length: 0\r\n\r\n"), BadResponse
    )
    fields = b"".join(b"X-%d: %s\r\n" % (i, b"v" * 1000) for i in range(MAX_HEAD_BYTES // 1000 + 1))
    assert isinstance(
        await _one_answer(b"HTTP/1.1 200 OK\r\n" + fields + b"Content-Length: 0\r\n\r\n"), BadResponse
    )
    at_limit = b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADER_FIELDS - 1))
    ok = await _one_answer(b"HTTP/1.1 200 OK\r\n" + at_limit + b"Content-Length: 2\r\n\r\n{}")
    assert not isinstance(ok, HttpClientError) and ok[0] == 200 and ok[2] == b"{}"
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-Trailer: t\r\n\r\n"
    got = await _one_answer(chunked)
    assert not isinstance(got, HttpClientError)
    assert got[2] == b"{}" and [name for name, _ in got[1]] == [b"Transfer-Encoding"]
