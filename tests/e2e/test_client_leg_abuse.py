"""The gateway's own HTTP server against abusive clients, over raw sockets on 127.0.0.1 (#33 items 0, 3).

A battery: each test states what the client leg must do whatever the HTTP code underneath becomes
(router/edge/client_protocol.py and client_limits.py, in uvicorn through its `http=` seam):

- an upgrade request is answered and its connection closed (uvicorn's upgrade path);
- an answer given before the request body is all in (413) closes the connection: the rest is not read;
- a chunked body's trailer fields never join the request's headers (an API key only there is none);
- a head past `limits.client_max_header_bytes` or `client_max_headers` is answered 431 and closed;
- a client pipelining requests without reading the answers gets no more than
  `limits.client_max_pipelined` of them parsed: the gateway stops reading (its sends block), and a
  request parsed past the limit closes the connection after the answers due.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest

from router.core.errors import ErrorBody
from router.edge.client_protocol import ClientHttpProtocol
from router.settings.config import Limits, Timeouts
from tests.gateway_helpers import (
    ADMIN,
    Gateway,
    engine_of,
    gateway_config,
    metric,
    running_gateway,
    running_stubs,
    wait_for,
)

KEY = "k1"
BODY = b'{"model": "kvrouter-stub", "prompt": "the quick brown fox", "max_tokens": 1}'
LIMITS = Limits(
    max_body_bytes=4096,
    client_max_header_bytes=4096,
    client_max_headers=20,
    client_max_pipelined=4,
    client_max_discard_bytes=64 << 10,
)


@asynccontextmanager
async def abused_gateway(limits: Limits = LIMITS) -> AsyncIterator[Gateway]:
    """The gateway over one engine stub, with `limits` and an API key."""
    environ = {"KVROUTER_API_KEYS": KEY, "KVROUTER_ADMIN_TOKEN": ADMIN}
    async with running_stubs(1) as stubs:
        async with running_gateway(
            gateway_config([engine_of("e0", stubs[0])], limits=limits), environ=environ
        ) as gw:
            yield gw


def post(
    *extra: bytes,
    body: bytes = BODY,
    length: int | None = None,
    key: str = KEY,
    path: str = "/v1/completions",
) -> bytes:
    """A keyed POST (to the hot route) with `body` (announced as `length` bytes, when given)."""
    head = [b"POST %s HTTP/1.1" % path.encode(), b"host: x", b"authorization: Bearer " + key.encode()]
    announced = len(body) if length is None else length
    head += [b"content-type: application/json", b"content-length: %d" % announced, *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def connect(gw: Gateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = gw.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def exchange(gw: Gateway, data: bytes) -> bytes:
    """Everything the gateway sends to a client that sends `data` and reads, until it closes (a reset
    after its answers counts as closing): a TimeoutError if it never does."""
    reader, writer = await connect(gw)
    writer.write(data)
    return await until_closed(reader, writer)


async def until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    out = bytearray()
    try:
        async with asyncio.timeout(10.0):
            while chunk := await reader.read(65536):
                out += chunk
    except ConnectionResetError:  # closed with the client's bytes unread: the answers came first
        pass
    finally:
        writer.close()
    return bytes(out)


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer[9:12])


async def rejected(gw: Gateway, reason: str) -> float:
    return metric((await gw.client.get("/metrics")).text, "kvrouter_rejected_requests_total", reason=reason)


async def test_an_upgrade_request_is_answered_and_closed() -> None:
    """uvicorn's upgrade path: a WebSocket handshake goes to its WebSocket protocol, which refuses it
    (4xx: the gateway has no WebSocket route; not a handshake; not a GET) and closes, on any path."""
    upgrade = b"connection: Upgrade\r\nupgrade: websocket\r\nsec-websocket-version: 13\r\n"
    key = b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    async with abused_gateway() as gw:
        for head in (
            b"GET /health HTTP/1.1\r\nhost: x\r\n" + upgrade + key,
            b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + upgrade,
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + upgrade + key,
        ):
            answer = await exchange(gw, head + b"\r\n")  # a TimeoutError if never closed
            assert 400 <= status_of(answer) < 500, answer


class Blast:
    """A raw client socket sending `data` and then `filler` (1 MiB at a time) up to `total` bytes,
    reading nothing, until the gateway closes the connection: how much it sent, and what it was
    answered (read once it stops: the answers come before the reset)."""

    def __init__(self, gw: Gateway, data: bytes, filler: bytes, total: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])))
        self.sock.setblocking(False)
        self.data, self.filler, self.total = data, filler * ((1 << 20) // len(filler)), total
        self.sent = 0

    async def run(self) -> BaseException | None:
        """Send until all is sent (None) or the connection breaks (its error); 30 s at most (a bound)."""
        task = asyncio.create_task(self._send())
        done, _ = await asyncio.wait({task}, timeout=30.0)
        task.cancel()
        return task.exception() if task in done else TimeoutError()

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(self.sock, self.data)
        self.sent = len(self.data)
        while self.sent < self.total:
            await loop.sock_sendall(self.sock, self.filler)
            self.sent += len(self.filler)

    def answers(self) -> bytes:
        out = bytearray()
        try:
            while chunk := self.sock.recv(1 << 16):
                out += chunk
        except ConnectionResetError:  # after the answers (the client's bytes unread)
            pass
        finally:
            self.sock.close()
        return bytes(out)


async def test_an_answer_before_the_body_reads_little_more_of_it() -> None:
    """A 413 refused from Content-Length (10 GB announced), or a 401 (1 GB announced): the gateway
    reads and drops at most `limits.client_max_discard_bytes` more of the body (64 KiB here), so the
    client, sending on, reads its answer, and then closes the connection: 64 MB never get out."""
    async with abused_gateway() as gw:
        for request, status in (
            (post(body=b"", length=10_000_000_000), 413),
            (post(body=b"", length=1_000_000_000, key="nope"), 401),
        ):
            blast = Blast(gw, request, b"x", 64 << 20)
            assert isinstance(await blast.run(), ConnectionError)
            answer = blast.answers()
            assert blast.sent < 64 << 20 and status_of(answer) == status, (blast.sent, answer)
            assert answer.count(b"HTTP/1.1 ") == 1

        # A body over the limit that fits the discard is read and dropped: the connection serves on.
        answer = await exchange(gw, post(body=b"x" * 20_000) + post(b"connection: close"))
        assert [int(a[:3]) for a in answer.split(b"HTTP/1.1 ")[1:]] == [413, 200], answer


async def test_with_no_discard_an_answer_before_the_body_closes_at_once() -> None:
    """`client_max_discard_bytes = 0`: the connection closes right after the 413, nothing more read."""
    async with abused_gateway(msgspec.structs.replace(LIMITS, client_max_discard_bytes=0)) as gw:
        answer = await exchange(gw, post(body=b"", length=10_000_000_000))  # no body byte sent
        assert status_of(answer) == 413 and answer.count(b"HTTP/1.1 ") == 1, answer


async def test_the_drain_after_an_early_answer_is_bounded_in_time_too() -> None:
    """A client that drips the rest of a refused body, a byte at a time, never reaching the discard
    bound: the connection still closes, `timeouts.client_header_s` after the first byte that came
    after the 413 (the drain is bounded in time as in bytes, as docs/gateway.md says)."""
    environ = {"KVROUTER_API_KEYS": KEY}
    async with running_stubs(1) as stubs:
        config = gateway_config(
            [engine_of("e0", stubs[0])], limits=LIMITS, timeouts=Timeouts(client_header_s=1.0)
        )
        async with running_gateway(config, environ=environ) as gw:
            reader, writer = await connect(gw)
            writer.write(post(body=b"", length=10_000_000_000))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
            assert status_of(head) == 413, head
            dripped = 0
            async with asyncio.timeout(30.0):  # a drain bounded only in bytes would drip on past this
                while not reader.at_eof():
                    try:
                        writer.write(b"x")
                        await writer.drain()
                    except ConnectionError:
                        break
                    dripped += 1
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(reader.read(1 << 16), 0.05)  # the drip's pace
            writer.close()
    assert dripped < LIMITS.client_max_discard_bytes, dripped


def chunked(trailer: bytes, path: str = "/v1/completions", close: bool = True) -> bytes:
    """A chunked POST of `BODY` ending with the `trailer` fields (each ending with CRLF)."""
    head = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
    head = head % path.encode() + (b"connection: close\r\n" if close else b"")
    return head + b"\r\n%x\r\n%s\r\n0\r\n%s\r\n" % (len(BODY), BODY, trailer)


async def test_trailer_fields_are_never_headers() -> None:
    """An API key sent only in a chunked body's trailers is no key (the hot route and a passthrough
    route), and a trailer never becomes a header of the next request on the connection."""
    key = b"authorization: Bearer k1\r\n"
    async with abused_gateway() as gw:
        for path in ("/v1/completions", "/v1/embeddings"):
            for trailer in (key, key + b"x-other: 1\r\n", b"x-other: 1\r\n" + key):
                answer = await exchange(gw, chunked(trailer, path))
                assert status_of(answer) == 401, (path, trailer, answer)
        unkeyed = post(b"connection: close").replace(b"authorization: Bearer k1\r\n", b"")
        answer = await exchange(gw, chunked(key, close=False) + unkeyed)
        assert answer.count(b"HTTP/1.1 401 ") == 2, answer
        answer = await exchange(gw, chunked(b"x-other: 1\r\n").replace(b"host: x", b"host: x\r\n" + key[:-2]))
        assert status_of(answer) == 200, answer  # a key in the head, trailers beside it: served


async def test_a_head_past_the_limits_is_answered_431_and_closed() -> None:
    """Too many fields, too many bytes in a field, a target too long, a field trickled in pieces: 431
    (OpenAI format) and closed, counted; a head within the limits is served. Trailers past the limits
    close the connection (the request gets no answer), and so does the answer due before a head past
    them (it says `connection: close`; the head gets no answer)."""
    many = b"".join(b"x-%d: 1\r\n" % i for i in range(20))
    async with abused_gateway() as gw:
        refused = [
            post(many[:-2]),  # 4 + 20 fields
            post(b"x-big: " + b"a" * 4096),
            b"GET /health?" + b"q" * 4096 + b" HTTP/1.1\r\nhost: x\r\n\r\n",
        ]
        for request in refused:
            answer = await exchange(gw, request)
            assert status_of(answer) == 431, answer
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b"connection: close" in head
            assert msgspec.json.decode(body, type=ErrorBody).error.code == "header_too_large"

        # One field sent in pieces, never whole (httptools buffers it, calling nothing): refused once
        # the pieces pass the limit.
        reader, writer = await connect(gw)
        writer.write(b"GET /health HTTP/1.1\r\nx-long: ")
        try:
            for _ in range(64):
                writer.write(b"a" * 512)
                await writer.drain()
        except ConnectionError:  # refused and closed already
            pass
        assert status_of(await until_closed(reader, writer)) == 431

        fields = b"".join(b"x-t%d: 1\r\n" % i for i in range(30))
        assert await exchange(gw, chunked(fields)) == b""  # trailers past the count: closed, no answer
        # A trailer field in pieces, never whole: closed, no answer (the body never ended).
        reader, writer = await connect(gw)
        writer.write(chunked(b"x-t: ")[:-2].replace(b"host: x", b"host: x\r\nauthorization: Bearer k1"))
        try:
            for _ in range(64):
                writer.write(b"a" * 512)
                await writer.drain()
        except ConnectionError:
            pass
        assert await until_closed(reader, writer) == b""

        # Behind an answer due, a head past the limits gets none: that answer closes the connection.
        answer = await exchange(gw, post() + post(many[:-2]))
        assert answer.count(b"HTTP/1.1 ") == 1 and status_of(answer) == 200, answer
        assert b"connection: close" in answer.partition(b"\r\n\r\n")[0]

        within = post(many[: many.index(b"x-14")].rstrip(), b"x-big: " + b"a" * 3000, b"connection: close")
        assert status_of(await exchange(gw, within)) == 200  # 20 fields, 3.3 kB
        await wait_for(lambda: _reached(gw, "header_too_large", 7))
        text = (await gw.client.get("/metrics")).text
        assert metric(text, "kvrouter_requests_total", engine="none", status="431") == 4  # answered ones


async def _reached(gw: Gateway, reason: str, n: float) -> bool:
    return await rejected(gw, reason) == n


Waiting = dict[tuple[str, int] | None, list[tuple[int, bool]]]


def record_waiting(monkeypatch: pytest.MonkeyPatch) -> Waiting:
    """From now on, after every request head the gateway parses, by client address: how many
    requests wait on its connection, and whether the connection's reading is held."""
    seen: Waiting = {}
    parsed = ClientHttpProtocol.on_headers_complete

    def recording(self: ClientHttpProtocol) -> None:
        parsed(self)
        seen.setdefault(self.client, []).append((len(self.pipeline), getattr(self.flow, "held", False)))

    monkeypatch.setattr(ClientHttpProtocol, "on_headers_complete", recording)
    return seen


async def test_requests_pipelined_to_the_limit_hold_the_connections_reading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Five requests in one write: one answered while four wait, the limit: the connection is not read
    meanwhile (no request cycle's `receive` resumes it), and is again once one is answered; all are
    answered in order, and the next request on the connection too."""
    waiting = record_waiting(monkeypatch)
    async with abused_gateway() as gw:
        reader, writer = await connect(gw)
        seen = waiting.setdefault(writer.get_extra_info("sockname"), [])
        writer.write(post() * 5)
        for _ in range(5):
            head = await reader.readuntil(b"\r\n\r\n")
            assert status_of(head) == 200, head
            await reader.readexactly(int(head.partition(b"content-length: ")[2].partition(b"\r\n")[0]))
        assert seen == [(0, False), (1, False), (2, False), (3, False), (4, True)]
        writer.write(post(b"connection: close"))
        assert status_of(await until_closed(reader, writer)) == 200
        assert await rejected(gw, "pipelined_too_deep") == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings"])  # the hot route, uvicorn's cycle
async def test_pipelined_requests_unread_are_bounded_per_connection(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """A client sends 32 MB of pipelined requests and reads nothing: no more than
    `client_max_pipelined` (4) of them wait parsed at any time, the gateway stops reading, and, as
    more than that came in one read, closes the connection after the answers due (the last saying
    `connection: close`): the client never gets its 32 MB out."""
    waiting = record_waiting(monkeypatch)
    async with abused_gateway() as gw:
        blast = Blast(gw, b"", post(path=path), 32 << 20)
        seen = waiting.setdefault(blast.sock.getsockname(), [])
        assert isinstance(await blast.run(), ConnectionError)
        assert blast.sent < 32 << 20 and max(seen) <= (LIMITS.client_max_pipelined, True), (
            blast.sent,
            max(seen),
        )
        answers = blast.answers()
        heads = answers.count(b"HTTP/1.1 ")
        assert heads == len(seen) and answers.count(b"connection: close") == 1, (heads, len(seen))
        assert await rejected(gw, "pipelined_too_deep") == 1
